//! One function per parser of untrusted input, each taking arbitrary bytes. None may panic, hang or allocate
//! without bound, whatever the bytes; where a parser has a property (a streamed reply parses like the whole
//! text), the target asserts it. `tools/fuzz` runs them under libFuzzer; the tests replay the committed
//! corpus (`tools/fuzz/corpus/TARGET/`).

mod http;
mod tokenizer;

use deltafin_formats::{checkpoint, checksums::Checksums, config::ModelConfig, mirror, npy};
use std::path::Path;

/// A fuzz target: its name (the corpus folder) and its function.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "safetensors_header",
        run: safetensors_header,
    },
    Target {
        name: "safetensors_index",
        run: safetensors_index,
    },
    Target {
        name: "model_config",
        run: model_config,
    },
    Target {
        name: "npy",
        run: npy_array,
    },
    Target {
        name: "checksums",
        run: checksum_manifest,
    },
    Target {
        name: "mirror_state",
        run: mirror_state,
    },
    Target {
        name: "mirror_journal",
        run: mirror_journal,
    },
    Target {
        name: "pack_manifest",
        run: pack_manifest,
    },
    Target {
        name: "http_response",
        run: http::response,
    },
    Target {
        name: "tiktoken",
        run: tokenizer::tiktoken,
    },
    Target {
        name: "tokenizer_config",
        run: tokenizer::config,
    },
    Target {
        name: "tokenizer_json",
        run: tokenizer::hf_json,
    },
    Target {
        name: "chat_template",
        run: tokenizer::chat_template,
    },
    Target {
        name: "reply_parser",
        run: tokenizer::reply,
    },
    Target {
        name: "api_chat",
        run: api_chat,
    },
    Target {
        name: "api_completions",
        run: api_completions,
    },
    Target {
        name: "api_responses",
        run: api_responses,
    },
    Target {
        name: "api_messages",
        run: api_messages,
    },
];

/// The target called `name`.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}

fn safetensors_header(data: &[u8]) {
    if let Ok(tensors) = checkpoint::parse_header(Path::new("fuzz.safetensors"), data, 0) {
        // What the header promises must lie inside the bytes it came with.
        for t in tensors {
            assert!(
                t.offset + t.nbytes <= data.len() as u64,
                "{t:?} outside {} bytes",
                data.len()
            );
        }
    }
}

fn safetensors_index(data: &[u8]) {
    let _ = checkpoint::parse_index(data, "fuzz index");
}

fn model_config(data: &[u8]) {
    if let Ok(v) = serde_json::from_slice(data) {
        let _ = ModelConfig::from_json(&v);
    }
}

fn npy_array(data: &[u8]) {
    if let Ok(a) = npy::parse(data) {
        // The shape may be huge with no data at all ((4e9, 0)): check the extremes, not every row.
        assert_eq!(a.rows.checked_mul(a.cols), Some(a.data.len()));
        if a.rows > 0 {
            let _ = (a.row(0), a.row(a.rows - 1));
        }
    }
}

fn checksum_manifest(data: &[u8]) {
    let _ = Checksums::parse(data, "fuzz checksums");
}

fn mirror_state(data: &[u8]) {
    let _ = mirror::parse_state(data);
}

fn mirror_journal(data: &[u8]) {
    let _ = deltafin_remote::journal::replay(data, "fuzz journal");
}

fn pack_manifest(data: &[u8]) {
    if let Ok(m) = deltafin_store::pack::Manifest::parse(data, "fuzz manifest") {
        let _ = m.records(4);
    }
}

fn api(route: &str, data: &[u8]) {
    let _ = deltafin_server::parse_request(route, data).expect("a route with a body");
}

fn api_chat(data: &[u8]) {
    api("/v1/chat/completions", data);
}

fn api_completions(data: &[u8]) {
    api("/v1/completions", data);
}

fn api_responses(data: &[u8]) {
    api("/v1/responses", data);
}

/// Messages and its token count take the same body.
fn api_messages(data: &[u8]) {
    api("/v1/messages", data);
    api("/v1/messages/count_tokens", data);
}
