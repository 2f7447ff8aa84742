//! The scalar fallback and every SIMD path (AVX2, AVX-512, NEON: those this CPU runs) follow one reduction
//! order, so whole-model logits agree bit for bit. (Its own test binary: choosing a path is process-wide.)

mod common;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_models::{Backend, LogitRows, Model, Stats};

#[test]
fn scalar_and_simd_kernels_give_identical_logits() {
    let made: Vec<_> = [Arch::KimiK3, Arch::KimiLinear]
        .into_iter()
        .map(|arch| (format!("{arch:?}"), tiny(arch, 6)))
        .collect();
    let mut dirs: Vec<(String, std::path::PathBuf)> = made
        .iter()
        .map(|(n, t)| (n.clone(), model_dir(t)))
        .collect();
    // DeepSeek-V3 in BF16 and FP8, Kimi K2 with INT4 experts (tails of width 144, partial FP8 blocks),
    // Qwen3-MoE (GQA with q/k norms, a dense layer).
    for f in [
        "deepseek_v3_tiny_bf16",
        "deepseek_v3_tiny_fp8",
        "kimi_k2_tiny_int4",
        "qwen3_moe_tiny_bf16",
    ] {
        dirs.push((f.into(), repo_root().join("tests/fixtures").join(f)));
    }
    for (arch, dir) in dirs {
        let model = Model::load(&dir).unwrap();
        let run = || {
            let mut s = model.new_session();
            model
                .forward(
                    &mut s,
                    &[1, 2, 3, 400, 5],
                    LogitRows::All,
                    &Stats::default(),
                )
                .unwrap()
        };
        deltafin_kernels::set_isa(Some("scalar")).unwrap();
        let scalar = run();
        for isa in deltafin_kernels::isas() {
            deltafin_kernels::set_isa(Some(isa)).unwrap();
            assert!(run() == scalar, "{arch}: {isa} and scalar kernels differ");
        }
        deltafin_kernels::set_isa(None).unwrap();
    }
}
