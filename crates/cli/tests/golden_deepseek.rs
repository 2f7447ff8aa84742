//! DeepSeek-V3 / Kimi K2 against transformers' goldens (tests/fixtures/{deepseek_v3_tiny_bf16,
//! deepseek_v3_tiny_fp8, kimi_k2_tiny_int4}, made by tools/oracle/deepseek_v3_golden.py): logits within 1e-4
//! relative at every prompt position and 8 decode steps, the same greedy tokens and routing; and the engine's
//! own invariances on these checkpoints (experts streamed or cached, thread counts).

mod common;
use common::golden::*;

const FIXTURES: [&str; 3] = [
    "deepseek_v3_tiny_bf16",
    "deepseek_v3_tiny_fp8",
    "kimi_k2_tiny_int4",
];

#[test]
fn deepseek_v3_bf16_matches_transformers_goldens() {
    matches_goldens("deepseek_v3_tiny_bf16");
}

#[test]
fn deepseek_v3_fp8_matches_transformers_goldens() {
    matches_goldens("deepseek_v3_tiny_fp8");
}

#[test]
fn kimi_k2_int4_matches_transformers_goldens() {
    matches_goldens("kimi_k2_tiny_int4");
}

/// The same bits whether experts are read from the shards on every use (cache 0) or cached, on 1 or 2
/// threads.
#[test]
fn streamed_cached_and_thread_counts_give_identical_bits() {
    for name in FIXTURES {
        streamed_cached_and_threads_agree(name);
    }
}

/// `deltafin run` on a fixture: the greedy tokens transformers chose.
#[test]
fn cli_run_generates_the_golden_tokens() {
    cli_run_generates_the_golden("kimi_k2_tiny_int4");
}

/// The CUDA backend takes this family in each stored format (tools/cuda/verify.sh compares its logits with the
/// CPU's and these goldens on a GPU): opening a checkpoint for it no longer stops at the family.
#[test]
fn cuda_opens_the_family_in_every_format() {
    for name in FIXTURES {
        let dir = fixture(name);
        if let Err(e) = deltafin_cuda::Source::open(&dir, &deltafin_models::LoadOptions::default())
        {
            panic!("{name}: {e:#}");
        }
    }
}
