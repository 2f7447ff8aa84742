//! Every target in one binary (one instrumented link instead of one per target): DELTAFIN_FUZZ_TARGET picks
//! which one libFuzzer drives.
#![no_main]

use std::sync::OnceLock;

fn chosen() -> &'static deltafin_fuzz::Target {
    static TARGET: OnceLock<&'static deltafin_fuzz::Target> = OnceLock::new();
    TARGET.get_or_init(|| {
        let name = std::env::var("DELTAFIN_FUZZ_TARGET").unwrap_or_default();
        deltafin_fuzz::target(&name).unwrap_or_else(|| {
            let names: Vec<_> = deltafin_fuzz::TARGETS.iter().map(|t| t.name).collect();
            eprintln!("set DELTAFIN_FUZZ_TARGET to one of: {}", names.join(" "));
            std::process::exit(2)
        })
    })
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| (chosen().run)(data));
