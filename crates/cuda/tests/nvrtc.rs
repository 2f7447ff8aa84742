//! Without a GPU: every kernel compiles through NVRTC (test.sh installs the library from PyPI), and asking
//! for CUDA where there is no driver fails with a message that says why.

use deltafin_cuda::gpu::{compile, KERNEL_NAMES};
use std::sync::OnceLock;

/// The kernels' PTX for `arch` ("compute_80" or "compute_90"), compiled once for all the tests.
fn ptx(arch: &'static str) -> &'static str {
    static PTX: [OnceLock<String>; 2] = [OnceLock::new(), OnceLock::new()];
    let slot = match arch {
        "compute_80" => &PTX[0],
        "compute_90" => &PTX[1],
        _ => unreachable!("the tests compile for compute_80 and compute_90"),
    };
    slot.get_or_init(|| {
        // SAFETY: only tries to dlopen the library.
        assert!(
            unsafe { cudarc::nvrtc::sys::is_culib_present() },
            "libnvrtc.so.13 (or .12) is not on the library path: run ./test.sh, which installs it from PyPI \
             (nvidia-cuda-nvrtc) and adds it to LD_LIBRARY_PATH"
        );
        compile(Some(arch), false)
            .unwrap_or_else(|e| panic!("{arch}: {e:#}"))
            .to_src()
    })
}

#[test]
fn every_kernel_compiles_through_nvrtc() {
    for arch in ["compute_80", "compute_90"] {
        let text = ptx(arch);
        for k in KERNEL_NAMES {
            assert!(
                text.contains(&format!(".entry {k}(")),
                "{arch}: kernel {k} missing from the PTX"
            );
        }
        // --fmad=false: no multiply-add is contracted behind the code's back (explicit fmaf() stays fma).
        assert!(
            text.contains("fma.rn.f32"),
            "{arch}: the explicit fmas are gone"
        );
    }
}

/// `run --timeline` compiles the kernels with DELTAFIN_TIMELINE: each block notes the time it is past its wait in
/// the `timeline` buffer the host reads (timeline.rs), which only that build has.
#[test]
fn the_timeline_build_compiles_with_its_notes() {
    let with = compile(Some("compute_90"), true)
        .unwrap_or_else(|e| panic!("{e:#}"))
        .to_src();
    for symbol in [
        " timeline[",
        " timeline_n",
        "%globaltimer",
        ".entry timeline_mark(",
    ] {
        assert!(with.contains(symbol), "the timeline build lacks {symbol:?}");
    }
    assert!(
        !ptx("compute_90").contains("%globaltimer"),
        "the plain build notes times"
    );
}

/// On sm_90 and later the compute stream's kernels are programmatic dependent launches: one that never waited
/// (`griddepcontrol.wait`) could run ahead of the kernel before it and read its inputs half written. Every
/// kernel but those of the prep stream (never launched as dependents) must wait; on sm_80 the waits compile away.
#[test]
fn every_dependent_kernel_waits_for_the_one_before() {
    const PREP_STREAM: &[&str] = &["mx_repack"];
    let entries = |arch| {
        let text = ptx(arch);
        KERNEL_NAMES
            .iter()
            .map(|k| {
                let start = text
                    .find(&format!(".entry {k}("))
                    .unwrap_or_else(|| panic!("{arch}: kernel {k} missing"));
                let body = &text[start..];
                let end = body[1..].find(".entry ").map_or(body.len(), |e| e + 1);
                (*k, body[..end].contains("griddepcontrol.wait"))
            })
            .collect::<Vec<_>>()
    };
    for (k, waits) in entries("compute_90") {
        assert_eq!(
            waits,
            !PREP_STREAM.contains(&k),
            "compute_90: kernel {k} {} griddepcontrol.wait",
            if waits { "has" } else { "lacks" }
        );
    }
    for (k, waits) in entries("compute_80") {
        assert!(
            !waits,
            "compute_80: kernel {k} uses griddepcontrol (sm_90 only)"
        );
    }
}

#[test]
fn without_a_driver_cuda_is_refused_with_the_reason() {
    // SAFETY: only tries to dlopen the library.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        // A machine with the driver: then it either works or names what is missing.
        if let Err(e) = deltafin_cuda::availability() {
            assert!(e.to_string().starts_with("CUDA is unavailable"), "{e}");
        }
        return;
    }
    let e = deltafin_cuda::availability().unwrap_err().to_string();
    assert!(
        e.contains("NVIDIA driver library (libcuda.so.1) was not found"),
        "{e}"
    );
}
