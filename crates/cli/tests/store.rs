//! The expert store (issue: streaming): logits are bit-identical whatever the cache, prefetch, I/O mode,
//! packing and striping; damaged packs and missing stripes are clear errors.

mod common;
use common::*;
use deltafin_makemodel::Arch;
use deltafin_models::{Backend, LoadOptions, LogitRows, Model, Stats};
use deltafin_store::StoreOptions;
use std::path::{Path, PathBuf};

const PROMPT: [u32; 6] = [5, 300, 17, 42, 511, 99];

/// Prefill + 5 greedy steps, every logit as bits.
fn logits(dir: &Path, opts: &LoadOptions) -> Vec<u32> {
    greedy_logit_bits(&Model::load_with(dir, opts).unwrap(), &PROMPT, 5)
}

fn opts(cache_bytes: u64, prefetch: bool, direct_io: bool, pack: Option<PathBuf>) -> LoadOptions {
    LoadOptions {
        store: StoreOptions {
            cache_bytes,
            prefetch,
            direct_io,
            ..StoreOptions::default()
        },
        pack,
        ..LoadOptions::default()
    }
}

#[test]
fn a_memory_budget_streams_spine_layers_with_identical_logits() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 16);
        let m = model_dir(&t);
        let reference = logits(&m, &opts(0, false, false, None));
        // Just above the floor (globals + expert slab + two streamed layers): most layers must stream.
        let err = Model::load_with(
            &m,
            &LoadOptions {
                memory_budget: Some(1),
                ..opts(0, false, false, None)
            },
        )
        .err()
        .unwrap();
        let msg = format!("{err:#}");
        assert!(
            msg.contains("--memory-budget") && msg.contains("too small"),
            "{msg}"
        );
        let floor: u64 = msg
            .split("needs at least ")
            .nth(1)
            .unwrap()
            .split(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let tight = LoadOptions {
            memory_budget: Some(floor + 1),
            ..opts(0, true, false, None)
        };
        let model = Model::load_with(&m, &tight).unwrap();
        assert!(
            model.streamed_layers() > 0,
            "{arch:?}: a budget at the floor must stream layers"
        );
        drop(model);
        assert!(
            logits(&m, &tight) == reference,
            "{arch:?}: streaming the spine changed the logits"
        );
    }
}

#[test]
fn a_model_that_fits_is_filled_in_the_background_then_decodes_from_memory() {
    let t = tiny(Arch::KimiK3, 12);
    let m = model_dir(&t);
    let reference = logits(&m, &opts(0, false, false, None));
    let model = Model::load_with(&m, &opts(64 << 20, false, true, None)).unwrap();
    let store = model.store().clone();
    assert_eq!(
        store.snapshot().background_bytes,
        0,
        "the fill waits for the first demand"
    );
    assert!(greedy_logit_bits(&model, &PROMPT, 5) == reference);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while store.records_cached().1 < store.records_cached().0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the fill stopped at {:?}",
            store.records_cached()
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let filled = store.snapshot();
    assert!(
        filled.background_bytes > 0,
        "every record came from demand: nothing was left to fill"
    );
    // A second generation reads nothing: every record is in memory, and the logits are the same.
    assert!(greedy_logit_bits(&model, &PROMPT, 5) == reference);
    let d = store.snapshot().since(&filled);
    assert_eq!((d.bytes_read(), d.background_bytes), (0, 0));
    assert_eq!(d.hits, d.requests);
}

fn pack(model: &Path, outs: &[PathBuf]) {
    let mut cmd = bin();
    cmd.arg("pack").arg("--model").arg(model);
    for o in outs {
        cmd.arg("--out").arg(o);
    }
    if outs.len() > 1 {
        // Fixed weights: measuring bandwidth in a test would only add noise.
        cmd.arg("--weights").arg(vec!["1"; outs.len()].join(","));
    }
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "pack failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn logits_are_identical_across_cache_prefetch_io_mode_packing_and_striping() {
    for arch in [Arch::KimiK3, Arch::KimiLinear] {
        let t = tiny(arch, 11);
        let m = model_dir(&t);
        let reference = logits(&m, &opts(0, false, false, None));
        let one = t.path().join("one");
        pack(&m, std::slice::from_ref(&one));
        let three: Vec<PathBuf> = (0..3)
            .map(|i| t.path().join(format!("stripe{i}")))
            .collect();
        pack(&m, &three);
        for (what, o) in [
            ("cache on", opts(64 << 20, false, false, None)),
            ("prefetch on", opts(0, true, false, None)),
            ("cache + prefetch", opts(64 << 20, true, false, None)),
            ("direct I/O", opts(0, true, true, None)),
            (
                "io_uring",
                LoadOptions {
                    store: StoreOptions {
                        backend: deltafin_store::io::Backend::Uring,
                        ..opts(0, true, true, None).store
                    },
                    ..opts(0, true, true, None)
                },
            ),
            ("packed", opts(0, true, true, Some(one.clone()))),
            (
                "3 stripes",
                opts(1 << 20, true, true, Some(three[1].clone())),
            ),
            (
                "3 stripes, buffered",
                opts(0, false, false, Some(three[2].clone())),
            ),
        ] {
            assert!(
                logits(&m, &o) == reference,
                "{arch:?}: logits differ with {what}"
            );
        }
    }
}

#[test]
fn a_warm_cache_serves_repeats_without_reading() {
    let t = tiny(Arch::KimiK3, 12);
    let model = Model::load_with(&model_dir(&t), &opts(64 << 20, false, false, None)).unwrap();
    let stats = Stats::default();
    model
        .forward(&mut model.new_session(), &PROMPT, LogitRows::Last, &stats)
        .unwrap();
    let before = model.store().snapshot();
    model
        .forward(&mut model.new_session(), &PROMPT, LogitRows::Last, &stats)
        .unwrap();
    let d = model.store().snapshot().since(&before);
    assert_eq!(
        d.bytes_read(),
        0,
        "the same prompt again must be served from the cache"
    );
    assert_eq!(d.hits, d.requests);
}

#[test]
fn corrupted_pack_record_is_an_error_naming_layer_expert_and_file() {
    let t = tiny(Arch::KimiK3, 13);
    let m = model_dir(&t);
    let dir = t.path().join("pack");
    pack(&m, std::slice::from_ref(&dir));
    // Flip one byte in every record so whichever is routed first is caught.
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap();
    let file = dir.join("experts-0.bin");
    let mut bytes = std::fs::read(&file).unwrap();
    for r in manifest["records"].as_array().unwrap() {
        bytes[r["offset"].as_u64().unwrap() as usize + 7] ^= 0x40;
    }
    std::fs::write(&file, bytes).unwrap();
    let out = bin()
        .arg("run")
        .arg("--model")
        .arg(&m)
        .arg("--pack")
        .arg(&dir)
        .args(["--prompt-ids", "1,2", "--max-new", "2"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("checksum mismatch")
            && err.contains("expert")
            && err.contains("experts-0.bin"),
        "{err}"
    );
}

#[test]
fn missing_stripe_and_unfinished_pack_are_reported_at_startup() {
    let t = tiny(Arch::KimiK3, 14);
    let m = model_dir(&t);
    let stripes: Vec<PathBuf> = (0..2).map(|i| t.path().join(format!("s{i}"))).collect();
    pack(&m, &stripes);
    std::fs::rename(&stripes[1], t.path().join("moved")).unwrap();
    let err = Model::load_with(&m, &opts(0, false, false, Some(stripes[0].clone())))
        .err()
        .unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("stripe directory") && msg.contains("s1") && msg.contains("missing"),
        "{msg}"
    );

    std::fs::remove_file(stripes[0].join("manifest.json")).unwrap();
    let err = Model::load_with(&m, &opts(0, false, false, Some(stripes[0].clone())))
        .err()
        .unwrap();
    assert!(
        format!("{err:#}").contains("not a finished pack"),
        "{err:#}"
    );
}

#[test]
fn an_interrupted_pack_resumes_where_it_stopped() {
    let t = tiny(Arch::KimiK3, 15);
    let m = model_dir(&t);
    let whole = t.path().join("whole");
    pack(&m, std::slice::from_ref(&whole));
    let expected = std::fs::read(whole.join("experts-0.bin")).unwrap();
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(whole.join("manifest.json")).unwrap()).unwrap();

    // A crash part-way leaves the plan, a partial data file cut mid-record, and no manifest.
    let resumed = t.path().join("resumed");
    std::fs::create_dir_all(&resumed).unwrap();
    let plan = serde_json::json!({
        "model_identity": manifest["model_identity"], "record_len": manifest["record_len"],
        "stripes": [resumed.canonicalize().unwrap()], "weights": [1.0], "layout_version": manifest["layout_version"],
    });
    std::fs::write(resumed.join("plan.json"), plan.to_string()).unwrap();
    let mut partial = expected[..expected.len() / 2 + 1234].to_vec();
    // A marker in the kept part shows the resumed run did not rewrite it.
    partial[100] ^= 0xff;
    std::fs::write(resumed.join("experts-0.bin.partial"), &partial).unwrap();

    pack(&m, std::slice::from_ref(&resumed));
    let got = std::fs::read(resumed.join("experts-0.bin")).unwrap();
    assert_eq!(got.len(), expected.len());
    assert_eq!(
        got[100],
        expected[100] ^ 0xff,
        "records already written were kept, not rewritten"
    );
    assert_eq!(
        got[101..],
        expected[101..],
        "the rest was completed exactly"
    );
    assert!(resumed.join("manifest.json").exists() && !resumed.join("plan.json").exists());
}

#[test]
fn a_short_read_is_an_error_naming_layer_expert_and_file() {
    let t = tiny(Arch::KimiK3, 17);
    let m = model_dir(&t);
    let dir = t.path().join("pack");
    pack(&m, std::slice::from_ref(&dir));
    let model = Model::load_with(&m, &opts(0, false, false, Some(dir.clone()))).unwrap();
    // The drive loses the data after start-up (a pulled cable, a truncating process).
    std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("experts-0.bin"))
        .unwrap()
        .set_len(0)
        .unwrap();
    let err = model
        .forward(
            &mut model.new_session(),
            &PROMPT,
            LogitRows::Last,
            &Stats::default(),
        )
        .err()
        .unwrap();
    let msg = format!("{err:#}");
    assert!(
        msg.contains("expert") && msg.contains("layer") && msg.contains("experts-0.bin"),
        "{msg}"
    );
    assert!(msg.contains("short read"), "{msg}");
}
