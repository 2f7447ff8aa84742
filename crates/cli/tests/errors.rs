//! Every deviation from the contract is a clear error that names the file, tensor or field, what was
//! expected and what was found — never a panic, never a silent fallback.

mod common;
use common::*;
use deltafin_makemodel::Arch;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

/// `deltafin run` on `model`; asserts a clean failure (exit 1, no panic) and returns stderr.
fn run_err(model: &Path, ids: &str) -> String {
    let out = bin()
        .arg("run")
        .arg("--model")
        .arg(model)
        .args(["--prompt-ids", ids, "--max-new", "2"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected a clean failure, got {:?}: {stderr}",
        out.status
    );
    assert!(
        !stderr.contains("panicked"),
        "a panic is never an error message: {stderr}"
    );
    assert!(stderr.starts_with("error: "), "{stderr}");
    stderr
}

/// The shard of the index holding `tensor`.
fn shard_of(model: &Path, tensor: &str) -> std::path::PathBuf {
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    model.join(index["weight_map"][tensor].as_str().unwrap())
}

/// Rewrites the shard holding `tensor`, letting `edit` drop it (None) or replace it.
fn rewrite(
    model: &Path,
    tensor: &str,
    edit: impl Fn(TensorView) -> Option<(Dtype, Vec<usize>, Vec<u8>)>,
) {
    let path = shard_of(model, tensor);
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut owned: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        if name == tensor {
            if let Some((d, s, b)) = edit(view) {
                owned.push((name, d, s, b));
            }
        } else {
            owned.push((
                name,
                view.dtype(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ));
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

const EMBED: &str = "language_model.model.embed_tokens.weight";
const NORM: &str = "language_model.model.layers.1.input_layernorm.weight";

#[test]
fn missing_tensor_is_named() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    let target = "language_model.model.layers.2.self_attn.q_proj.weight";
    rewrite(&m, target, |_| None);
    let e = run_err(&m, "1,2");
    assert!(e.contains(target), "{e}");
}

#[test]
fn wrong_dtype_is_named_with_expected_and_found() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    rewrite(&m, EMBED, |v| {
        let widened: Vec<u8> = v
            .data()
            .chunks(2)
            .flat_map(|c| [0, 0, c[0], c[1]])
            .collect();
        Some((Dtype::F32, v.shape().to_vec(), widened))
    });
    let e = run_err(&m, "1,2");
    assert!(
        e.contains(EMBED) && e.contains("has dtype F32, expected BF16"),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_named_with_expected_and_found() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    rewrite(&m, NORM, |v| {
        Some((v.dtype(), vec![32], v.data()[..64].to_vec()))
    });
    let e = run_err(&m, "1,2");
    assert!(
        e.contains(NORM) && e.contains("has shape [32], expected [64]"),
        "{e}"
    );
}

#[test]
fn truncated_shard_is_reported() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    let shard = shard_of(&m, EMBED);
    let len = std::fs::metadata(&shard).unwrap().len();
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap();
    f.set_len(len - 1000).unwrap();
    let e = run_err(&m, "1,2");
    assert!(
        e.contains(shard.file_name().unwrap().to_str().unwrap()) && e.contains("truncated"),
        "{e}"
    );
}

#[test]
fn a_git_lfs_pointer_instead_of_a_shard_is_named() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    let shard = shard_of(&m, EMBED);
    std::fs::write(
        &shard,
        "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a2146\nsize 5368709120\n",
    )
    .unwrap();
    let e = run_err(&m, "1,2");
    assert!(
        e.contains("Git LFS pointer") && e.contains("git lfs pull"),
        "{e}"
    );
}

#[test]
fn bad_json_and_unknown_model_type_are_reported() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    let cfg_path = m.join("config.json");
    let original = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, &original[..original.len() / 2]).unwrap();
    let e = run_err(&m, "1,2");
    assert!(
        e.contains("config.json") && e.contains("not valid JSON"),
        "{e}"
    );

    let mut v: serde_json::Value = serde_json::from_str(&original).unwrap();
    v["model_type"] = "gpt2".into();
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = run_err(&m, "1,2");
    assert!(
        e.contains("config.json") && e.contains("\"gpt2\"") && e.contains("kimi_k3"),
        "{e}"
    );

    v["model_type"] = "kimi_k3".into();
    v["text_config"]
        .as_object_mut()
        .unwrap()
        .remove("num_experts");
    std::fs::write(&cfg_path, v.to_string()).unwrap();
    let e = run_err(&m, "1,2");
    assert!(e.contains("missing field `num_experts`"), "{e}");
}

#[test]
fn corrupt_expert_scale_is_an_error_naming_layer_and_expert() {
    let t = tiny(Arch::KimiK3, 0);
    let m = model_dir(&t);
    // Poison every expert of layer 1 so whichever is routed is caught.
    for e in 0..16 {
        let name =
            format!("language_model.model.layers.1.block_sparse_moe.experts.{e}.w2.weight_scale");
        rewrite(&m, &name, |v| {
            let mut b = v.data().to_vec();
            b[0] = 255;
            Some((v.dtype(), v.shape().to_vec(), b))
        });
    }
    let e = run_err(&m, "1,2");
    assert!(e.contains("layer 1 expert") && e.contains("255"), "{e}");
}

#[test]
fn out_of_vocabulary_prompt_and_missing_directory() {
    let t = tiny(Arch::KimiK3, 0);
    let e = run_err(&model_dir(&t), "1,99999");
    assert!(e.contains("99999") && e.contains("vocabulary"), "{e}");
    let e = run_err(&t.path().join("nope"), "1");
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn serve_refuses_a_drafter_it_cannot_load_before_listening() {
    let t = tiny(Arch::KimiK3, 0);
    let out = bin()
        .args(["serve", "--port", "0", "--model"])
        .arg(model_dir(&t))
        .arg("--draft")
        .arg(t.path().join("no-drafter"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("loading the drafter") && stderr.contains("no-drafter"),
        "{stderr}"
    );
}

#[test]
fn without_cuda_every_command_that_generates_says_why_it_cannot_use_the_gpu() {
    if deltafin_cuda::availability().is_ok() {
        // A GPU machine: there these commands run (tools/cuda/verify.sh checks them).
        return;
    }
    let t = tiny(Arch::KimiK3, 0);
    let commands: [&[&str]; 3] = [
        &["run", "--prompt-ids", "1,2", "--max-new", "2"],
        &["chat"],
        &["serve", "--port", "0"],
    ];
    for command in commands {
        let out = bin()
            .args(command)
            .arg("--model")
            .arg(model_dir(&t))
            .args(["--device", "cuda"])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        assert_cuda_unavailable(&out, &format!("{command:?}"));
    }
    // The GPU benchmark says so before it creates its 10 GB model.
    let cache = tempfile::tempdir().unwrap();
    let out = bin()
        .args(["bench", "--compute", "--device", "cuda", "--cache-dir"])
        .arg(cache.path())
        .output()
        .unwrap();
    assert_cuda_unavailable(&out, "bench --compute");
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0);
}

/// `what` failed (exit 1) saying that CUDA is unavailable.
fn assert_cuda_unavailable(out: &std::process::Output, what: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{what}: {stderr}");
    assert!(
        stderr.starts_with("error: --device cuda: CUDA is unavailable: "),
        "{what}: {stderr}"
    );
}

#[test]
fn the_drive_benchmark_runs_on_the_cpu_only() {
    let out = bin().args(["bench", "--device", "cuda"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("add --compute"), "{stderr}");
}

/// The compute benchmark names the presets it runs, and creates nothing for one it does not.
#[test]
fn the_compute_benchmark_refuses_other_presets() {
    let cache = tempfile::tempdir().unwrap();
    for (preset, says) in [
        ("tiny", "the compute benchmark runs small, wide or bench"),
        ("huge", "expected one of tiny, small, bench, wide"),
    ] {
        let out = bin()
            .args(["bench", "--compute", "--preset", preset, "--cache-dir"])
            .arg(cache.path())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{preset}: {stderr}");
        assert!(
            stderr.contains("--preset") && stderr.contains(says),
            "{preset}: {stderr}"
        );
    }
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0);
}

#[test]
fn the_timeline_asks_for_the_gpu() {
    let t = tiny(Arch::KimiK3, 0);
    let out = bin()
        .args([
            "run",
            "--prompt-ids",
            "1,2",
            "--max-new",
            "2",
            "--timeline",
            "--model",
        ])
        .arg(model_dir(&t))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("--timeline times the GPU's kernels: add --device cuda"),
        "{stderr}"
    );
}

#[test]
fn a_pack_whose_bandwidth_probe_cannot_write_says_where_how_much_and_how_to_skip_it() {
    let t = tiny(Arch::KimiK3, 0);
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    // Something in the first probe file's place: its write fails as a full drive's would (and no probe runs).
    std::fs::create_dir_all(a.join(".deltafin-probe")).unwrap();
    let out = bin()
        .args(["pack", "--model"])
        .arg(model_dir(&t))
        .arg("--out")
        .arg(&a)
        .arg("--out")
        .arg(&b)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for what in [
        &format!("measuring the read bandwidth of {}", a.display()),
        "256 MiB probe file",
        &format!("free space in {}", a.display()),
        "--weights 1,1",
    ] {
        assert!(stderr.contains(what), "{what:?} missing: {stderr}");
    }
}
