#!/usr/bin/env python3
"""Drives a running `deltafin serve` with the official `anthropic` Python package: messages (plain and
streamed), stop sequences, thinking, tools and tool history, token counting, error cases and the API key.

--chat names the model's chat format, as for openai_client_test.py: k3 (the default), harmony (it always
thinks, so thinking is never disabled; a random model's text is mostly an unfinished header, so no stop
sequence is cut from it) or template (no thinking, no tools).

Usage: anthropic_client_test.py --base-url http://127.0.0.1:PORT --model NAME --api-key KEY
                                [--chat k3|harmony|template]
Exits non-zero (with the failing check) on any mismatch. Run by crates/server/tests/clients.rs.
"""

import argparse
import sys

import anthropic


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def text_of(message):
    return "".join(b.text for b in message.content if b.type == "text")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--chat", choices=["k3", "harmony", "template"], default="k3", help="the model's chat format")
    a = ap.parse_args()
    client = anthropic.Anthropic(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    k3 = a.chat == "k3"
    # Thinking off, in K3's words; harmony always thinks and a template has no thinking: no setting.
    no_think = dict(thinking={"type": "disabled"}) if k3 else {}
    # The SDK no longer has sampling arguments; deltafin still reads temperature (greedy here) from the body.
    ask = dict(model=a.model, system="Be brief.", messages=[{"role": "user", "content": "Say hi."}],
               **no_think, extra_body={"temperature": 0})

    # Models, as Anthropic lists them.
    models = list(client.models.list())
    check([m.id for m in models] == [a.model] and models[0].type == "model", f"models {models}")
    check(client.models.retrieve(a.model).display_name == a.model, "models.retrieve")

    # A greedy message without thinking: text blocks, a stop reason, usage.
    r = client.messages.create(max_tokens=24, **ask)
    check(r.type == "message" and r.role == "assistant" and r.model == a.model, f"message {r}")
    check(all(b.type == "text" for b in r.content), f"blocks {r.content}")
    check(r.stop_reason in ("end_turn", "max_tokens"), f"stop_reason {r.stop_reason}")
    check(1 <= r.usage.output_tokens <= 24, f"usage {r.usage}")
    text = text_of(r)

    # The SDK's stream helper gives the same text and final message.
    with client.messages.stream(max_tokens=24, **ask) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    check(streamed == text, f"stream {streamed!r} vs {text!r}")
    check(text_of(final) == text and final.stop_reason == r.stop_reason, f"final message {final}")
    check(final.usage.output_tokens == r.usage.output_tokens, f"stream usage {final.usage}")

    # A stop sequence from the greedy text ends it there and is named.
    if a.chat != "harmony":
        check(len(text) >= 8, f"greedy text too short: {text!r}")
        stop = text[4:7]
        s = client.messages.create(max_tokens=24, stop_sequences=[stop], **ask)
        check(text_of(s) == text[:text.index(stop)], f"stop {stop!r}: {text_of(s)!r}")
        check(s.stop_reason == "stop_sequence" and s.stop_sequence == stop, f"stop {s.stop_reason} {s.stop_sequence}")

    # Thinking (a budget, or adaptive with an effort): the reply may think, in blocks the SDK reads.
    # (A random harmony model's reply is mostly an unfinished header: it may have no block at all.)
    # Greedy: a sampled reply of a random model can end at its first token, with no block to check.
    if k3:
        for kw in [dict(thinking={"type": "enabled", "budget_tokens": 1024}),
                   dict(thinking={"type": "adaptive"}, output_config={"effort": "high"})]:
            t = client.messages.create(model=a.model, max_tokens=2048,
                                       messages=[{"role": "user", "content": "Hi."}],
                                       extra_body={"temperature": 0}, **kw)
            check(t.content and all(b.type in ("thinking", "text") for b in t.content),
                  f"thinking blocks {t.content}")

    # Tools, and a conversation that already holds a tool use and its result (harmony may think first).
    tools = [{"name": "get_weather", "description": "The weather in a city.",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    if a.chat != "template":
        history = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C, sunny"}]},
        ]
        w = client.messages.create(model=a.model, max_tokens=8, messages=history, tools=tools,
                                   **no_think, extra_body={"temperature": 0})
        check(w.stop_reason in ("end_turn", "max_tokens", "tool_use"), f"tools stop_reason {w.stop_reason}")
        blocks = ("text", "tool_use") + (("thinking",) if a.chat == "harmony" else ())
        check(all(b.type in blocks for b in w.content), f"tools blocks {w.content}")
        counted = client.messages.count_tokens(model=a.model, messages=history, tools=tools, **no_think)
        check(counted.input_tokens == w.usage.input_tokens + (w.usage.cache_read_input_tokens or 0),
              f"count_tokens {counted.input_tokens} vs usage {w.usage}")

    # Errors: Anthropic's types, the field named in the message.
    for kwargs, field in [(dict(tool_choice={"type": "any"}, tools=tools), "tool_choice"),
                          (dict(output_config={"format": {"type": "json_schema", "schema": {}}}), "output_config.format"),
                          (dict(extra_body={"frobnicate": 1}), "frobnicate")]:
        try:
            client.messages.create(max_tokens=2, **{**ask, **kwargs})
            raise AssertionError(f"{field}: expected a 400")
        except anthropic.BadRequestError as e:
            check(e.status_code == 400 and field in str(e), f"{field}: {e}")
    try:
        client.messages.create(max_tokens=2, **{**ask, "model": "not-this-one"})
        raise AssertionError("unknown model: expected a 404")
    except anthropic.NotFoundError:
        pass
    bad_key = anthropic.Anthropic(base_url=a.base_url, api_key="wrong", max_retries=0, timeout=30)
    try:
        bad_key.messages.create(max_tokens=2, **ask)
        raise AssertionError("wrong key: expected a 401")
    except anthropic.AuthenticationError:
        pass
    print("anthropic client test: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
