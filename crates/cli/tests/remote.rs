//! Models mirrored from a remote repository: a loopback HTTP server (crates/faultserver) serves a checkpoint
//! and misbehaves on request. The output of a run from the remote equals the local run's bit for bit; every
//! fault is retried or reported, and nothing bad reaches the mirror.

mod common;
use common::*;
use deltafin_faultserver::{Fault, Seen, Server};
use deltafin_makemodel::Arch;
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

const PROMPT: &str = "1,5,9,14,2,7";
/// MoE layers of the tiny K3 preset (layer 0 is dense).
const MOE_LAYERS: usize = 6;

/// A tiny K3 checkpoint with its checksum manifest published.
fn published(seed: u64) -> tempfile::TempDir {
    let t = tiny(Arch::KimiK3, seed);
    let out = deltafin(&["checksums", "--model", path(&model_dir(&t))]);
    assert!(out.status.success(), "{}", stderr(&out));
    t
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn deltafin(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `run` on `model` with `extra` flags: the raw bytes of the dumped logits, and stderr.
fn logits(model: &Path, extra: &[&str]) -> (Vec<u8>, String) {
    let t = tempfile::tempdir().unwrap();
    let npy = t.path().join("logits.npy");
    let out = bin()
        .args(["run", "--model", path(model), "--prompt-ids", PROMPT])
        .args([
            "--max-new",
            "4",
            "--ignore-eos",
            "--dump-logits",
            path(&npy),
        ])
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "run failed: {}", stderr(&out));
    (std::fs::read(&npy).unwrap(), stderr(&out))
}

/// `run` that must fail cleanly; its stderr.
fn run_fails(model: &Path, extra: &[&str]) -> String {
    let out = bin()
        .args([
            "run",
            "--model",
            path(model),
            "--prompt-ids",
            PROMPT,
            "--max-new",
            "2",
        ])
        .args(extra)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(1),
        "expected a clean failure: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn range_requests(seen: &[Seen]) -> Vec<&Seen> {
    seen.iter().filter(|s| s.range.is_some()).collect()
}

/// A published checkpoint served on loopback, and where its mirror goes: (source, server, temp dir, mirror).
fn setup(seed: u64) -> (tempfile::TempDir, Server, tempfile::TempDir, PathBuf) {
    let src = published(seed);
    let server = Server::start(&model_dir(&src));
    let t = tempfile::tempdir().unwrap();
    let m = fresh(&t, "mirror");
    (src, server, t, m)
}

/// `fetch` from `server` into `m` with `extra` flags.
fn fetch(server: &Server, m: &Path, extra: &[&str]) -> Output {
    bin()
        .args(["fetch", "--from", server.url(), "--out", path(m)])
        .args(extra)
        .output()
        .unwrap()
}

/// `fetch --spine-only` into `m`, which must succeed; its output.
fn fetch_spine(server: &Server, m: &Path) -> Output {
    let out = fetch(server, m, &["--spine-only"]);
    assert!(out.status.success(), "{}", stderr(&out));
    out
}

fn fresh(t: &tempfile::TempDir, name: &str) -> PathBuf {
    t.path().join(name)
}

#[test]
fn a_run_from_the_remote_equals_the_local_run_bit_for_bit_then_runs_offline() {
    let src = published(3);
    let server = Server::start(&model_dir(&src));
    let (local, _) = logits(&model_dir(&src), &[]);
    let t = tempfile::tempdir().unwrap();
    let m = fresh(&t, "mirror");

    let (remote, err) = logits(&m, &["--remote", server.url()]);
    assert_eq!(
        local, remote,
        "logits from the remote differ from the local run"
    );
    assert!(err.contains("spine verified"), "{err}");
    let first = server.take_seen();
    assert!(!range_requests(&first).is_empty());
    assert!(first.iter().all(|s| !s.faulted));

    // Everything this prompt routes to is local now: offline works and touches nothing.
    let (offline, _) = logits(&m, &["--offline"]);
    assert_eq!(local, offline);
    assert!(server.take_seen().is_empty(), "--offline made requests");

    // The mirror remembers its URL; without lookahead (which may fetch predicted experts it has not used
    // yet), a run fetches nothing it already has.
    let (again, _) = logits(&m, &["--no-prefetch"]);
    assert_eq!(local, again);
    assert!(range_requests(&server.take_seen()).is_empty());

    // A partial mirror is never mistaken for a complete checkpoint.
    let out = deltafin(&[
        "pack",
        "--model",
        path(&m),
        "--out",
        path(&t.path().join("p")),
    ]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("partial mirror"), "{}", stderr(&out));
}

/// The released families' records (gpt-oss's six slices of stacked tensors, FP8 and INT4 records with their
/// scales, Qwen3's BF16 triples) stream from a verified mirror and from a pack striped over two directories
/// exactly as from the checkpoint's own files.
#[test]
fn every_family_runs_the_same_from_a_mirror_and_from_a_striped_pack() {
    for arch in [Arch::GptOss, Arch::KimiK2, Arch::DeepseekV3, Arch::Qwen3Moe] {
        let src = tiny(arch, 5);
        let dir = model_dir(&src);
        let out = deltafin(&["checksums", "--model", path(&dir)]);
        assert!(out.status.success(), "{arch:?}: {}", stderr(&out));
        let streamed = ["--expert-cache", "0"];
        let (local, _) = logits(&dir, &streamed);

        let server = Server::start(&dir);
        let t = tempfile::tempdir().unwrap();
        let m = fresh(&t, "mirror");
        let (remote, err) = logits(&m, &["--remote", server.url(), "--expert-cache", "0"]);
        assert_eq!(local, remote, "{arch:?}: the mirror's logits differ");
        assert!(err.contains("spine verified"), "{arch:?}: {err}");

        let (p1, p2) = (t.path().join("p1"), t.path().join("p2"));
        let out = deltafin(&[
            "pack",
            "--model",
            path(&dir),
            "--out",
            path(&p1),
            "--out",
            path(&p2),
            "--weights",
            "1,1",
        ]);
        assert!(out.status.success(), "{arch:?}: {}", stderr(&out));
        let (packed, _) = logits(&dir, &["--pack", path(&p2), "--expert-cache", "0"]);
        assert_eq!(local, packed, "{arch:?}: the pack's logits differ");
    }
}

#[test]
fn spine_only_fetch_then_experts_on_first_use_and_offline_says_what_is_missing() {
    let (src, server, _t, m) = setup(4);
    let out = fetch_spine(&server, &m);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("0 experts local") && text.contains("partial"),
        "{text}"
    );
    server.take_seen();

    let out = deltafin(&["doctor", "--model", path(&m)]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", stderr(&out));
    assert!(text.contains("0 of 96 experts local"), "{text}");

    let err = run_fails(&m, &["--offline"]);
    assert!(
        err.contains("not in the local cache") && err.contains("--offline"),
        "{err}"
    );
    assert!(server.take_seen().is_empty(), "--offline made requests");

    let (local, _) = logits(&model_dir(&src), &[]);
    let (remote, _) = logits(&m, &[]);
    assert_eq!(local, remote);
    // Only experts were fetched, each at most once.
    let seen = server.take_seen();
    let ranges = range_requests(&seen);
    assert!(!ranges.is_empty());
    for (i, a) in ranges.iter().enumerate() {
        for b in ranges[i + 1..].iter().filter(|b| b.path == a.path) {
            let ((a0, a1), (b0, b1)) = (a.range.unwrap(), b.range.unwrap());
            assert!(a1 < b0 || b1 < a0, "bytes fetched twice: {a:?} {b:?}");
        }
    }

    // Whole layers on request: layer 2's experts all local afterwards.
    let out = fetch(&server, &m, &["--layers", "2"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let journal = std::fs::read_to_string(m.join(".deltafin-mirror/journal")).unwrap();
    for e in 0..16 {
        assert!(journal.contains(&format!("expert 2 {e} ")), "{journal}");
    }
    let out = fetch(&server, &m, &["--layers", "0"]);
    assert!(
        stderr(&out).contains("no routed experts"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_full_fetch_coalesces_each_layer_into_one_range_and_completes_verified() {
    let (src, server, t, m) = setup(5);
    let out = fetch(&server, &m, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let shards = shards(&m);
    assert!(
        text.contains(&format!(
            "complete: {shards} of {shards} shard(s) verified whole by SHA-256"
        )),
        "{text}"
    );
    let seen = server.take_seen();
    // One verified header read per shard, the spine, and one range per MoE layer and shard it lies in: a
    // layer's 16 experts are adjacent.
    let expert_ranges = range_requests(&seen).len() - shards - spine_chunks(&m);
    assert_eq!(expert_ranges, expert_groups(&m), "{seen:#?}");
    // A complete mirror is an ordinary checkpoint, byte for byte the source.
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "tiktoken.model",
    ] {
        assert_eq!(
            std::fs::read(m.join(f)).unwrap(),
            std::fs::read(model_dir(&src).join(f)).unwrap()
        );
    }
    let (local, _) = logits(&model_dir(&src), &[]);
    let (copy, _) = logits(&m, &["--offline"]);
    assert_eq!(local, copy);
    assert!(deltafin(&[
        "pack",
        "--model",
        path(&m),
        "--out",
        path(&t.path().join("p"))
    ])
    .status
    .success());
}

/// Distinct (MoE layer, shard) pairs holding routed experts: the fewest ranges that fetch them all.
fn expert_groups(model: &Path) -> usize {
    let ck = deltafin_formats::checkpoint::Checkpoint::open(model).unwrap();
    let groups: std::collections::HashSet<(String, usize)> = ck
        .tensors()
        .filter(|t| t.name.contains(".experts."))
        .map(|t| {
            (
                t.name.split(".experts.").next().unwrap().to_string(),
                t.shard,
            )
        })
        .collect();
    assert!(groups.len() >= MOE_LAYERS);
    groups.len()
}

fn shards(model: &Path) -> usize {
    deltafin_formats::checkpoint::Checkpoint::open(model)
        .unwrap()
        .shards
        .len()
}

/// Spine chunks the mirror's journal lists.
fn spine_chunks(m: &Path) -> usize {
    std::fs::read_to_string(m.join(".deltafin-mirror/journal"))
        .unwrap()
        .lines()
        .filter(|l| l.starts_with("chunk "))
        .count()
}

#[test]
fn transient_faults_and_lies_are_retried_and_the_output_is_unchanged() {
    let src = published(6);
    let server = Server::start(&model_dir(&src));
    let (local, _) = logits(&model_dir(&src), &[]);
    let cases = [
        (Fault::Status(503), "server error 503"),
        (Fault::Reset, "transport error"),
        (Fault::Hang(Duration::from_secs(3)), "transport error"),
        (Fault::Truncate, "broke off"),
        (Fault::WrongLength, "Content-Length is"),
        (Fault::WrongRange, "Content-Range is"),
        (Fault::Corrupt, "corrupted bytes"),
    ];
    let t = tempfile::tempdir().unwrap();
    for (i, (fault, says)) in cases.into_iter().enumerate() {
        let m = fresh(&t, &format!("m{i}"));
        // Set up the spine cleanly, then hit the first expert range with the fault.
        fetch_spine(&server, &m);
        server.inject(".safetensors", fault.clone(), 1);
        let (remote, err) = logits(&m, &["--http-timeout", "1", "--stats"]);
        assert_eq!(local, remote, "{fault:?} changed the output");
        assert!(
            err.contains("warning:") && err.contains(says),
            "{fault:?}: {err}"
        );
        assert!(
            err.contains(" 1 retries"),
            "the stats line counts the retry: {err}"
        );
        let seen = server.take_seen();
        assert_eq!(seen.iter().filter(|s| s.faulted).count(), 1, "{fault:?}");
        server.clear_faults();
    }
}

#[test]
fn a_server_that_keeps_lying_fails_cleanly_and_nothing_reaches_the_mirror() {
    let (src, server, t, m) = setup(7);
    fetch_spine(&server, &m);

    server.inject(".safetensors", Fault::Corrupt, usize::MAX);
    let err = run_fails(&m, &["--retries", "2"]);
    assert!(
        err.contains("corrupted bytes") && err.contains("gave up after 3 attempts"),
        "{err}"
    );
    server.clear_faults();
    // Nothing was published: offline, the experts are still missing.
    assert!(run_fails(&m, &["--offline"]).contains("not in the local cache"));
    assert!(!std::fs::read_to_string(m.join(".deltafin-mirror/journal"))
        .unwrap()
        .contains("expert "));

    // The repository changes under a partial mirror: its ranges no longer match the ETag it started with.
    let changed = tempfile::tempdir().unwrap();
    let served = changed.path().join("model");
    copy_dir(&model_dir(&src), &served);
    let moving = Server::start(&served);
    let m3 = fresh(&t, "mirror3");
    fetch_spine(&moving, &m3);
    for entry in std::fs::read_dir(&served).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let mut bytes = std::fs::read(&p).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            std::fs::write(&p, bytes).unwrap();
        }
    }
    let err = run_fails(&m3, &[]);
    assert!(err.contains("changed on the server"), "{err}");

    server.inject(".safetensors", Fault::IgnoreRange, usize::MAX);
    let err = run_fails(&m, &[]);
    assert!(err.contains("ignored the Range header"), "{err}");
    server.clear_faults();

    // A corrupted spine is caught by its checksums too, and the mirror stays unusable.
    let m2 = fresh(&t, "mirror2");
    server.inject_after(".safetensors", Fault::Corrupt, shards(&m), usize::MAX);
    let err = run_fails(&m2, &["--remote", server.url()]);
    assert!(err.contains("sent different bytes"), "{err}");
    server.clear_faults();
    assert!(run_fails(&m2, &["--offline"]).contains("spine"));

    let (local, _) = logits(&model_dir(&src), &[]);
    let (remote, _) = logits(&m, &[]);
    assert_eq!(local, remote);
}

#[test]
fn an_interrupted_fetch_resumes_where_it_stopped() {
    let src = published(8);
    let server = Server::start(&model_dir(&src));
    let t = tempfile::tempdir().unwrap();
    let (headers, spine) = {
        let probe = fresh(&t, "probe");
        fetch_spine(&server, &probe);
        server.take_seen();
        (shards(&probe), spine_chunks(&probe))
    };
    assert!(spine >= 3, "the test needs a spine of several chunks");
    let m = fresh(&t, "mirror");
    let mut served: Vec<Seen> = Vec::new();
    // The server fails (500 from then on) in the middle of the spine, then after two layers of experts.
    for good in [headers + 2, spine - 2 + 2] {
        server.inject_after(".safetensors", Fault::Status(500), good, usize::MAX);
        let out = fetch(&server, &m, &["--retries", "0"]);
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains("server error 500"),
            "{}",
            stderr(&out)
        );
        served.extend(server.take_seen().into_iter().filter(|s| !s.faulted));
        server.clear_faults();
    }
    let out = fetch(&server, &m, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    served.extend(server.take_seen());
    // Every range was served exactly once over the three runs.
    let ranges = range_requests(&served);
    for (i, a) in ranges.iter().enumerate() {
        assert!(
            !ranges[i + 1..]
                .iter()
                .any(|b| b.path == a.path && b.range == a.range),
            "fetched twice: {a:?}"
        );
    }
    assert_eq!(ranges.len(), headers + spine + expert_groups(&m));
    let (local, _) = logits(&model_dir(&src), &[]);
    let (copy, _) = logits(&m, &["--offline"]);
    assert_eq!(local, copy);
}

#[test]
fn a_disk_budget_evicts_experts_and_the_output_is_unchanged() {
    let (src, server, _t, m) = setup(9);
    let (local, _) = logits(&model_dir(&src), &[]);
    // A prompt's prefill can route to all 16 experts of a layer; room for 20 of the 96 makes it evict.
    let record = expert_record_bytes(&model_dir(&src));
    let budget = (20 * record).to_string();
    let (remote, _) = logits(&m, &["--remote", server.url(), "--disk-cache", &budget]);
    assert_eq!(local, remote);
    let journal = std::fs::read_to_string(m.join(".deltafin-mirror/journal")).unwrap();
    assert!(
        journal.contains("evict "),
        "the budget never evicted: {journal}"
    );
    let (again, _) = logits(&m, &["--disk-cache", &budget]);
    assert_eq!(local, again);
    let err = run_fails(&m, &["--disk-cache", "1"]);
    assert!(err.contains("disk budget"), "{err}");
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let p = entry.unwrap().path();
        std::fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

/// Bytes of one routed expert of the tiny preset: its six tensors.
fn expert_record_bytes(model: &Path) -> usize {
    let idx: serde_json::Value =
        serde_json::from_slice(&std::fs::read(model.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let prefix = "language_model.model.layers.1.block_sparse_moe.experts.0.";
    let names: Vec<&String> = idx["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .filter(|k| k.starts_with(prefix))
        .collect();
    assert_eq!(names.len(), 6);
    let ck = deltafin_formats::checkpoint::Checkpoint::open(model).unwrap();
    names
        .iter()
        .map(|n| ck.info(n).unwrap().nbytes as usize)
        .sum()
}

#[test]
fn without_a_manifest_the_mirror_works_and_says_it_is_unverified() {
    let src = tiny(Arch::KimiK3, 10);
    let server = Server::start(&model_dir(&src));
    let t = tempfile::tempdir().unwrap();
    let m = fresh(&t, "mirror");
    let (local, _) = logits(&model_dir(&src), &[]);
    let (remote, err) = logits(&m, &["--remote", server.url()]);
    assert_eq!(local, remote);
    assert!(err.contains("spine NOT verified"), "{err}");
    // An ordinary checkpoint is never turned into a mirror.
    let err = run_fails(&model_dir(&src), &["--remote", server.url()]);
    assert!(err.contains("not a mirror"), "{err}");
    // A repository served without LFS: pointer files where the shards should be.
    let lfs = tiny(Arch::KimiK3, 11);
    for entry in std::fs::read_dir(model_dir(&lfs)).unwrap() {
        let p = entry.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::fs::write(
                &p,
                "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 9\n",
            )
            .unwrap();
        }
    }
    let lfs_server = Server::start(&model_dir(&lfs));
    let err = run_fails(&fresh(&t, "lfs"), &["--remote", lfs_server.url()]);
    assert!(err.contains("Git LFS pointer"), "{err}");
    // A URL that is not a repository.
    let err = run_fails(
        &fresh(&t, "x"),
        &["--remote", &format!("{}/nothing", server.url())],
    );
    assert!(err.contains("no config.json"), "{err}");
}

/// The bytes of expert `e` of `layer` as the checkpoint in `dir` stores them (its one record span).
fn expert_bytes(dir: &Path, layer: usize, e: usize) -> Vec<u8> {
    let (files, layers, len) = deltafin_store::record::expert_sources(dir).unwrap();
    let mut out = Vec::with_capacity(len);
    for x in &layers[layer][e].extents {
        let all = std::fs::read(&files[x.file]).unwrap();
        out.extend_from_slice(&all[x.offset as usize..x.offset as usize + x.len]);
    }
    out
}

/// Experts `ids` of `layer` read through `store`, in id order.
fn read_experts(store: &deltafin_store::ExpertStore, layer: usize, ids: &[usize]) -> Vec<Vec<u8>> {
    let mut fetch = store.fetch(layer, ids);
    let mut got = Vec::new();
    while let Some(r) = fetch.next() {
        let r = r.unwrap();
        got.push((r.expert, r.bytes().to_vec()));
    }
    got.sort();
    got.into_iter().map(|(_, b)| b).collect()
}

#[test]
fn the_cuda_backend_opens_a_partial_mirror_through_the_cpu_path_and_never_reads_holes() {
    use deltafin_models::{LoadOptions, Model};
    use std::sync::Arc;
    let (src, server, _t, m) = setup(6);
    fetch_spine(&server, &m);
    server.take_seen();

    // Without its remote source, the CUDA backend's model source is refused with the CPU's own message.
    let plain = LoadOptions::default();
    let cpu = Model::load_with(&m, &plain).err().expect("the CPU refuses");
    let cuda = deltafin_cuda::Source::open(&m, &plain)
        .err()
        .expect("the CUDA source refuses");
    assert_eq!(format!("{cpu:#}"), format!("{cuda:#}"));
    assert!(server.take_seen().is_empty());

    // With it, every expert the CUDA backend reads is fetched (and journaled) first: the source's bytes, not the
    // sparse files' zeros.
    let source = deltafin_remote::Source::new(server.url(), Default::default()).unwrap();
    let mirror =
        deltafin_remote::open_mirror(&m, Some(source), Default::default(), &|_, _| {}).unwrap();
    let load = LoadOptions {
        backfill: Some(Arc::new(mirror)),
        ..LoadOptions::default()
    };
    let opened = deltafin_cuda::Source::open(&m, &load).unwrap();
    let ids = [0, 5, 15];
    let got = read_experts(&opened.experts.store, 2, &ids);
    for (bytes, &e) in got.iter().zip(&ids) {
        assert_eq!(*bytes, expert_bytes(&model_dir(&src), 2, e), "expert {e}");
        assert!(bytes.iter().any(|&b| b != 0));
    }
    assert!(!range_requests(&server.take_seen()).is_empty());
    let journal = std::fs::read_to_string(m.join(".deltafin-mirror/journal")).unwrap();
    for e in ids {
        assert!(journal.contains(&format!("expert 2 {e} ")), "{journal}");
    }
}
