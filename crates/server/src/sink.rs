//! The bridge from the engine's worker thread to a request's async task: token ids become text (split into
//! reasoning and content for chat), stop strings are matched on the text across token boundaries and never
//! sent, and whole characters go over an unbounded channel. A dropped receiver (the client went away) reads
//! as cancellation, so the worker drops the job before its next pass.

use crate::chat::{Markup, ReasoningEffort};
use deltafin_engine::{FinishReason, Finished, Flow, Sink, StopMatcher, TokenLogprob};
use deltafin_tokenizer::chat::{ReplyEvent, ReplyParser};
use deltafin_tokenizer::{StreamDecoder, Tokenizer};
use std::sync::Arc;
use tokio::sync::mpsc::UnboundedSender;

/// One token's log-probability, with token text and bytes, for the response.
#[derive(Clone, Debug)]
pub struct LogprobItem {
    pub token: String,
    pub bytes: Vec<u8>,
    pub logprob: f32,
    pub top: Vec<(String, Vec<u8>, f32)>,
}

#[derive(Debug)]
pub enum Msg {
    Delta {
        reasoning: String,
        content: String,
        logprobs: Vec<LogprobItem>,
    },
    Done {
        finish_reason: &'static str,
        usage: Usage,
    },
    Error(String),
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
}

/// One output channel's stop strings. Its input is whole characters, and a stop string starts with one, so
/// what it releases is whole characters too.
struct TextOut {
    stop: StopMatcher,
}

impl TextOut {
    fn new(stops: &[String]) -> TextOut {
        TextOut {
            stop: StopMatcher::new(stops),
        }
    }

    /// (text released, stop string hit)
    fn push(&mut self, text: &str) -> (String, bool) {
        let r = self.stop.push(text.as_bytes());
        (String::from_utf8_lossy(&r.bytes).into_owned(), r.stopped)
    }

    fn finish(&mut self) -> String {
        String::from_utf8_lossy(&self.stop.flush()).into_owned()
    }
}

pub enum Mode {
    /// Chat: a reply parser splits reasoning from content (it reads K3's markup tokens; other special
    /// tokens are dropped); logprobs cover content tokens.
    Chat(ReplyParser, Markup),
    /// Raw completion: every token is text but special ones.
    Completion,
}

pub struct ChannelSink {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder<Arc<Tokenizer>>,
    tx: UnboundedSender<Msg>,
    mode: Mode,
    stop_ids: Vec<u32>,
    reasoning: TextOut,
    content: TextOut,
    hit_stop: bool,
    reasoning_tokens: usize,
}

impl ChannelSink {
    pub fn chat(
        tokenizer: Arc<Tokenizer>,
        markup: &Markup,
        effort: ReasoningEffort,
        stops: &[String],
        stop_ids: Vec<u32>,
        tx: UnboundedSender<Msg>,
    ) -> ChannelSink {
        ChannelSink::new(
            tokenizer,
            Mode::Chat(effort.reply_parser(), markup.clone()),
            stops,
            stop_ids,
            tx,
        )
    }

    pub fn completion(
        tokenizer: Arc<Tokenizer>,
        stops: &[String],
        stop_ids: Vec<u32>,
        tx: UnboundedSender<Msg>,
    ) -> ChannelSink {
        ChannelSink::new(tokenizer, Mode::Completion, stops, stop_ids, tx)
    }

    fn new(
        tokenizer: Arc<Tokenizer>,
        mode: Mode,
        stops: &[String],
        stop_ids: Vec<u32>,
        tx: UnboundedSender<Msg>,
    ) -> ChannelSink {
        ChannelSink {
            decoder: StreamDecoder::new(tokenizer.clone()),
            tokenizer,
            tx,
            mode,
            stop_ids,
            reasoning: TextOut::new(stops),
            content: TextOut::new(stops),
            hit_stop: false,
            reasoning_tokens: 0,
        }
    }

    /// Runs reply events through the channels' stop strings: (reasoning, content, stop string hit).
    fn route(&mut self, events: Vec<ReplyEvent>) -> (String, String, bool) {
        let (mut reasoning, mut content) = (String::new(), String::new());
        for event in events {
            let stopped = match event {
                ReplyEvent::Reasoning(t) => {
                    let (text, stopped) = self.reasoning.push(&t);
                    reasoning.push_str(&text);
                    stopped
                }
                ReplyEvent::Content(t) => {
                    // Reasoning held back for a possible stop string is complete once the answer starts.
                    reasoning.push_str(&self.reasoning.finish());
                    let (text, stopped) = self.content.push(&t);
                    content.push_str(&text);
                    stopped
                }
                // The API offers no tools, so a tool call the model writes anyway is not passed on.
                ReplyEvent::ToolCall(_) => false,
            };
            if stopped {
                return (reasoning, content, true);
            }
        }
        (reasoning, content, false)
    }

    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.decode_bytes(&[id]).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    fn logprob_item(&self, lp: &TokenLogprob) -> LogprobItem {
        let (token, bytes) = self.token_text(lp.token);
        LogprobItem {
            token,
            bytes,
            logprob: lp.logprob,
            top: lp
                .top
                .iter()
                .map(|&(id, l)| {
                    let (t, b) = self.token_text(id);
                    (t, b, l)
                })
                .collect(),
        }
    }
}

impl Sink for ChannelSink {
    fn token(&mut self, token: u32, logprob: Option<TokenLogprob>) -> Flow {
        if self.stop_ids.contains(&token) {
            return Flow::Continue;
        }
        // Special tokens are structure, not text (chat's parser reads K3's markup ones).
        let dropped = self.tokenizer.special_name(token).is_some()
            && !matches!(&self.mode, Mode::Chat(_, markup) if markup.contains(token));
        let text = if dropped {
            String::new()
        } else {
            match self.decoder.push(token) {
                Ok(t) => t,
                Err(e) => {
                    // Ends the job; `finished` then reports it as an error rather than a stop.
                    let _ = self.tx.send(Msg::Error(format!(
                        "cannot decode a generated token: {e:#}"
                    )));
                    return Flow::Stop;
                }
            }
        };
        let (in_reasoning, events) = match &mut self.mode {
            Mode::Chat(parser, _) => (parser.in_reasoning(), parser.push(&text)),
            Mode::Completion => (false, vec![ReplyEvent::Content(text)]),
        };
        let mut logprobs = Vec::new();
        if in_reasoning {
            self.reasoning_tokens += 1;
        } else if let Some(lp) = &logprob {
            logprobs.push(self.logprob_item(lp));
        }
        let (reasoning, content, stopped) = self.route(events);
        if !reasoning.is_empty() || !content.is_empty() || !logprobs.is_empty() {
            let _ = self.tx.send(Msg::Delta {
                reasoning,
                content,
                logprobs,
            });
        }
        if stopped {
            self.hit_stop = true;
            return Flow::Stop;
        }
        Flow::Continue
    }

    fn finished(&mut self, result: Result<Finished, String>) {
        let f = match result {
            Ok(f) => f,
            Err(e) => {
                let _ = self.tx.send(Msg::Error(e));
                return;
            }
        };
        if f.reason == FinishReason::Caller && !self.hit_stop {
            return; // `token` already reported why it stopped (a decoding error).
        }
        if !self.hit_stop {
            let rest = self.decoder.finish();
            let events = match &mut self.mode {
                Mode::Chat(parser, _) => parser.finish(&rest),
                Mode::Completion => vec![ReplyEvent::Content(rest)],
            };
            let (mut reasoning, mut content, _) = self.route(events);
            reasoning.push_str(&self.reasoning.finish());
            content.push_str(&self.content.finish());
            if !reasoning.is_empty() || !content.is_empty() {
                let _ = self.tx.send(Msg::Delta {
                    reasoning,
                    content,
                    logprobs: Vec::new(),
                });
            }
        }
        let finish_reason = match f.reason {
            FinishReason::Length => "length",
            FinishReason::StopToken | FinishReason::Caller => "stop",
        };
        let _ = self.tx.send(Msg::Done {
            finish_reason,
            usage: Usage {
                prompt_tokens: f.prompt_tokens,
                cached_tokens: f.cached_tokens,
                completion_tokens: f.completion_tokens,
                reasoning_tokens: self.reasoning_tokens,
            },
        });
    }

    fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}
