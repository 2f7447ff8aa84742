//! The marker scanner both reply parsers (K3's and harmony's) run on: find the earliest complete marker
//! of those the parser's state knows, and hold back a suffix that may still become one, so that a reply
//! streamed in pieces of any size parses as it does whole. Both parsers give [`ReplyEvent`]s.

use super::ToolCall;

/// What a piece of reply text turned out to be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplyEvent {
    /// Thinking: K3's think block, harmony's `analysis` channel.
    Reasoning(String),
    /// The answer.
    Content(String),
    /// A complete tool call.
    ToolCall(ToolCall),
}

/// A reply parser as a state machine over markers; [`scan`] drives it.
pub(super) trait Markers {
    /// The markers that mean something in the current state (none once the reply has ended).
    fn markers(&self) -> &'static [&'static str];
    /// The text not yet known to be free of markers.
    fn pending(&mut self) -> &mut String;
    /// Text between markers.
    fn text(&mut self, text: &str, events: &mut Vec<ReplyEvent>);
    /// A complete marker (one of [`Markers::markers`]).
    fn marker(&mut self, marker: &'static str, events: &mut Vec<ReplyEvent>);
}

/// Feeds `text` to `parser`; returns the events it made. Of markers found at the same place the longest
/// wins.
pub(super) fn scan(parser: &mut impl Markers, text: &str) -> Vec<ReplyEvent> {
    let mut events = Vec::new();
    parser.pending().push_str(text);
    loop {
        let markers = parser.markers();
        let pending = parser.pending();
        let found = markers
            .iter()
            .filter_map(|m| pending.find(m).map(|at| (at, *m)))
            .min_by_key(|&(at, m)| (at, std::cmp::Reverse(m.len())));
        let (ready, marker) = match found {
            Some((at, marker)) => {
                let mut before: String = pending.drain(..at + marker.len()).collect();
                before.truncate(at);
                (before, Some(marker))
            }
            None => {
                let hold = held_suffix(pending, markers);
                (pending.drain(..pending.len() - hold).collect(), None)
            }
        };
        parser.text(&ready, &mut events);
        match marker {
            Some(marker) => parser.marker(marker, &mut events),
            None => return events,
        }
    }
}

/// Adds reasoning or content to `events`, merged into the last event when that is of the same kind.
pub(super) fn push_text(events: &mut Vec<ReplyEvent>, event: ReplyEvent) {
    match (events.last_mut(), event) {
        (Some(ReplyEvent::Reasoning(a)), ReplyEvent::Reasoning(b))
        | (Some(ReplyEvent::Content(a)), ReplyEvent::Content(b)) => a.push_str(&b),
        (_, event) => events.push(event),
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of one of `markers`.
fn held_suffix(text: &str, markers: &[&str]) -> usize {
    let longest = markers.iter().map(|m| m.len() - 1).max().unwrap_or(0);
    (1..=longest.min(text.len()))
        .rev()
        .filter(|&n| text.is_char_boundary(text.len() - n))
        .find(|&n| {
            let tail = &text[text.len() - n..];
            markers.iter().any(|m| m.len() > n && m.starts_with(tail))
        })
        .unwrap_or(0)
}
