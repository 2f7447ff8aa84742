//! Without a GPU: every kernel compiles through NVRTC (test.sh installs the library from PyPI), and asking
//! for CUDA where there is no driver fails with a message that says why.

use deltafin_cuda::gpu::{compile, KERNEL_NAMES};

#[test]
fn every_kernel_compiles_through_nvrtc() {
    // SAFETY: only tries to dlopen the library.
    assert!(
        unsafe { cudarc::nvrtc::sys::is_culib_present() },
        "libnvrtc.so.13 (or .12) is not on the library path: run ./test.sh, which installs it from PyPI \
         (nvidia-cuda-nvrtc) and adds it to LD_LIBRARY_PATH"
    );
    for arch in ["compute_80", "compute_90"] {
        let ptx = compile(Some(arch)).unwrap_or_else(|e| panic!("{arch}: {e:#}"));
        let text = ptx.to_src();
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
