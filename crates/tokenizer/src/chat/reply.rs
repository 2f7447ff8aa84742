//! Splitting a K3 reply into reasoning, content and tool calls as its text streams in.

use super::scan::{push_text, scan, Markers, ReplyEvent};
use super::{
    unescape_attribute, ToolCall, K3_END_OF_MSG, K3_RESPONSE_CLOSE, K3_RESPONSE_OPEN, K3_SEP,
    K3_THINK_CLOSE, K3_THINK_OPEN, K3_TOOL_CALL_CLOSE, K3_TOOL_CALL_OPEN,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Reasoning,
    Content,
    /// Inside `<|open|>tool_call ...` up to its `<|sep|>`.
    ToolHeader,
    /// Inside a tool call's arguments.
    ToolArguments,
    /// After the message closed; the rest is ignored.
    Done,
}

/// `<|close|>message<|sep|>` (the whole message close but for the stop token, which generation
/// usually stops at before it is decoded).
const MESSAGE_CLOSE_START: &str = "<|close|>message<|sep|>";

/// Streaming parser for K3 replies (text with special tokens rendered as their names, as
/// [`crate::StreamDecoder`] gives it). Feed it pieces of any size: a marker split across pieces is held
/// back until it is complete or can no longer be one.
///
/// Markers: [`K3_THINK_CLOSE`] ends reasoning (so does [`K3_RESPONSE_OPEN`] if the model skips the
/// close); [`K3_THINK_OPEN`] while reasoning and the response block markers are dropped; a tool-call
/// block becomes one [`ReplyEvent::ToolCall`]; `<|close|>message<|sep|>` or `<|end_of_msg|>` ends the
/// reply and everything after it is ignored. Text that only looks like a marker once decoded (a user
/// could make the model write "<|close|>think<|sep|>" as plain text) is indistinguishable here.
#[derive(Clone)]
pub struct ReplyParser {
    state: State,
    pending: String,
    tool_header: String,
    tool_arguments: String,
}

impl Default for ReplyParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplyParser {
    /// A parser for a reply to a prompt that ended with [`super::K3_GENERATION_PROMPT`]: the reply
    /// starts inside the think block.
    pub fn new() -> Self {
        Self::starting_in(State::Reasoning)
    }

    /// A parser for a reply that starts with the answer (a prompt that already closed the think block).
    pub fn starting_in_content() -> Self {
        Self::starting_in(State::Content)
    }

    /// Whether the reply is still inside its think block (what is pushed next is reasoning unless it
    /// completes a marker that ends the block).
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    fn starting_in(state: State) -> Self {
        ReplyParser {
            state,
            pending: String::new(),
            tool_header: String::new(),
            tool_arguments: String::new(),
        }
    }

    /// Feeds the next piece of reply text; returns what is now known to be reasoning, content or a tool
    /// call (consecutive text of one kind is merged into one event).
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        scan(self, text)
    }

    /// Ends the reply: feeds `text`, then releases any held text (a marker cut off by the end of the
    /// stream is plain text) and an unfinished tool-call block (as content, verbatim).
    pub fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        let mut events = self.push(text);
        let rest = std::mem::take(&mut self.pending);
        match self.state {
            State::ToolHeader | State::ToolArguments => {
                let mut raw = String::from(K3_TOOL_CALL_OPEN);
                raw.push_str(&std::mem::take(&mut self.tool_header));
                if self.state == State::ToolArguments {
                    raw.push_str(K3_SEP);
                    raw.push_str(&std::mem::take(&mut self.tool_arguments));
                }
                raw.push_str(&rest);
                self.state = State::Content;
                self.text(&raw, &mut events);
            }
            _ => self.text(&rest, &mut events),
        }
        self.state = State::Done;
        events
    }
}

impl Markers for ReplyParser {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            State::Reasoning => &[
                K3_THINK_CLOSE,
                K3_THINK_OPEN,
                K3_RESPONSE_OPEN,
                MESSAGE_CLOSE_START,
                K3_END_OF_MSG,
            ],
            State::Content => &[
                K3_RESPONSE_OPEN,
                K3_RESPONSE_CLOSE,
                K3_TOOL_CALL_OPEN,
                MESSAGE_CLOSE_START,
                K3_END_OF_MSG,
            ],
            State::ToolHeader => &[K3_SEP],
            State::ToolArguments => &[K3_TOOL_CALL_CLOSE],
            State::Done => &[],
        }
    }

    fn pending(&mut self) -> &mut String {
        &mut self.pending
    }

    fn text(&mut self, text: &str, events: &mut Vec<ReplyEvent>) {
        if text.is_empty() {
            return;
        }
        let event = match self.state {
            State::Reasoning => ReplyEvent::Reasoning(text.to_string()),
            State::Content => ReplyEvent::Content(text.to_string()),
            State::ToolHeader => return self.tool_header.push_str(text),
            State::ToolArguments => return self.tool_arguments.push_str(text),
            State::Done => return,
        };
        push_text(events, event);
    }

    fn marker(&mut self, marker: &'static str, events: &mut Vec<ReplyEvent>) {
        self.state = match (self.state, marker) {
            (_, MESSAGE_CLOSE_START | K3_END_OF_MSG) => State::Done,
            (State::Reasoning, K3_THINK_CLOSE | K3_RESPONSE_OPEN) => State::Content,
            (State::Content, K3_TOOL_CALL_OPEN) => State::ToolHeader,
            (State::ToolHeader, _) => State::ToolArguments,
            (State::ToolArguments, _) => {
                let header = std::mem::take(&mut self.tool_header);
                events.push(ReplyEvent::ToolCall(ToolCall {
                    id: attribute(&header, "id").unwrap_or_default(),
                    name: attribute(&header, "name").unwrap_or_default(),
                    arguments: std::mem::take(&mut self.tool_arguments),
                }));
                State::Content
            }
            // Dropped markers: a repeated think open, the response block's open and close.
            (state, _) => state,
        };
    }
}

/// The unescaped value of ` key="..."` in a tool-call header.
fn attribute(header: &str, key: &str) -> Option<String> {
    let start = header.find(&format!(" {key}=\""))? + key.len() + 3;
    let len = header[start..].find('"')?;
    Some(unescape_attribute(&header[start..start + len]))
}

/// A whole reply, parsed at once.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Reply {
    pub reasoning: String,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// Parses a complete reply to a prompt that ended with the generation prompt (see [`ReplyParser`]).
pub fn parse_reply(text: &str) -> Reply {
    let mut reply = Reply::default();
    for event in ReplyParser::new().finish(text) {
        match event {
            ReplyEvent::Reasoning(t) => reply.reasoning.push_str(&t),
            ReplyEvent::Content(t) => reply.content.push_str(&t),
            ReplyEvent::ToolCall(c) => reply.tool_calls.push(c),
        }
    }
    reply
}
