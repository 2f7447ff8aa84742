//! What this machine is, asked of its operating system: the CPU's name and SIMD features (for `doctor`
//! and `bench`), and on macOS its memory (Linux reads /proc/meminfo in store_args.rs and doctor.rs).

/// The CPU's marketing name: /proc/cpuinfo's "model name" on Linux (x86; Arm kernels do not give one),
/// `machdep.cpu.brand_string` on macOS ("Apple M2 Max").
pub fn cpu_name() -> Option<String> {
    #[cfg(target_os = "macos")]
    {
        let bytes = sysctl("machdep.cpu.brand_string")?;
        let name = std::ffi::CStr::from_bytes_until_nul(&bytes).ok()?;
        Some(name.to_string_lossy().trim().to_string())
    }
    #[cfg(not(target_os = "macos"))]
    {
        let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
        let line = info.lines().find(|l| l.starts_with("model name"))?;
        Some(line.split_once(':')?.1.trim().to_string())
    }
}

/// The CPU features that matter to deltafin's kernels (in use or candidates), as detected at run time.
pub fn cpu_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! detect {
            ($($f:tt),*) => {$(if std::arch::is_x86_feature_detected!($f) { found.push($f); })*};
        }
        detect!("sse4.2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl");
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! detect {
            ($($f:tt),*) => {$(if std::arch::is_aarch64_feature_detected!($f) { found.push($f); })*};
        }
        detect!("neon", "fp16", "bf16", "dotprod", "i8mm", "sve", "sve2");
    }
    if found.is_empty() {
        found.push("none detected");
    }
    found
}

/// Physical memory and what the system could hand out without swapping, in bytes.
#[cfg(target_os = "macos")]
pub struct Memory {
    pub total: u64,
    pub available: Option<u64>,
}

/// macOS: `hw.memsize`, and from the Mach VM statistics the free and inactive pages (inactive pages are
/// reclaimed without swapping; `free_count` already includes the speculative ones).
#[cfg(target_os = "macos")]
pub fn memory() -> Option<Memory> {
    let total = u64::from_ne_bytes(sysctl("hw.memsize")?.try_into().ok()?);
    Some(Memory {
        total,
        available: vm_statistics()
            .map(|(free, inactive, page)| available_bytes(free, inactive, page)),
    })
}

/// Pages that can be handed out without swapping, in bytes.
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
fn available_bytes(free_pages: u32, inactive_pages: u32, page_size: u64) -> u64 {
    (u64::from(free_pages) + u64::from(inactive_pages)) * page_size
}

/// (free pages, inactive pages, page size) from `host_statistics64(HOST_VM_INFO64)`.
#[cfg(target_os = "macos")]
fn vm_statistics() -> Option<(u32, u32, u64)> {
    // SAFETY: plain integers; zero is a valid value for each.
    let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
    let mut count = libc::HOST_VM_INFO64_COUNT;
    // SAFETY: `stats` has room for `count` integers, the count the call is told; the host port is ours.
    // (`mach_host_self` is marked deprecated in libc in favour of the mach2 crate; the call is the same.)
    #[allow(deprecated)]
    let rc = unsafe {
        libc::host_statistics64(
            libc::mach_host_self(),
            libc::HOST_VM_INFO64,
            (&mut stats as *mut libc::vm_statistics64).cast(),
            &mut count,
        )
    };
    // SAFETY: no arguments; returns -1 on failure.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (rc == libc::KERN_SUCCESS && page > 0).then_some((
        stats.free_count,
        stats.inactive_count,
        page as u64,
    ))
}

/// The raw value of a sysctl, by name.
#[cfg(target_os = "macos")]
fn sysctl(name: &str) -> Option<Vec<u8>> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut len = 0usize;
    let null = std::ptr::null_mut();
    // SAFETY: a NUL-terminated name; with no buffer the call only reports the value's length.
    if unsafe { libc::sysctlbyname(name.as_ptr(), null, &mut len, null, 0) } != 0 {
        return None;
    }
    let mut value = vec![0u8; len];
    // SAFETY: `value` has room for `len` bytes, the length passed in.
    let rc =
        unsafe { libc::sysctlbyname(name.as_ptr(), value.as_mut_ptr().cast(), &mut len, null, 0) };
    (rc == 0).then(|| {
        value.truncate(len);
        value
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn available_memory_counts_free_and_inactive_pages() {
        // 16 KiB pages, as on Apple Silicon; counts past u32 products must not overflow.
        assert_eq!(available_bytes(1000, 500, 16384), 1500 * 16384);
        assert_eq!(
            available_bytes(u32::MAX, u32::MAX, 16384),
            2 * u64::from(u32::MAX) * 16384
        );
    }

    #[test]
    fn the_kernel_path_is_among_the_detected_features() {
        let features = cpu_features();
        let needed: &[&str] = match deltafin_kernels::isa() {
            "avx2+fma" => &["avx2", "fma"],
            "avx512" => &["avx512f", "avx2", "fma"],
            "neon" => &["neon"],
            _ => &[],
        };
        for f in needed {
            assert!(features.contains(f), "{f} missing from {features:?}");
        }
    }
}
