//! A drive that fails an expert read (EIO, or a short read), injected through the store's fault hook: a
//! request whose pass needs the bad record fails with an error naming the file, layer and expert; requests that
//! do not need it complete with their usual tokens, even when they shared the failed pass; nothing wrong is ever
//! generated or cached.

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

/// A bad record: every read that starts at it fails, while set.
#[derive(Debug)]
struct BadRecord {
    fault: Fault,
    at: Mutex<Option<(PathBuf, u64)>>,
}

impl FaultInjector for BadRecord {
    fn before_read(&self, path: &Path, offset: u64, _len: usize) -> Option<Fault> {
        let at = self.at.lock().unwrap();
        (at.as_ref()? == &(path.to_path_buf(), offset)).then_some(self.fault)
    }
}

/// A server whose every pass reads its experts from disk (no cache, no prefetch, buffered reads that start
/// at the record), through `faults`, with no prefix reuse.
fn serve(faults: Arc<BadRecord>, max_active: usize) -> Running {
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
            // Every request computes its whole prompt: which requests need a record does not depend on what
            // earlier ones left in the prefix cache.
            prefix_cache_bytes: 0,
            ..SchedulerConfig::default()
        },
        ..config()
    };
    Running::start("127.0.0.1:0".parse().unwrap(), model, tokenizer, cfg).unwrap()
}

const PROMPTS: [&str; 3] = ["Experts stream from", "The drive", "Once upon a time"];

fn body(prompt: &str) -> Value {
    json!({"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})
}

/// Greedy completions of every prompt at once: (status, body) each.
fn complete_all(s: &Running) -> Vec<(u16, Value)> {
    let addr = s.addr;
    let threads: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            let body = body(p);
            std::thread::spawn(move || {
                let r = post(addr, "/v1/completions", &body);
                (r.status, r.json())
            })
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Whether each prompt, sent alone, fails.
fn fails_alone(s: &Running) -> Vec<bool> {
    PROMPTS
        .iter()
        .map(|p| post(s.addr, "/v1/completions", &body(p)).status != 200)
        .collect()
}

/// Every routed expert record of the model: (layer, expert, its file, its offset).
fn records() -> Vec<(usize, usize, PathBuf, u64)> {
    let (sources, layers, _) = deltafin_store::record::expert_sources(&model_dir()).unwrap();
    let mut all = Vec::new();
    for (l, recs) in layers.iter().enumerate() {
        for (e, r) in recs.iter().enumerate() {
            let x = &r.extents[0];
            all.push((l, e, sources[x.file].clone(), x.offset));
        }
    }
    all
}

#[test]
fn a_failed_expert_read_fails_the_requests_that_need_it_naming_file_layer_and_expert_and_the_others_complete(
) {
    let usual = {
        let s = serve(
            Arc::new(BadRecord {
                fault: Fault::Os(EIO),
                at: Mutex::default(),
            }),
            1,
        );
        let r = complete_all(&s);
        assert!(r.iter().all(|(status, _)| *status == 200), "{r:?}");
        r
    };
    for (fault, says) in [
        (Fault::Os(EIO), "Input/output error"),
        (Fault::Short(100), "short read"),
    ] {
        let faults = Arc::new(BadRecord {
            fault,
            at: Mutex::default(),
        });
        // A record that some prompts need and others do not: each prompt sent alone, with that record bad, to a
        // server of its own (the store's working slots may still hold a record an earlier request read).
        let (layer, expert, file, alone) = records()
            .into_iter()
            .find_map(|(l, e, file, offset)| {
                *faults.at.lock().unwrap() = Some((file.clone(), offset));
                let alone = fails_alone(&serve(faults.clone(), 1));
                let some = alone.iter().any(|&f| f) && !alone.iter().all(|&f| f);
                some.then_some((l, e, file, alone))
            })
            .expect("a record that some prompts need and others do not");
        // One generation at a time, or all three in shared passes: the same requests fail as alone.
        for max_active in [1, 3] {
            let s = serve(faults.clone(), max_active);
            let got = complete_all(&s);
            for (((status, body), (_, want)), fails) in got.iter().zip(&usual).zip(&alone) {
                if !fails {
                    assert_eq!(*status, 200, "{fault:?}, {max_active} at a time: {body}");
                    assert_eq!(body["choices"][0]["text"], want["choices"][0]["text"]);
                    assert_eq!(
                        body["choices"][0]["logprobs"]["tokens"],
                        want["choices"][0]["logprobs"]["tokens"]
                    );
                    continue;
                }
                assert_eq!(*status, 500, "{body}");
                let message = body["error"]["message"].as_str().unwrap();
                for what in [
                    &file.display().to_string(),
                    &format!("layer {layer} expert {expert}"),
                    says,
                ] {
                    assert!(message.contains(what), "{what:?} missing: {message}");
                }
            }
            eprintln!(
                "{fault:?}, {max_active} at a time: {} passes run again one request at a time",
                metric(s.addr, "deltafin_isolated_passes_total")
            );
            // The drive mended, the server goes on serving, from bytes read again: the usual replies.
            let bad = faults.at.lock().unwrap().take();
            let again = complete_all(&s);
            for ((status, body), (_, want)) in again.iter().zip(&usual) {
                assert_eq!(*status, 200, "{body}");
                assert_eq!(body["choices"][0]["text"], want["choices"][0]["text"]);
            }
            *faults.at.lock().unwrap() = bad;
        }
    }
}
