//! The bridge from the engine's worker thread to a request's async task: token ids become text (split into
//! reasoning and content for chat), stop strings are matched on the text across token boundaries and never
//! sent, and whole characters go over an unbounded channel. A dropped receiver (the client went away) reads
//! as cancellation, so the worker drops the job before its next pass.

use crate::api::Tools;
use crate::chat::Markup;
use deltafin_engine::{FinishReason, Finished, Flow, Sink, StopMatcher, TokenLogprob};
use deltafin_tokenizer::chat::{ChatParser, ReplyEvent, ToolCall};
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
    Delta(Delta),
    /// A complete tool call the reply made (the `index`-th).
    ToolCall {
        index: usize,
        call: ToolCall,
    },
    Done(Finish),
    Error(String),
}

/// The reply's next text: reasoning and content, and the log-probabilities of the tokens that wrote it.
#[derive(Debug, Default)]
pub struct Delta {
    pub reasoning: String,
    pub content: String,
    pub logprobs: Vec<LogprobItem>,
}

/// How a reply ended.
#[derive(Debug)]
pub struct Finish {
    pub reason: &'static str,
    /// The stop string that ended the reply, if one did.
    pub stop_sequence: Option<String>,
    pub usage: Usage,
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

    /// (text released, the index of the stop string hit)
    fn push(&mut self, text: &str) -> (String, Option<usize>) {
        let r = self.stop.push(text.as_bytes());
        (String::from_utf8_lossy(&r.bytes).into_owned(), r.stopped)
    }

    fn finish(&mut self) -> String {
        String::from_utf8_lossy(&self.stop.flush()).into_owned()
    }
}

pub enum Mode {
    /// Chat: the format's reply parser splits reasoning from content and tool calls (it reads the format's
    /// markup tokens; other special tokens are dropped); logprobs cover content tokens.
    Chat(Box<ChatParser>, Markup, Tools),
    /// Raw completion: every token is text but special ones.
    Completion,
}

pub struct ChannelSink {
    tokenizer: Arc<Tokenizer>,
    decoder: StreamDecoder<Arc<Tokenizer>>,
    tx: UnboundedSender<Msg>,
    mode: Mode,
    stop_ids: Vec<u32>,
    stops: Vec<String>,
    reasoning: TextOut,
    content: TextOut,
    hit_stop: bool,
    /// The stop string that ended the reply.
    matched: Option<String>,
    reasoning_tokens: usize,
    tool_calls: usize,
}

/// What one batch of reply events comes to on the channels.
#[derive(Default)]
struct Routed {
    reasoning: String,
    content: String,
    calls: Vec<ToolCall>,
    /// A stop string was hit, or the first call of a reply that may make only one is complete.
    stopped: bool,
}

impl ChannelSink {
    pub fn chat(
        tokenizer: Arc<Tokenizer>,
        markup: &Markup,
        parser: ChatParser,
        tools: &Tools,
        stops: &[String],
        stop_ids: Vec<u32>,
        tx: UnboundedSender<Msg>,
    ) -> ChannelSink {
        ChannelSink::new(
            tokenizer,
            Mode::Chat(Box::new(parser), markup.clone(), tools.clone()),
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
            stops: stops.to_vec(),
            reasoning: TextOut::new(stops),
            content: TextOut::new(stops),
            hit_stop: false,
            matched: None,
            reasoning_tokens: 0,
            tool_calls: 0,
        }
    }

    /// Runs reply events through the channels' stop strings, and passes on tool calls when tools were
    /// offered (otherwise a call the model writes anyway is dropped).
    fn route(&mut self, events: Vec<ReplyEvent>) -> Routed {
        let mut out = Routed::default();
        for event in events {
            match event {
                ReplyEvent::Reasoning(t) => {
                    let (text, hit) = self.reasoning.push(&t);
                    out.reasoning.push_str(&text);
                    self.stop_hit(hit, &mut out);
                }
                ReplyEvent::Content(t) => {
                    // Reasoning held back for a possible stop string is complete once the answer starts.
                    out.reasoning.push_str(&self.reasoning.finish());
                    let (text, hit) = self.content.push(&t);
                    out.content.push_str(&text);
                    self.stop_hit(hit, &mut out);
                }
                ReplyEvent::ToolCall(call) => {
                    if let Mode::Chat(_, _, tools) = &self.mode {
                        if tools.listed.is_some() {
                            out.calls.push(call);
                            out.stopped = !tools.parallel;
                        }
                    }
                }
            }
            if out.stopped {
                break;
            }
        }
        out
    }

    fn stop_hit(&mut self, hit: Option<usize>, out: &mut Routed) {
        if let Some(i) = hit {
            self.matched = Some(self.stops[i].clone());
            out.stopped = true;
        }
    }

    /// Sends what `route` gave: text first, then the calls, numbered across the reply.
    fn send(&mut self, r: Routed, logprobs: Vec<LogprobItem>) {
        if !r.reasoning.is_empty() || !r.content.is_empty() || !logprobs.is_empty() {
            let _ = self.tx.send(Msg::Delta(Delta {
                reasoning: r.reasoning,
                content: r.content,
                logprobs,
            }));
        }
        for call in r.calls {
            let _ = self.tx.send(Msg::ToolCall {
                index: self.tool_calls,
                call,
            });
            self.tool_calls += 1;
        }
    }

    /// A token's text and bytes for logprobs: both empty for an id with no text.
    fn token_text(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.tokenizer.token_bytes(id).unwrap_or_default().to_vec();
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
        // Special tokens are structure, not text (chat's parser reads its format's markup ones).
        let dropped = self.tokenizer.special_name(token).is_some()
            && !matches!(&self.mode, Mode::Chat(_, markup, _) if markup.contains(token));
        // An id with no text (a padding row) renders as nothing; it still counts and has its logprob.
        let text = if dropped {
            String::new()
        } else {
            self.decoder.push(token)
        };
        let (in_reasoning, events) = match &mut self.mode {
            Mode::Chat(parser, ..) => (parser.in_reasoning(), parser.push(&text)),
            Mode::Completion => (false, vec![ReplyEvent::Content(text)]),
        };
        let mut logprobs = Vec::new();
        if in_reasoning {
            self.reasoning_tokens += 1;
        } else if let Some(lp) = &logprob {
            logprobs.push(self.logprob_item(lp));
        }
        let routed = self.route(events);
        let stopped = routed.stopped;
        self.send(routed, logprobs);
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
        if !self.hit_stop {
            let rest = self.decoder.finish();
            let events = match &mut self.mode {
                Mode::Chat(parser, ..) => parser.finish(&rest),
                Mode::Completion => vec![ReplyEvent::Content(rest)],
            };
            let mut routed = self.route(events);
            routed.reasoning.push_str(&self.reasoning.finish());
            routed.content.push_str(&self.content.finish());
            self.send(routed, Vec::new());
        }
        let reason = match f.reason {
            FinishReason::Length => "length",
            _ if self.tool_calls > 0 => "tool_calls",
            FinishReason::StopToken | FinishReason::Caller => "stop",
        };
        let _ = self.tx.send(Msg::Done(Finish {
            reason,
            stop_sequence: self.matched.take(),
            usage: Usage {
                prompt_tokens: f.prompt_tokens,
                cached_tokens: f.cached_tokens,
                completion_tokens: f.completion_tokens,
                reasoning_tokens: self.reasoning_tokens,
            },
        }));
    }

    fn cancelled(&self) -> bool {
        self.tx.is_closed()
    }
}

#[cfg(test)]
#[path = "../../tokenizer/tests/common/mod.rs"]
mod o200k;

#[cfg(test)]
mod tests {
    use super::o200k;
    use super::*;
    use crate::chat::{Chat, ReasoningEffort};
    use deltafin_tokenizer::chat::{ChatFormat, K3_MESSAGE_CLOSE, K3_RESPONSE_CLOSE};
    use deltafin_tokenizer::{builtin_corpus, train_bpe, write_tiktoken_files, Piece};
    use tokio::sync::mpsc::unbounded_channel;

    /// Feeds a reply that says "Checking." and calls two tools to a chat sink (reasoning_effort none, so
    /// the reply starts in content); returns what reached the channel and whether the sink stopped early.
    fn reply_with_two_calls(tools: Tools) -> (Vec<Msg>, bool) {
        let dir = tempfile::tempdir().unwrap();
        write_tiktoken_files(dir.path(), &train_bpe(builtin_corpus(), 300)).unwrap();
        let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
        let call = |header: &str, args: &str| {
            [
                Piece::Template(format!("<|open|>tool_call {header}<|sep|>")),
                Piece::Text(args.into()),
                Piece::Template("<|close|>tool_call<|sep|>".into()),
            ]
        };
        let mut reply = vec![
            Piece::Text("Checking.".into()),
            Piece::Template(K3_RESPONSE_CLOSE.into()),
        ];
        reply.extend(call(r#"id="c1" name="weather""#, r#"{"city":"Paris"}"#));
        reply.extend(call(r#"id="" name="time""#, "{}"));
        reply.push(Piece::Template(K3_MESSAGE_CLOSE.into()));
        let chat = Chat::new(ChatFormat::K3, &tok).unwrap();
        let parser = ReasoningEffort::None.reply_parser();
        feed(tok, &chat, parser, tools, &reply, Vec::new())
    }

    /// Feeds the ids of `reply` to a chat sink; returns what reached the channel and whether the sink
    /// stopped early.
    fn feed(
        tok: Arc<Tokenizer>,
        chat: &Chat,
        parser: ChatParser,
        tools: Tools,
        reply: &[Piece],
        stop_ids: Vec<u32>,
    ) -> (Vec<Msg>, bool) {
        let (tx, mut rx) = unbounded_channel();
        let mut sink =
            ChannelSink::chat(tok.clone(), &chat.markup, parser, &tools, &[], stop_ids, tx);
        let ids = tok.encode_pieces(reply);
        let early = ids
            .iter()
            .any(|&id| matches!(sink.token(id, None), Flow::Stop));
        sink.finished(Ok(Finished {
            reason: if early {
                FinishReason::Caller
            } else {
                FinishReason::StopToken
            },
            prompt_tokens: 1,
            cached_tokens: 0,
            completion_tokens: ids.len(),
            prefill_secs: 0.0,
            decode_secs: 0.0,
        }));
        let mut msgs = Vec::new();
        while let Ok(m) = rx.try_recv() {
            msgs.push(m);
        }
        (msgs, early)
    }

    fn summary(msgs: &[Msg]) -> (String, Vec<(usize, ToolCall)>, &'static str) {
        let mut content = String::new();
        let mut calls = Vec::new();
        let mut finish = "";
        for m in msgs {
            match m {
                Msg::Delta(d) => content.push_str(&d.content),
                Msg::ToolCall { index, call } => calls.push((*index, call.clone())),
                Msg::Done(f) => finish = f.reason,
                Msg::Error(e) => panic!("error: {e}"),
            }
        }
        (content, calls, finish)
    }

    fn offered(parallel: bool) -> Tools {
        Tools {
            listed: Some("[]".into()),
            parallel,
        }
    }

    #[test]
    fn calls_are_passed_on_numbered_and_end_with_tool_calls() {
        let (msgs, early) = reply_with_two_calls(offered(true));
        let (content, calls, finish) = summary(&msgs);
        assert!(!early);
        assert_eq!(content, "Checking.");
        let want = |id: &str, name: &str, arguments: &str| ToolCall {
            id: id.into(),
            name: name.into(),
            arguments: arguments.into(),
        };
        assert_eq!(
            calls,
            [
                (0, want("c1", "weather", r#"{"city":"Paris"}"#)),
                (1, want("", "time", "{}"))
            ]
        );
        assert_eq!(finish, "tool_calls");
    }

    #[test]
    fn without_parallel_calls_the_reply_ends_after_its_first() {
        let (msgs, early) = reply_with_two_calls(offered(false));
        let (_, calls, finish) = summary(&msgs);
        assert!(early, "the sink must stop the generation");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].1.name, "weather");
        assert_eq!(finish, "tool_calls");
    }

    #[test]
    fn calls_are_dropped_when_no_tools_were_offered() {
        let (msgs, _) = reply_with_two_calls(Tools {
            listed: None,
            parallel: true,
        });
        let (content, calls, finish) = summary(&msgs);
        assert_eq!(content, "Checking.");
        assert!(calls.is_empty());
        assert_eq!(finish, "stop");
    }

    /// A harmony reply (o200k_harmony's ids, as a gpt-oss model writes them): analysis is reasoning, final
    /// is content, a `commentary` message to `functions.NAME` ending at the `<|call|>` stop is a call.
    #[test]
    fn harmony_replies_give_reasoning_content_and_calls() {
        let dir = tempfile::tempdir().unwrap();
        o200k::write_checkpoint(dir.path());
        let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
        let chat = Chat::new(ChatFormat::Harmony, &tok).unwrap();
        let stop_ids = ["<|return|>", "<|call|>"].map(|n| tok.special_id(n).unwrap());
        let t = |s: &str| Piece::Template(s.into());
        let x = |s: &str| Piece::Text(s.into());
        let run = |reply: &[Piece]| {
            let (msgs, early) = feed(
                tok.clone(),
                &chat,
                chat.format.reply_parser(),
                offered(true),
                reply,
                stop_ids.to_vec(),
            );
            assert!(!early);
            let reasoning: String = msgs
                .iter()
                .map(|m| match m {
                    Msg::Delta(d) => d.reasoning.as_str(),
                    _ => "",
                })
                .collect();
            let reasoning_tokens = msgs.iter().find_map(|m| match m {
                Msg::Done(f) => Some(f.usage.reasoning_tokens),
                _ => None,
            });
            (reasoning, reasoning_tokens.unwrap(), summary(&msgs))
        };
        let analysis = [
            t("<|channel|>analysis<|message|>"),
            x("Let me check."),
            t("<|end|><|start|>assistant"),
        ];
        let mut call = analysis.to_vec();
        call.extend([
            t("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"),
            x(r#"{"location":"Tokyo"}"#),
            t("<|call|>"),
        ]);
        let (reasoning, reasoning_tokens, (content, calls, finish)) = run(&call);
        assert_eq!(reasoning, "Let me check.");
        assert!(reasoning_tokens >= 3, "{reasoning_tokens}");
        assert_eq!(content, "");
        let want = ToolCall {
            id: String::new(),
            name: "get_weather".into(),
            arguments: r#"{"location":"Tokyo"}"#.into(),
        };
        assert_eq!(calls, [(0, want)]);
        assert_eq!(finish, "tool_calls");

        let mut answer = analysis.to_vec();
        answer.extend([
            t("<|channel|>final<|message|>"),
            x("Sunny, 20 °C."),
            t("<|return|>"),
        ]);
        let (reasoning, _, (content, calls, finish)) = run(&answer);
        assert_eq!(reasoning, "Let me check.");
        assert_eq!(content, "Sunny, 20 °C.");
        assert!(calls.is_empty());
        assert_eq!(finish, "stop");
    }
}
