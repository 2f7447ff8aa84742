//! A drive that fails an expert read (EIO, or a short read), injected through the store's fault hook: the
//! request whose pass needed it fails with an error naming the file, layer and expert; the others complete
//! with their usual tokens; nothing wrong is ever generated or cached.

mod common;

use common::*;
use deltafin_engine::SchedulerConfig;
use deltafin_models::{LoadOptions, Model};
use deltafin_server::{Running, ServerConfig};
use deltafin_store::io::{Fault, FaultInjector};
use deltafin_store::StoreOptions;
use deltafin_tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Linux's errno for an I/O error.
const EIO: i32 = 5;

/// Fails the next read once armed, and remembers which it was.
#[derive(Debug, Default)]
struct NextRead {
    armed: Mutex<Option<Fault>>,
    hit: Mutex<Option<(PathBuf, u64)>>,
}

impl FaultInjector for NextRead {
    fn before_read(&self, path: &Path, offset: u64, _len: usize) -> Option<Fault> {
        let fault = self.armed.lock().unwrap().take()?;
        *self.hit.lock().unwrap() = Some((path.to_path_buf(), offset));
        Some(fault)
    }
}

/// A server whose every pass reads its experts from disk (no cache, no prefetch, buffered reads that start
/// at the record), through `faults`.
fn serve(faults: Arc<NextRead>, max_active: usize) -> Running {
    let dir = model_dir();
    let opts = LoadOptions {
        store: StoreOptions {
            cache_bytes: 0,
            prefetch: false,
            direct_io: false,
            faults: Some(faults),
            ..StoreOptions::default()
        },
        ..LoadOptions::default()
    };
    let model = Arc::new(Model::load_with(&dir, &opts).unwrap());
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir).unwrap());
    let cfg = ServerConfig {
        scheduler: SchedulerConfig {
            max_active,
            queue_capacity: 8,
            ..SchedulerConfig::default()
        },
        ..config()
    };
    Running::start("127.0.0.1:0".parse().unwrap(), model, tokenizer, cfg).unwrap()
}

const PROMPTS: [&str; 3] = ["Experts stream from", "The drive", "Once upon a time"];

/// Greedy completions of every prompt at once: (status, body) each.
fn complete_all(s: &Running) -> Vec<(u16, Value)> {
    let addr = s.addr;
    let threads: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            let body = json!({"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0, "logprobs": 1});
            std::thread::spawn(move || {
                let r = post(addr, "/v1/completions", &body);
                (r.status, r.json())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// The (layer, expert) whose record starts at `offset` of `file`.
fn record_at(file: &Path, offset: u64) -> (usize, usize) {
    let (sources, layers, _) = deltafin_models::expert_sources(&model_dir()).unwrap();
    layers
        .iter()
        .enumerate()
        .flat_map(|(l, recs)| recs.iter().enumerate().map(move |(e, r)| (l, e, r)))
        .find(|(_, _, r)| {
            let x = &r.extents[0];
            sources[x.file] == file && x.offset == offset
        })
        .map(|(l, e, _)| (l, e))
        .unwrap_or_else(|| panic!("no record starts at {offset} of {}", file.display()))
}

#[test]
fn a_failed_expert_read_fails_its_request_with_file_layer_and_expert_and_the_others_complete() {
    let usual = {
        let s = serve(Arc::default(), 1);
        let r = complete_all(&s);
        assert!(r.iter().all(|(status, _)| *status == 200), "{r:?}");
        r
    };
    for (fault, says) in [
        (Fault::Os(EIO), "Input/output error"),
        (Fault::Short(100), "short read"),
    ] {
        // One generation at a time: the failed pass is that request's alone. Several: every request in the
        // pass fails with it (their state went part of the way), and never produces a wrong token.
        for max_active in [1, 3] {
            let faults = Arc::new(NextRead::default());
            let s = serve(faults.clone(), max_active);
            *faults.armed.lock().unwrap() = Some(fault);
            let got = complete_all(&s);
            let (file, offset) = faults.hit.lock().unwrap().clone().expect("the fault fired");
            let (layer, expert) = record_at(&file, offset);
            let mut failed = 0;
            for ((status, body), (_, want)) in got.iter().zip(&usual) {
                if *status == 200 {
                    assert_eq!(body["choices"][0]["text"], want["choices"][0]["text"]);
                    assert_eq!(
                        body["choices"][0]["logprobs"]["tokens"],
                        want["choices"][0]["logprobs"]["tokens"]
                    );
                    continue;
                }
                failed += 1;
                assert_eq!(*status, 500, "{body}");
                let message = body["error"]["message"].as_str().unwrap();
                eprintln!("MSG {max_active}: {message}");
                for what in [
                    &file.display().to_string(),
                    &format!("layer {layer} expert {expert}"),
                    says,
                ] {
                    assert!(message.contains(what), "{what:?} missing: {message}");
                }
            }
            assert!(failed >= 1, "{fault:?}: no request failed: {got:?}");
            if max_active == 1 {
                assert_eq!(failed, 1, "{fault:?}: {got:?}");
            }
            // The server goes on serving, from bytes read again: the usual replies.
            let again = complete_all(&s);
            for ((status, body), (_, want)) in again.iter().zip(&usual) {
                assert_eq!(*status, 200, "{body}");
                assert_eq!(body["choices"][0]["text"], want["choices"][0]["text"]);
            }
        }
    }
}
