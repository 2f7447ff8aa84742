#!/usr/bin/env python3
"""Drives a running `deltafin serve` with the official `openai` Python package: models, chat (plain and
streaming), completions, responses, logprobs, seeds, stop strings, error cases, API key, and parallel clients.
With --padding-id, also replies made of an id with no text (a padding row of the embedding table).

--chat names the model's chat format: k3 (the default), harmony (gpt-oss: it always reasons, so no
reasoning_effort "none"; with --harmony-ids, also replies made mostly of harmony's markup, in any order) or
template (a family that chats through its own Jinja template: thinking and tools are left out).

Usage: openai_client_test.py --base-url http://127.0.0.1:PORT/v1 --model NAME --api-key KEY [--padding-id ID]
                             [--chat k3|harmony|template] [--harmony-ids ID,ID,...]
Exits non-zero (with the failing check) on any mismatch. Run by crates/server/tests/clients.rs.
"""

import argparse
import concurrent.futures
import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def padding_checks(client, model, pad, no_think):
    """Replies the logit bias makes all padding: no text, every token counted, logprobs with empty bytes."""
    kw = dict(model=model, max_tokens=5, temperature=0, logit_bias={str(pad): 100})
    messages = [{"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(messages=messages, **no_think, logprobs=True, top_logprobs=2,
                                       **kw)
    c = r.choices[0]
    check(c.message.content == "" and c.finish_reason == "length", f"padding chat: {c}")
    check(r.usage.completion_tokens == 5, f"padding chat usage {r.usage}")
    check(len(c.logprobs.content) == 5, f"padding chat logprobs {c.logprobs}")
    for item in c.logprobs.content:
        check(item.token == "" and item.bytes == [], f"padding logprob {item}")
    text, usage = "", None
    for chunk in client.chat.completions.create(messages=messages, **no_think, stream=True,
                                                stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        text += "".join(ch.delta.content or "" for ch in chunk.choices)
    check(text == "" and usage.completion_tokens == 5, f"padding chat stream {text!r} {usage}")
    two = client.chat.completions.create(messages=messages, **no_think, n=2, **kw)
    check([ch.message.content for ch in two.choices] == ["", ""] and two.usage.completion_tokens == 10,
          f"padding n=2: {two}")
    g = client.completions.create(prompt="Experts stream from", logprobs=1, stop=["e"], **kw)
    gc = g.choices[0]
    check(gc.text == "" and gc.finish_reason == "length" and g.usage.completion_tokens == 5, f"padding completion {g}")
    check(gc.logprobs.tokens == [""] * 5, f"padding completion logprobs {gc.logprobs}")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        prompt="Experts stream from", stream=True, **kw) if ch.choices)
    check(streamed == "", f"padding completion stream {streamed!r}")
    print("padding: replies of ids without text pass")


def harmony_markup_checks(client, model, ids):
    """A random model rarely writes harmony; biased towards its markup and header words it writes them in
    every order: channels left empty or never closed, headers without a message, text between messages.
    Each reply is still well formed, and streamed as whole; across seeds some reason and some answer."""
    bias = {str(i): 100 for i in ids}
    messages = [{"role": "user", "content": "Say hi."}]
    reasoned = answered = False
    for seed in range(16):
        kw = dict(model=model, messages=messages, max_tokens=32, temperature=1.0, seed=seed, logit_bias=bias)
        r = client.chat.completions.create(**kw)
        c = r.choices[0]
        reasoning = (c.message.model_extra or {}).get("reasoning_content") or ""
        content = c.message.content or ""
        check(c.finish_reason in ("stop", "length"), f"markup seed {seed}: finish_reason {c.finish_reason}")
        check(r.usage.completion_tokens_details.reasoning_tokens <= r.usage.completion_tokens, f"usage {r.usage}")
        s_reasoning, s_content, finish = "", "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for ch in chunk.choices:
                s_reasoning += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                s_content += ch.delta.content or ""
                finish = ch.finish_reason or finish
        check((s_reasoning, s_content, finish) == (reasoning, content, c.finish_reason),
              f"markup seed {seed}: stream {(s_reasoning, s_content, finish)!r} vs {(reasoning, content, c.finish_reason)!r}")
        reasoned |= reasoning != ""
        answered |= content != ""
        if reasoned and answered and seed >= 3:
            break
    check(reasoned and answered, f"markup: no seed gave reasoning and content (reasoned {reasoned}, answered {answered})")
    print(f"harmony markup: replies of markup in any order pass ({seed + 1} seeds)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--padding-id", type=int, help="an id the model has but the tokenizer has no text for")
    ap.add_argument("--chat", choices=["k3", "harmony", "template"], default="k3", help="the model's chat format")
    ap.add_argument("--harmony-ids", help="comma-separated ids of harmony markup and header words to bias towards")
    a = ap.parse_args()
    client = openai.OpenAI(base_url=a.base_url, api_key=a.api_key, max_retries=0, timeout=120)
    k3 = a.chat == "k3"
    # Thinking and tools: K3's and harmony's built-in formats have them, a template has not.
    builtin = a.chat != "template"
    # Thinking off, in K3's words; harmony always reasons and a template has no reasoning: no reasoning_effort.
    no_think = dict(reasoning_effort="none") if k3 else {}
    if a.padding_id is not None:
        padding_checks(client, a.model, a.padding_id, no_think)
    if a.harmony_ids:
        harmony_markup_checks(client, a.model, [int(i) for i in a.harmony_ids.split(",")])

    # Models.
    ids = [m.id for m in client.models.list()]
    check(ids == [a.model], f"models: {ids}")
    check(client.models.retrieve(a.model).id == a.model, "models.retrieve")

    # Chat, greedy, no thinking: the answer is content.
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model=a.model, messages=messages, max_tokens=10, temperature=0,
                                       **no_think, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    check(isinstance(choice.message.content, str), "chat content is a string")
    check(choice.finish_reason in ("stop", "length"), f"finish_reason {choice.finish_reason}")
    check(1 <= r.usage.completion_tokens <= 10, f"usage {r.usage}")
    check(r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens, "total_tokens")
    for item in choice.logprobs.content:
        check(item.logprob <= 0 and len(item.top_logprobs) == 2, f"logprob item {item}")
        check(item.top_logprobs[0].logprob >= item.logprob, "greedy token is the most likely")

    # Streaming gives the same text, ends with usage when asked.
    text, usage, finish = "", None, None
    stream = client.chat.completions.create(model=a.model, messages=messages, max_tokens=10, temperature=0,
                                            **no_think, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    check(text == choice.message.content, f"stream {text!r} vs {choice.message.content!r}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")
    check(finish == choice.finish_reason, "stream finish_reason")

    # Thinking on: reasoning arrives as reasoning_content (a random harmony model rarely opens a channel:
    # --harmony-ids checks its reasoning).
    if k3:
        t = client.chat.completions.create(model=a.model, messages=messages, max_tokens=6, temperature=0,
                                           reasoning_effort="low")
        reasoning = (t.choices[0].message.model_extra or {}).get("reasoning_content") or ""
        check(reasoning or t.choices[0].message.content, "thinking reply has text")
        check(t.usage.completion_tokens_details.reasoning_tokens > 0, f"reasoning tokens {t.usage}")

    # Seeds: same seed, same text.
    kw = dict(model=a.model, prompt="Experts stream from", max_tokens=16, temperature=1.0, top_p=0.9)
    s1 = client.completions.create(seed=7, **kw).choices[0].text
    s2 = client.completions.create(seed=7, **kw).choices[0].text
    check(s1 == s2, f"seeded texts differ: {s1!r} {s2!r}")

    # Completions with logprobs, plain and streamed; a stop string from the greedy text.
    g = client.completions.create(model=a.model, prompt="Experts stream from", max_tokens=24, temperature=0,
                                  logprobs=2)
    gtext = g.choices[0].text
    check(len(g.choices[0].logprobs.tokens) >= 1, "completion logprobs")
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=a.model, prompt="Experts stream from", max_tokens=24, temperature=0, stream=True) if c.choices)
    check(streamed == gtext, f"completion stream {streamed!r} vs {gtext!r}")
    if len(gtext) >= 8:
        stop = gtext[4:7]
        s = client.completions.create(model=a.model, prompt="Experts stream from", max_tokens=24,
                                      temperature=0, stop=[stop])
        check(s.choices[0].text == gtext[:gtext.index(stop)], f"stop {stop!r}: {s.choices[0].text!r}")
        check(s.choices[0].finish_reason == "stop", "stop finish_reason")

    # Tools as the SDK sends them, and a conversation that already holds a call and its result.
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    if builtin:
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ]
        w = client.chat.completions.create(model=a.model, messages=history, tools=tools, tool_choice="auto",
                                           max_tokens=6, temperature=0, **no_think)
        wc = w.choices[0]
        check(wc.finish_reason in ("stop", "length", "tool_calls"), f"tools finish_reason {wc.finish_reason}")
        check(wc.message.tool_calls is None or all(c.type == "function" for c in wc.message.tool_calls),
              f"tool calls {wc.message.tool_calls}")
        check(w.usage.prompt_tokens > r.usage.prompt_tokens, "the tools and the history are in the prompt")

    # The Responses API: the same greedy text as chat, whole and streamed; function-call history.
    kw = dict(model=a.model, instructions="Be brief.", input="Say hi.", max_output_tokens=10, temperature=0,
              store=False, **({"reasoning": {"effort": "none"}} if k3 else {}))
    resp = client.responses.create(**kw)
    check(resp.output_text == choice.message.content, f"responses {resp.output_text!r} vs {choice.message.content!r}")
    check(resp.usage.input_tokens == r.usage.prompt_tokens, f"responses usage {resp.usage}")
    deltas, final = "", None
    for event in client.responses.create(stream=True, **kw):
        if event.type == "response.output_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    check(deltas == resp.output_text and final is not None and final.output_text == resp.output_text,
          f"responses stream {deltas!r}")
    if builtin:
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                   {"type": "function_call_output", "call_id": "call_1", "output": "18 C, sunny"}]
        rt = client.responses.create(model=a.model, input=history, max_output_tokens=4,
                                     tools=[{"type": "function", **tools[0]["function"]}],
                                     **({"reasoning": {"effort": "none"}} if k3 else {}))
        check(rt.status in ("completed", "incomplete"), f"responses with tools: {rt.status}")
    try:
        client.responses.create(previous_response_id="resp_x", **kw)
        raise AssertionError("previous_response_id: expected a 400")
    except openai.BadRequestError as e:
        check("previous_response_id" in str(e), f"previous_response_id: {e}")

    # n choices, whole and streamed: choice i samples with seed + i.
    two = client.chat.completions.create(model=a.model, messages=messages, max_tokens=4, n=2, temperature=1.0,
                                         seed=3)
    check([c.index for c in two.choices] == [0, 1], f"n=2 indices: {two.choices}")
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=a.model, messages=messages, max_tokens=4, n=2,
                                                temperature=1.0, seed=3, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    check([streamed[0], streamed[1]] == [c.message.content for c in two.choices], f"n=2 streamed: {streamed}")

    # Errors are OpenAI-shaped and name the field.
    for kwargs, param in [(dict(n=17), "n"), (dict(extra_body={"frobnicate": 1}), "frobnicate"),
                          (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
                          *([(dict(tools=tools, tool_choice="required"), "tool_choice")] if builtin else [])]:
        try:
            client.chat.completions.create(model=a.model, messages=messages, max_tokens=2, **kwargs)
            raise AssertionError(f"{param}: expected a 400")
        except openai.BadRequestError as e:
            check(e.status_code == 400 and param in str(e), f"{param}: {e}")
    try:
        client.chat.completions.create(model="not-this-one", messages=messages, max_tokens=2)
        raise AssertionError("unknown model: expected a 404")
    except openai.NotFoundError:
        pass
    bad_key = openai.OpenAI(base_url=a.base_url, api_key="wrong", max_retries=0, timeout=30)
    try:
        bad_key.models.list()
        raise AssertionError("wrong key: expected a 401")
    except openai.AuthenticationError:
        pass

    # Parallel clients: each completes or is told 429; none hangs (the client timeout bounds each).
    def one(i):
        try:
            out = client.chat.completions.create(
                model=a.model, messages=[{"role": "user", "content": f"Client {i}"}],
                max_tokens=64, temperature=0.7, seed=i, **no_think)
            return "ok" if out.choices[0].finish_reason in ("stop", "length") else "bad"
        except openai.RateLimitError:
            return "429"
    with concurrent.futures.ThreadPoolExecutor(a.parallel) as pool:
        results = list(pool.map(one, range(a.parallel), timeout=300))
    check(all(r in ("ok", "429") for r in results), f"parallel results {results}")
    check("ok" in results, f"no parallel request completed: {results}")
    print(f"parallel: {results.count('ok')} completed, {results.count('429')} got 429")
    print("openai client test: all checks passed")


if __name__ == "__main__":
    try:
        main()
    except AssertionError as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
