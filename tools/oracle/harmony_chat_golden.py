#!/usr/bin/env python3
"""openai-harmony's renders of chats as `deltafin chat` and `deltafin serve` send them to a harmony model.

Writes tests/fixtures/o200k_harmony/harmony_chat.json: each case is a chat in deltafin's form (messages with
reasoning, tool calls and tool results; OpenAI's tool objects; a reasoning effort) and the harmony conversation
OpenAI's gpt-oss guide makes of it (instructions in the developer message, tools as `functions`, reasoning on
`analysis`, calls on `commentary` to `functions.NAME` with `<|constrain|>json`, results from `functions.NAME`),
rendered by openai-harmony for completion by the assistant (ids and text).

Regenerate (needs `pip install openai-harmony`; reads the committed o200k_base.tiktoken):

    python3 tools/oracle/harmony_chat_golden.py --fixture tests/fixtures/o200k_harmony
"""

from harmony_schemas_golden import write_golden

WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "The city."},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
    },
    "required": ["location"],
}


def cases(oh):
    R = oh.Role
    msg = oh.Message.from_role_and_content
    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Gets the current weather.", "parameters": WEATHER}}
    args = '{"location":"Tokyo"}'
    tool_round_trip = {
        "chat": [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is the weather in Tokyo?"},
            {"role": "assistant", "content": "", "reasoning": "I need the weather tool.",
             "tool_calls": [{"id": "call_0", "name": "get_weather", "arguments": args}]},
            {"role": "tool", "content": '{"temperature": 20}', "tool_call_id": "call_0"},
        ],
        "tools": [weather],
        "effort": "High",
    }
    dev = oh.DeveloperContent.new().with_instructions("Answer briefly.").with_function_tools(
        [oh.ToolDescription.new("get_weather", "Gets the current weather.", parameters=WEATHER)])
    round_trip = [
        msg(R.SYSTEM, oh.SystemContent.new().with_reasoning_effort(oh.ReasoningEffort.HIGH)),
        msg(R.DEVELOPER, dev),
        msg(R.USER, "What is the weather in Tokyo?"),
        msg(R.ASSISTANT, "I need the weather tool.").with_channel("analysis"),
        msg(R.ASSISTANT, args).with_channel("commentary").with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
        oh.Message.from_author_and_content(oh.Author.new(R.TOOL, "functions.get_weather"), '{"temperature": 20}')
        .with_recipient("assistant").with_channel("commentary"),
    ]
    answered_turns = {
        "chat": [
            {"role": "user", "content": "Hi."},
            {"role": "assistant", "content": "Hello!", "reasoning": "A greeting."},
            {"role": "user", "content": "Bye."},
        ],
        "tools": None,
        "effort": None,
    }
    answered = [
        msg(R.SYSTEM, oh.SystemContent.new()),
        msg(R.USER, "Hi."),
        msg(R.ASSISTANT, "A greeting.").with_channel("analysis"),
        msg(R.ASSISTANT, "Hello!").with_channel("final"),
        msg(R.USER, "Bye."),
    ]
    C = oh.Conversation.from_messages
    return [("tool_round_trip", tool_round_trip, C(round_trip)), ("answered_turns", answered_turns, C(answered))]


def rendered(oh, enc):
    out = []
    for name, chat, conv in cases(oh):
        ids = enc.render_conversation_for_completion(conv, oh.Role.ASSISTANT)
        out.append({"name": name, **chat, "ids": ids, "text": enc.decode_utf8(ids)})
    return out


def main():
    write_golden(__doc__, "harmony_chat.json", "tools/oracle/harmony_chat_golden.py", "cases", rendered)


if __name__ == "__main__":
    main()
