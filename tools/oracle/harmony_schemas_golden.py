#!/usr/bin/env python3
"""openai-harmony's renders of tool schemas and headers that tests/fixtures/o200k_harmony/harmony.json does not reach.

Writes tests/fixtures/o200k_harmony/harmony_schemas.json: conversations whose developer tools use every JSON-schema
form harmony turns into TypeScript (nested objects, titles, examples, enums and defaults, nullable and type lists,
arrays with and without items, oneOf properties and variants, a tool without parameters, multi-line descriptions),
the built-in browser and python namespaces in a system message, a named user, an unconstrained content type and
the recipient "all". Each with openai-harmony's completion render (ids and text) and its JSON form.

Regenerate (needs `pip install openai-harmony`; reads the committed o200k_base.tiktoken):

    python3 tools/oracle/harmony_schemas_golden.py --fixture tests/fixtures/o200k_harmony
"""

import argparse
import json
import os

SCHEMA = {
    "type": "object",
    "description": "Search options.",
    "properties": {
        "query": {"type": "string", "title": "Query", "description": "What to look for.",
                  "examples": ["rust", "harmony format"]},
        "limit": {"type": "integer", "default": 10},
        "score": {"type": "number", "nullable": True},
        "exact": {"type": "boolean", "default": False},
        "sort": {"type": "string", "enum": ["asc", "desc"], "default": "asc"},
        "lang": {"type": "string", "default": "en"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "raw": {"type": "array"},
        "either": {"type": ["string", "null"]},
        "filter": {"type": "object", "description": "Nested filter.", "properties": {
            "field": {"type": "string"},
            "op": {"type": "string", "enum": ["eq", "ne"]}}, "required": ["field"]},
        "target": {"description": "Where to search.", "oneOf": [
            {"type": "string", "description": "Where to search."},
            {"type": "integer", "description": "An index.", "default": 0},
            {"type": "object", "properties": {"url": {"type": "string"}}, "nullable": True}]},
        "mode": {"description": "How.", "default": "fast", "oneOf": [
            {"type": "string", "enum": ["fast", "slow"], "description": "Named mode."},
            {"type": "number", "description": "Speed factor."}]},
        "anything": {},
    },
    "required": ["query", "tags"],
}


def conversations(oh):
    R = oh.Role
    msg = oh.Message.from_role_and_content
    search = oh.ToolDescription.new("search", "Searches the corpus.\nReturns matches.", parameters=SCHEMA)
    ping = oh.ToolDescription.new("ping", "Checks the service.")
    dev = oh.DeveloperContent.new().with_function_tools([search, ping])
    system = oh.SystemContent.new().with_browser_tool().with_python_tool()
    tools = [
        msg(R.SYSTEM, oh.SystemContent.new()),
        msg(R.DEVELOPER, dev),
        oh.Message.from_author_and_content(oh.Author.new(R.USER, "alice"), "Find rust."),
        msg(R.ASSISTANT, "print(1)").with_channel("commentary").with_recipient("python")
        .with_content_type("code"),
        oh.Message.from_author_and_content(oh.Author.new(R.TOOL, "python"), "1").with_channel("commentary"),
        msg(R.ASSISTANT, "Done.").with_channel("commentary").with_recipient("all"),
    ]
    builtin = [msg(R.SYSTEM, system), msg(R.USER, "Look it up.")]
    C = oh.Conversation.from_messages
    return [("schemas", C(tools)), ("builtin_tools", C(builtin))]


def write_golden(doc, file_name, generator, key, entries):
    """Loads openai-harmony's gpt-oss encoding on the committed ranks (--fixture) and writes FILE_NAME there:
    the generator, openai-harmony's version and KEY: entries(oh, enc). Shared with harmony_chat_golden.py."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixture", default="tests/fixtures/o200k_harmony")
    args = ap.parse_args()
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = os.path.abspath(args.fixture)
    import openai_harmony as oh
    from importlib.metadata import version

    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    out = {"generator": generator, "openai_harmony": version("openai-harmony"), key: entries(oh, enc)}
    path = os.path.join(args.fixture, file_name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"{path}: {os.path.getsize(path)} bytes\nOK")


def renders(oh, enc):
    out = []
    for name, conv in conversations(oh):
        ids = enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT)
        out.append({"name": name, "mode": "completion", "next_role": "assistant",
                    "conversation": json.loads(conv.to_json()), "ids": ids, "text": enc.decode_utf8(ids)})
    return out


def main():
    write_golden(__doc__, "harmony_schemas.json", "tools/oracle/harmony_schemas_golden.py", "renders", renders)


if __name__ == "__main__":
    main()
