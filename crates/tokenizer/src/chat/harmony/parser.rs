//! Splitting a harmony completion into reasoning, content and tool calls as its text streams in.

use super::{HarmonyRole, CALL, CHANNEL, CONSTRAIN, END, MESSAGE, RETURN, START};
use crate::chat::scan::{push_text, scan, Markers};
use crate::chat::{ReplyEvent, ToolCall};

/// A message of the completion, as openai-harmony's parser reads it (its header fields and its text).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    /// The role, or for a tool's message the tool's name.
    pub author: String,
    pub channel: Option<String>,
    pub recipient: Option<String>,
    pub content_type: Option<String>,
    pub content: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Between messages: waiting for `<|start|>`.
    ExpectStart,
    /// Inside a header, up to `<|message|>`.
    Header,
    /// Inside a message's content, up to `<|end|>`, `<|call|>` or `<|return|>`.
    Content,
    /// After `<|call|>` or `<|return|>`: the rest is ignored.
    Done,
}

/// Streaming parser for a harmony completion: the text the model writes after a prompt that ends with
/// `<|start|>assistant` (special tokens rendered as their names, as [`crate::StreamDecoder`] gives it).
/// Feed it pieces of any size: a marker split across pieces is held back until it is complete or can no
/// longer be one.
///
/// Each message's header gives its channel and recipient. Content on `analysis` is
/// [`ReplyEvent::Reasoning`]; on `final`, on `commentary` (a preamble) or without a channel it is
/// [`ReplyEvent::Content`]; a message with a recipient (`to=functions.NAME`) is a tool call, one
/// [`ReplyEvent::ToolCall`] when it ends, named without the `functions.` prefix, its content the
/// arguments (harmony calls have no id: the caller assigns one). `<|end|>` ends a message and the next
/// starts at `<|start|>`; `<|call|>` and `<|return|>` end the completion, as generation stops there.
/// Text that only looks like a marker once decoded is indistinguishable here, as for
/// [`crate::chat::ReplyParser`].
#[derive(Clone)]
pub struct HarmonyParser {
    state: State,
    pending: String,
    header: String,
    message: ParsedMessage,
    messages: Vec<ParsedMessage>,
}

impl Default for HarmonyParser {
    fn default() -> Self {
        Self::new()
    }
}

impl HarmonyParser {
    /// A parser for the completion of a prompt that ended with `<|start|>assistant`: the first header has
    /// begun.
    pub fn new() -> Self {
        HarmonyParser {
            state: State::Header,
            pending: String::new(),
            header: HarmonyRole::Assistant.as_str().to_string(),
            message: ParsedMessage::default(),
            messages: Vec::new(),
        }
    }

    /// The messages completed so far.
    pub fn messages(&self) -> &[ParsedMessage] {
        &self.messages
    }

    /// Whether the completion is inside an `analysis` message's content (what is pushed next is
    /// reasoning unless it ends the message).
    pub fn in_reasoning(&self) -> bool {
        self.state == State::Content
            && self.message.recipient.is_none()
            && self.message.channel.as_deref() == Some("analysis")
    }

    /// Feeds the next piece of completion text; returns what is now known to be reasoning, content or a
    /// tool call (consecutive text of one kind is merged into one event).
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        scan(self, text)
    }

    /// Ends the completion (generation stopped, or ran out of tokens): feeds `text`, then ends an open
    /// message as `<|end|>` would (a tool call whose arguments were cut off is still returned, so the
    /// caller sees what was asked). An unfinished header is dropped.
    pub fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        let mut events = self.push(text);
        let rest = std::mem::take(&mut self.pending);
        self.text(&rest, &mut events);
        if self.state == State::Content {
            self.marker(END, &mut events);
        }
        self.state = State::Done;
        events
    }
}

impl Markers for HarmonyParser {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            State::ExpectStart => &[START],
            State::Header => &[MESSAGE],
            State::Content => &[END, CALL, RETURN],
            State::Done => &[],
        }
    }

    fn pending(&mut self) -> &mut String {
        &mut self.pending
    }

    /// Header text, or content (streamed unless it is a tool call's arguments).
    fn text(&mut self, text: &str, events: &mut Vec<ReplyEvent>) {
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Header => self.header.push_str(text),
            State::Content => {
                self.message.content.push_str(text);
                let event = match (&self.message.recipient, self.message.channel.as_deref()) {
                    (Some(_), _) => return,
                    (None, Some("analysis")) => ReplyEvent::Reasoning(text.to_string()),
                    (None, _) => ReplyEvent::Content(text.to_string()),
                };
                push_text(events, event);
            }
            // Text between messages is not part of the format; openai-harmony rejects it, a chat ignores it.
            State::ExpectStart | State::Done => {}
        }
    }

    fn marker(&mut self, marker: &'static str, events: &mut Vec<ReplyEvent>) {
        self.state = match (self.state, marker) {
            (State::ExpectStart, _) => State::Header,
            (State::Header, _) => {
                self.message = parse_header(&std::mem::take(&mut self.header));
                State::Content
            }
            (State::Content, _) => {
                let message = std::mem::take(&mut self.message);
                if let Some(recipient) = &message.recipient {
                    events.push(ReplyEvent::ToolCall(ToolCall {
                        id: String::new(),
                        name: recipient
                            .strip_prefix("functions.")
                            .unwrap_or(recipient)
                            .to_string(),
                        arguments: message.content.clone(),
                    }));
                }
                self.messages.push(message);
                if marker == END {
                    State::ExpectStart
                } else {
                    State::Done
                }
            }
            (State::Done, _) => State::Done,
        };
    }
}

/// A header as openai-harmony reads one: `<|channel|>NAME` anywhere (up to whitespace or `<`); of the
/// whitespace-separated rest, the author first, then the last part is a recipient (`to=X`, or a lone
/// part that is no constrained type) or a content type with an optional recipient before it.
fn parse_header(header: &str) -> ParsedMessage {
    let mut rest = header.to_string();
    let mut channel = None;
    if let Some(at) = rest.find(CHANNEL) {
        let after = &rest[at + CHANNEL.len()..];
        let len = after
            .find(|c: char| c.is_whitespace() || c == '<')
            .unwrap_or(after.len());
        channel = Some(after[..len].to_string());
        rest = format!("{}{}", &rest[..at], &after[len..]);
    }
    let rest = rest.replace(CONSTRAIN, &format!(" {CONSTRAIN}"));
    let mut parts: Vec<&str> = rest.split_ascii_whitespace().collect();
    let author = if parts.is_empty() {
        String::new()
    } else {
        parts.remove(0).to_string()
    };
    let mut recipient = None;
    let mut content_type = None;
    if let Some(last) = parts.pop() {
        if let Some(r) = last.strip_prefix("to=") {
            recipient = Some(r.to_string());
        } else if parts.is_empty() && !last.starts_with(CONSTRAIN) {
            recipient = Some(last.to_string());
        } else {
            content_type = Some(last.to_string());
            recipient = parts
                .pop()
                .map(|r| r.strip_prefix("to=").unwrap_or(r).to_string());
        }
    }
    ParsedMessage {
        author,
        channel,
        recipient,
        content_type,
        content: String::new(),
    }
}
