#!/usr/bin/env python3
"""Soak test of `deltafin serve`: for a bounded time, many concurrent clients mix streamed and whole replies,
n > 1, cancellations mid-stream, conversations that extend earlier prompts (prefix reuse), and oversize and
malformed requests, against a generated model whose routed experts stream from disk through a small cache.

Reports throughput, p50/p99 latency, errors by kind, the server's RSS over time and, at the end, the
generations /metrics still counts as active or queued. Exits non-zero on any error that was not provoked on
purpose, on sessions left behind, on a server that did not stop cleanly, and (with --max-rss-growth) on RSS
after warm-up growing more than that fraction. Talks to 127.0.0.1 only. Python's standard library only.

  tools/soak/soak.py --deltafin target/release/deltafin --seconds 60
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict

MAX_BODY_MB = 1

# Kinds of request and how often each client picks them. A kind ending in "!" is an error provoked on
# purpose: it must get exactly its expected status.
MIX = [
    ("chat", 14),
    ("chat_stream", 14),
    ("chat_n2", 6),
    ("chat_cancel", 8),
    ("conversation", 10),
    ("completion_n2", 6),
    ("completion_stream", 6),
    ("messages", 6),
    ("messages_stream", 6),
    ("responses_stream", 6),
    ("oversize!", 3),
    ("malformed_json!", 3),
    ("bad_field!", 3),
    ("unknown_route!", 2),
]
PROVOKED = {"oversize!": 413, "malformed_json!": 400, "bad_field!": 400, "unknown_route!": 404}

WORDS = "the a colour river stone light quiet seven blue north window bread music cold early".split()


class Failure(Exception):
    """An unexpected outcome, named by its kind (the error tally's key)."""

    def __init__(self, kind, detail=""):
        super().__init__(f"{kind}: {detail}")
        self.kind = kind


class Client:
    def __init__(self, port, rng, timeout):
        self.port = port
        self.rng = rng
        self.timeout = timeout
        self.history = []

    def words(self, lo, hi):
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def connect(self):
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)

    def post(self, path, body, stream=False):
        """Sends a request; returns (connection, response) with the response unread."""
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn = self.connect()
        try:
            conn.request("POST", path, data, {"Content-Type": "application/json"})
            return conn, conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            raise Failure("connection", repr(e))

    def whole(self, path, body, want=200):
        conn, r = self.post(path, body)
        try:
            raw = r.read()
        except (OSError, http.client.HTTPException) as e:
            raise Failure("connection", repr(e))
        finally:
            conn.close()
        if r.status != want:
            raise Failure(f"status_{r.status}", raw[:200].decode(errors="replace"))
        if want != 200:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            raise Failure("bad_json_reply", raw[:200].decode(errors="replace"))

    def events(self, path, body, stop_after=None):
        """Reads an SSE stream; returns its data payloads (stops early, closing the connection, after
        `stop_after` events: a client that goes away mid-stream)."""
        conn, r = self.post(path, body)
        out = []
        try:
            if r.status != 200:
                raise Failure(f"status_{r.status}", r.read()[:200].decode(errors="replace"))
            while True:
                line = r.readline()
                if not line:
                    break
                line = line.strip()
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
                    if stop_after is not None and len(out) >= stop_after:
                        return out
        except (OSError, http.client.HTTPException) as e:
            raise Failure("connection", repr(e))
        finally:
            conn.close()
        return out

    def chat_body(self, **extra):
        body = {
            "model": "soak",
            "messages": [{"role": "user", "content": self.words(3, 12)}],
            "max_tokens": self.rng.randint(4, 16),
            "temperature": self.rng.choice([0, 0.8]),
            "seed": self.rng.randint(0, 1 << 30),
        }
        body.update(extra)
        return body

    def run(self, kind):
        """Runs one request of `kind`; returns the completion tokens it reported (0 if none)."""
        if kind == "chat":
            return self.whole("/v1/chat/completions", self.chat_body())["usage"]["completion_tokens"]
        if kind == "chat_n2":
            v = self.whole("/v1/chat/completions", self.chat_body(n=2))
            if len(v["choices"]) != 2:
                raise Failure("wrong_choice_count", str(len(v["choices"])))
            return v["usage"]["completion_tokens"]
        if kind == "chat_stream":
            ev = self.events("/v1/chat/completions", self.chat_body(stream=True))
            if not ev or ev[-1] != b"[DONE]":
                raise Failure("stream_not_done", repr(ev[-1:]))
            return len(ev) - 1
        if kind == "chat_cancel":
            self.events("/v1/chat/completions", self.chat_body(stream=True, max_tokens=64), stop_after=2)
            return 0
        if kind == "conversation":
            # Each turn repeats the conversation so far, so its prompt extends a stored state.
            if len(self.history) > 8:
                self.history = []
            self.history.append({"role": "user", "content": self.words(3, 10)})
            v = self.whole("/v1/chat/completions", self.chat_body(messages=self.history, temperature=0))
            self.history.append({"role": "assistant", "content": v["choices"][0]["message"]["content"] or ""})
            return v["usage"]["completion_tokens"]
        if kind == "completion_n2":
            body = {"model": "soak", "prompt": self.words(2, 8), "max_tokens": 8, "n": 2, "temperature": 0.7}
            v = self.whole("/v1/completions", body)
            if len(v["choices"]) != 2:
                raise Failure("wrong_choice_count", str(len(v["choices"])))
            return v["usage"]["completion_tokens"]
        if kind == "completion_stream":
            body = {"model": "soak", "prompt": self.words(2, 8), "max_tokens": 8, "stream": True}
            ev = self.events("/v1/completions", body)
            if not ev or ev[-1] != b"[DONE]":
                raise Failure("stream_not_done", repr(ev[-1:]))
            return len(ev) - 1
        if kind in ("messages", "messages_stream"):
            body = {
                "model": "soak",
                "max_tokens": self.rng.randint(4, 12),
                "messages": [{"role": "user", "content": self.words(3, 10)}],
                "stream": kind == "messages_stream",
            }
            if kind == "messages":
                return self.whole("/v1/messages", body)["usage"]["output_tokens"]
            ev = self.events("/v1/messages", body)
            if not ev or b"message_stop" not in ev[-1]:
                raise Failure("stream_not_done", repr(ev[-1:]))
            return 0
        if kind == "responses_stream":
            body = {"model": "soak", "input": self.words(3, 10), "max_output_tokens": 8, "stream": True}
            ev = self.events("/v1/responses", body)
            # Incomplete: stopped by max_output_tokens.
            if not ev or json.loads(ev[-1]).get("type") not in ("response.completed", "response.incomplete"):
                raise Failure("stream_not_done", repr(ev[-1:])[:200])
            return 0
        if kind == "oversize!":
            body = self.chat_body()
            body["messages"][0]["content"] = "x" * (MAX_BODY_MB << 20)
            self.whole("/v1/chat/completions", body, want=413)
            return 0
        if kind == "malformed_json!":
            self.whole("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}', want=400)
            return 0
        if kind == "bad_field!":
            self.whole("/v1/chat/completions", self.chat_body(max_tokens="many", n=-1), want=400)
            return 0
        if kind == "unknown_route!":
            self.whole("/v1/no/such/route", self.chat_body(), want=404)
            return 0
        raise ValueError(kind)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port, path, timeout=10):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def metric(text, name):
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def metric_sum(text, name):
    return sum(float(l.rsplit(" ", 1)[1]) for l in text.splitlines() if l.startswith(name + "{"))


def rss_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def pct(values, p):
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deltafin", default="target/release/deltafin")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--preset", default="tiny", help="make-model preset of the generated K3 (tiny or small)")
    ap.add_argument("--model", help="serve this checkpoint instead of generating one")
    ap.add_argument("--expert-cache", default="64K", help="RAM for cached experts: small, so experts stream")
    ap.add_argument("--prefix-cache-mb", type=int, default=16, help="small, so it fills during warm-up")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before RSS counts")
    ap.add_argument("--max-rss-growth", type=float, help="fail if RSS after warm-up grows more than this")
    ap.add_argument("--json", help="write the report here as JSON")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory(prefix="deltafin-soak-")
    model = args.model
    if not model:
        model = os.path.join(tmp.name, "model")
        subprocess.run([args.deltafin, "make-model", "--arch", "kimi_k3", "--preset", args.preset,
                        "--out", model], check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    log = open(os.path.join(tmp.name, "server.log"), "w+")
    server = subprocess.Popen(
        [args.deltafin, "serve", "--model", model, "--host", "127.0.0.1", "--port", str(port),
         "--served-model-name", "soak", "--expert-cache", args.expert_cache, "--threads", str(args.threads),
         "--max-active", "4", "--queue", str(4 * args.clients), "--max-body-mb", str(MAX_BODY_MB),
         "--prefix-cache-mb", str(args.prefix_cache_mb), "--shutdown-grace-secs", "10"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        report = soak(args, port, server)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "killed after 30 s"
    report["server_exit"] = code
    if code != 0:
        log.seek(0)
        print(log.read()[-4000:], file=sys.stderr)
        report["failures"].append(f"the server exited with {code}")
    print_report(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(1 if report["failures"] else 0)


def soak(args, port, server):
    deadline = time.time() + 120
    while True:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with {server.returncode} before answering /health")
        try:
            if get(port, "/health", timeout=2)[0] == 200:
                break
        except OSError:
            pass
        if time.time() > deadline:
            raise SystemExit("the server did not answer /health within 120 s")
        time.sleep(0.2)

    start = time.time()
    end = start + args.seconds
    lock = threading.Lock()
    latency = defaultdict(list)
    done = Counter()
    errors = Counter()
    error_examples = {}
    tokens = [0]
    rss = []
    stop_sampling = threading.Event()

    def sample():
        while not stop_sampling.is_set():
            rss.append((round(time.time() - start, 1), round(rss_mb(server.pid), 1)))
            stop_sampling.wait(1.0)

    def client(i):
        rng = random.Random(args.seed * 1000 + i)
        c = Client(port, rng, timeout=120)
        kinds = [k for k, _ in MIX]
        weights = [w for _, w in MIX]
        while time.time() < end:
            kind = rng.choices(kinds, weights)[0]
            t0 = time.time()
            try:
                n = c.run(kind)
                with lock:
                    latency[kind].append(time.time() - t0)
                    done[kind] += 1
                    tokens[0] += n
            except Failure as f:
                with lock:
                    errors[f"{kind}: {f.kind}"] += 1
                    error_examples.setdefault(f"{kind}: {f.kind}", str(f)[:300])
            except (KeyError, IndexError, TypeError) as e:
                with lock:
                    errors[f"{kind}: reply_shape"] += 1
                    error_examples.setdefault(f"{kind}: reply_shape", repr(e))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.time() - start

    # Every generation must be over once every client is: cancelled ones included.
    settle = time.time() + 15
    while True:
        status, text = get(port, "/metrics")
        active = metric(text, "deltafin_active_generations")
        queued = metric(text, "deltafin_queue_depth")
        if (active, queued) == (0, 0) or time.time() > settle:
            break
        time.sleep(0.2)
    stop_sampling.set()
    sampler.join()
    rss.append((round(time.time() - start, 1), round(rss_mb(server.pid), 1)))

    answered = sum(done.values())
    all_latency = [x for k, v in latency.items() if not k.endswith("!") for x in v]
    after = [m for t, m in rss if t >= args.warmup * args.seconds] or [m for _, m in rss]
    tenth = max(1, len(after) // 10)
    first, last = statistics.mean(after[:tenth]), statistics.mean(after[-tenth:])
    report = {
        "seconds": round(elapsed, 1),
        "clients": args.clients,
        "requests_ok": answered,
        "requests_per_s": round(answered / elapsed, 2),
        "completion_tokens_reported": tokens[0],
        "latency_s": {"p50": round(pct(all_latency, 50), 3), "p99": round(pct(all_latency, 99), 3)},
        "by_kind": {k: {"ok": done[k], "p50_s": round(pct(latency[k], 50), 3),
                        "p99_s": round(pct(latency[k], 99), 3)} for k, _ in MIX},
        "provoked_as_expected": {k: done[k] for k in PROVOKED},
        "errors": dict(errors),
        "error_examples": error_examples,
        "rss_mb": {"start": rss[0][1], "after_warmup_first": round(first, 1), "end": round(last, 1),
                   "max_after_warmup": max(after), "min_after_warmup": min(after),
                   "growth_after_warmup": round((last - first) / first, 4)},
        "rss_samples": rss,
        "metrics_end": {
            "active_generations": active,
            "queue_depth": queued,
            "generations": {o: metric(text, f'deltafin_generations_total{{outcome="{o}"}}')
                            for o in ("completed", "failed", "cancelled")},
            "prefix_cache_hits": metric(text, "deltafin_prefix_cache_hits_total"),
            "expert_bytes_read": metric(text, "deltafin_expert_bytes_read_total"),
            "http_requests": metric_sum(text, "deltafin_http_requests_total"),
        },
        "failures": [],
    }
    f = report["failures"]
    if errors:
        f.append(f"{sum(errors.values())} unexpected errors")
    if active != 0 or queued != 0:
        f.append(f"sessions left behind: {active} active, {queued} queued")
    missing = [k for k, _ in MIX if done[k] == 0]
    if missing:
        f.append(f"no successful request of kind {', '.join(missing)}")
    if not report["metrics_end"]["generations"]["cancelled"]:
        f.append("no generation was counted as cancelled, though clients went away mid-stream")
    if args.max_rss_growth is not None and abs(report["rss_mb"]["growth_after_warmup"]) > args.max_rss_growth:
        f.append(f"RSS after warm-up changed by {report['rss_mb']['growth_after_warmup']:.1%}")
    return report


def print_report(r):
    print(f"soak: {r['seconds']} s, {r['clients']} clients: {r['requests_ok']} requests answered as expected "
          f"({r['requests_per_s']}/s), {r['completion_tokens_reported']} completion tokens reported")
    print(f"latency of non-provoked requests: p50 {r['latency_s']['p50']} s, p99 {r['latency_s']['p99']} s")
    for k, v in r["by_kind"].items():
        print(f"  {k:18} {v['ok']:6} ok   p50 {v['p50_s']:7.3f} s   p99 {v['p99_s']:7.3f} s")
    print(f"errors by kind: {r['errors'] or 'none'}")
    for k, v in r["error_examples"].items():
        print(f"  e.g. {k}: {v}")
    m = r["rss_mb"]
    print(f"server RSS (MB): start {m['start']}, after warm-up {m['after_warmup_first']} -> end {m['end']} "
          f"(growth {m['growth_after_warmup']:+.1%}; min {m['min_after_warmup']}, max {m['max_after_warmup']})")
    e = r["metrics_end"]
    print(f"/metrics at the end: {e['active_generations']} active, {e['queue_depth']} queued; generations "
          f"{e['generations']}; prefix-cache hits {e['prefix_cache_hits']}; expert bytes read "
          f"{e['expert_bytes_read']}")
    print(f"server exit: {r['server_exit']}")
    print("soak: " + ("FAILED: " + "; ".join(r["failures"]) if r["failures"] else "passed"))


if __name__ == "__main__":
    main()
