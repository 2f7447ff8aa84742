//! Splitting the reply of a template whose model thinks in a `<think>` … `</think>` block (Qwen3's): the
//! block is reasoning, the rest content; a reply that starts with other text is all content.

use super::scan::{push_text, scan, Markers, ReplyEvent};

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Nothing but whitespace yet: a think block may still open.
    Start,
    Reasoning,
    Content,
}

/// Streaming parser for such replies; feed it pieces of any size ([`scan`] holds back a split marker).
#[derive(Clone)]
pub struct ThinkParser {
    state: State,
    pending: String,
    /// Whitespace before the think block would open, kept until the reply's kind is known.
    leading: String,
}

impl Default for ThinkParser {
    fn default() -> Self {
        Self::new()
    }
}

impl ThinkParser {
    pub fn new() -> Self {
        ThinkParser {
            state: State::Start,
            pending: String::new(),
            leading: String::new(),
        }
    }

    pub fn in_reasoning(&self) -> bool {
        self.state == State::Reasoning
    }

    /// Feeds the next piece of reply text; returns what is now known to be reasoning or content.
    pub fn push(&mut self, text: &str) -> Vec<ReplyEvent> {
        scan(self, text)
    }

    /// Ends the reply: feeds `text`, then releases held text (a marker cut off by the end is plain text).
    pub fn finish(&mut self, text: &str) -> Vec<ReplyEvent> {
        let mut events = self.push(text);
        let rest = std::mem::take(&mut self.pending);
        self.text(&rest, &mut events);
        if self.state == State::Start {
            let leading = std::mem::take(&mut self.leading);
            self.state = State::Content;
            self.text(&leading, &mut events);
        }
        events
    }
}

impl Markers for ThinkParser {
    fn markers(&self) -> &'static [&'static str] {
        match self.state {
            State::Start => &[THINK_OPEN],
            State::Reasoning => &[THINK_CLOSE],
            State::Content => &[],
        }
    }

    fn pending(&mut self) -> &mut String {
        &mut self.pending
    }

    fn text(&mut self, text: &str, events: &mut Vec<ReplyEvent>) {
        if text.is_empty() {
            return;
        }
        match self.state {
            State::Start if text.trim().is_empty() => self.leading.push_str(text),
            State::Start => {
                self.state = State::Content;
                let all = std::mem::take(&mut self.leading) + text;
                push_text(events, ReplyEvent::Content(all));
            }
            State::Reasoning => push_text(events, ReplyEvent::Reasoning(text.to_string())),
            State::Content => push_text(events, ReplyEvent::Content(text.to_string())),
        }
    }

    fn marker(&mut self, marker: &'static str, events: &mut Vec<ReplyEvent>) {
        match self.state {
            // Whitespace before the block is dropped with it.
            State::Start => {
                self.leading.clear();
                self.state = State::Reasoning;
            }
            State::Reasoning => self.state = State::Content,
            // The text just before it started the content: the marker is part of it.
            State::Content => push_text(events, ReplyEvent::Content(marker.to_string())),
        }
    }
}
