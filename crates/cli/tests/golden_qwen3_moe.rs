//! Qwen3-MoE against transformers (tests/fixtures/qwen3_moe_tiny_bf16: make-model's tiny qwen3_moe with goldens
//! from tools/oracle/qwen3_moe_golden.py): logits within 1e-4 relative at every prompt position and 8 decode
//! steps, the same greedy tokens and routing, the engine's invariances (streamed or cached experts, thread
//! counts; scalar vs SIMD is in scalar_kernels.rs), and the tokenizer and chat template transformers reads.

mod common;
use common::golden::*;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_tokenizer::chat::{ChatFormat, ChatMessage, Role};
use deltafin_tokenizer::Tokenizer;
use serde_json::Value;

const NAME: &str = "qwen3_moe_tiny_bf16";

#[test]
fn qwen3_moe_matches_transformers_goldens() {
    matches_goldens(NAME);
}

#[test]
fn qwen3_moe_streamed_cached_and_thread_counts_give_identical_bits() {
    streamed_cached_and_threads_agree(NAME);
}

#[test]
fn qwen3_moe_cli_run_generates_the_golden_tokens() {
    cli_run_generates_the_golden(NAME);
}

#[test]
fn qwen3_moe_cuda_refuses_the_family_with_a_clear_error() {
    cuda_refuses(NAME);
}

/// Plain text encodes to transformers' ids and decodes back.
#[test]
fn qwen3_moe_tokenizer_encodes_as_transformers() {
    let tok = Tokenizer::from_dir(&fixture(NAME)).unwrap();
    for case in golden(&fixture(NAME))["tokenizer_cases"]
        .as_array()
        .unwrap()
    {
        let text = case["text"].as_str().unwrap();
        let ours = tok.encode(text);
        assert_eq!(ours, ids(&case["ids"]), "{text:?}");
        assert_eq!(tok.decode(&ours).unwrap(), text);
    }
}

fn message(v: &Value) -> ChatMessage {
    let role = match v["role"].as_str().unwrap() {
        "system" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        other => panic!("no role {other}"),
    };
    ChatMessage {
        reasoning: v["reasoning_content"].as_str().map(str::to_string),
        ..ChatMessage::new(role, v["content"].as_str().unwrap())
    }
}

/// The checkpoint's chat template renders each conversation to transformers' ids: the reasoning of earlier
/// turns dropped, the last reply's in a `<think>` block, `<|im_start|>assistant\n` as the generation prompt.
#[test]
fn qwen3_moe_chat_template_renders_as_transformers() {
    let dir = fixture(NAME);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let Some(ChatFormat::Template(t)) = ChatFormat::from_dir(&dir, &tok, false).unwrap() else {
        panic!("qwen3_moe chats through its own template");
    };
    for case in golden(&dir)["chat_cases"].as_array().unwrap() {
        let messages: Vec<ChatMessage> = case["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(message)
            .collect();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let pieces = t.render(&messages, add, None).unwrap();
        assert_eq!(
            tok.encode_pieces(&pieces),
            ids(&case["ids"]),
            "{}",
            case["text"]
        );
    }
}

/// Generation stops at `<|im_end|>` and `<|endoftext|>` (generation_config.json's eos ids, as released).
#[test]
fn qwen3_moe_stops_at_im_end() {
    let tok = Tokenizer::from_dir(&fixture(NAME)).unwrap();
    let eos = tok.eos_ids();
    for name in ["<|im_end|>", "<|endoftext|>"] {
        let id = tok.special_id(name).unwrap();
        assert!(eos.contains(&id), "{name} ({id}) is not a stop id: {eos:?}");
    }
}

/// `deltafin run --chat` builds transformers' chat prompt for the golden conversation: its prompt rows and
/// generated tokens are the goldens'.
#[test]
fn qwen3_moe_cli_chat_prompt_is_transformers() {
    let dir = fixture(NAME);
    let g = golden(&dir);
    let (prompt, generated) = (ids(&g["prompt_ids"]), ids(&g["generated_ids"]));
    let text = g["prompt_messages"][0]["content"].as_str().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let npy = out_dir.path().join("logits.npy");
    let out = bin()
        .arg("run")
        .arg("--model")
        .arg(&dir)
        .args(["--chat", "--prompt", text, "--max-new"])
        .arg(generated.len().to_string())
        .arg("--dump-logits")
        .arg(&npy)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ours = deltafin_formats::npy::read(&npy).unwrap();
    let gold = deltafin_formats::npy::read(&dir.join("golden_logits.npy")).unwrap();
    assert_eq!(ours.rows, prompt.len() + generated.len());
    for r in 0..prompt.len() {
        assert_row_close(
            &format!("chat prompt row {r}"),
            ours.row(r),
            gold.row(r),
            TOL,
        );
    }
    let tokens: Vec<u32> = (0..generated.len())
        .map(|j| argmax(ours.row(prompt.len() + j)))
        .collect();
    assert_eq!(tokens, generated);
}

/// The fixture is make-model's output, byte for byte: what transformers read when it made the goldens is what
/// `deltafin make-model --arch qwen3_moe --preset tiny` writes now.
#[test]
fn qwen3_moe_make_model_writes_the_fixture() {
    let dir = fixture(NAME);
    let seed = golden(&dir)["weight_seed"].as_u64().unwrap();
    let made = tiny(Arch::Qwen3Moe, seed);
    let mut files: Vec<_> = std::fs::read_dir(model_dir(&made))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    files.sort();
    assert_eq!(files.len(), 8, "{files:?}");
    for f in files {
        let ours = std::fs::read(model_dir(&made).join(&f)).unwrap();
        assert!(
            ours == std::fs::read(dir.join(&f)).unwrap(),
            "{f:?} differs from the fixture's"
        );
    }
}
