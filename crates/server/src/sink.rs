//! The bridge from the engine's worker thread to a request's async task: token ids become text (split into
//! reasoning and content for chat), stop strings are matched on the text across token boundaries and never
//! sent, and whole characters go over an unbounded channel. A dropped receiver (the client went away) reads
//! as cancellation, so the worker drops the job before its next pass.

use crate::chat::{Channel, Effort, ReplyParser, Xtml};
use deltafin_engine::{FinishReason, Finished, Flow, Sink, StopMatcher, TokenLogprob, Utf8Stream};
use deltafin_tokenizer::Tokenizer;
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

/// One output channel's text pipeline.
struct TextOut {
    stop: StopMatcher,
    utf8: Utf8Stream,
}

impl TextOut {
    fn new(stops: &[String]) -> TextOut {
        TextOut {
            stop: StopMatcher::new(stops),
            utf8: Utf8Stream::default(),
        }
    }

    /// (text released, stop string hit)
    fn push(&mut self, bytes: &[u8]) -> (String, bool) {
        let r = self.stop.push(bytes);
        let mut text = self.utf8.push(&r.bytes);
        if r.stopped {
            text.push_str(&self.utf8.finish());
        }
        (text, r.stopped)
    }

    fn finish(&mut self) -> String {
        let held = self.stop.flush();
        let mut text = self.utf8.push(&held);
        text.push_str(&self.utf8.finish());
        text
    }
}

pub enum Mode {
    /// Chat: a reply parser splits reasoning from content; logprobs cover content tokens.
    Chat(ReplyParser),
    /// Raw completion: every token is text.
    Completion,
}

pub struct ChannelSink {
    tokenizer: Arc<Tokenizer>,
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
        xtml: &Xtml,
        effort: Option<Effort>,
        stops: &[String],
        stop_ids: Vec<u32>,
        tx: UnboundedSender<Msg>,
    ) -> ChannelSink {
        ChannelSink::new(
            tokenizer,
            Mode::Chat(ReplyParser::new(xtml, effort)),
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
        let bytes = match self.tokenizer.decode_bytes(&[token]) {
            Ok(b) => b,
            Err(e) => {
                // Ends the job; `finished` then reports it as an error rather than a stop.
                let _ = self.tx.send(Msg::Error(format!(
                    "cannot decode a generated token: {e:#}"
                )));
                return Flow::Stop;
            }
        };
        let (channel, piece) = match &mut self.mode {
            // Special tokens are structure, not text.
            Mode::Completion if token as usize >= self.tokenizer.num_ranks() => {
                (Channel::Content, None)
            }
            Mode::Completion => (Channel::Content, Some((Channel::Content, bytes))),
            Mode::Chat(parser) => (parser.channel(), parser.push(token, &bytes)),
        };
        if channel == Channel::Reasoning {
            self.reasoning_tokens += 1;
        }
        let (mut reasoning, mut content, mut stopped) = (String::new(), String::new(), false);
        let mut logprobs = Vec::new();
        if channel == Channel::Content {
            if let Some(lp) = &logprob {
                logprobs.push(self.logprob_item(lp));
            }
        }
        match piece {
            Some((Channel::Reasoning, bytes)) => (reasoning, stopped) = self.reasoning.push(&bytes),
            Some((Channel::Content, bytes)) => {
                // Reasoning held back for a possible stop string is complete once the answer starts.
                reasoning = self.reasoning.finish();
                (content, stopped) = self.content.push(&bytes);
            }
            None => {}
        }
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
            let (reasoning, content) = (self.reasoning.finish(), self.content.finish());
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
