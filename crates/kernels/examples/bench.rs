//! Weight bandwidth of `matmul` on a ROWS x COLS matrix (4096 x 4096 unless given) in each encoding (BF16,
//! MXFP4, FP8 with 128x128 block scales, INT4 with group-32 scales): GB/s of stored weight bytes (scales
//! included) per product, for n = 1 (decode), n = 3 (a check of two guesses), n = 16 and n = 64 (prefill),
//! on one thread and on the whole rayon pool.
//!
//! `cargo run -p deltafin-kernels --release --example bench [-- --isa scalar|avx2+fma|avx512|neon]
//! [--rows N] [--cols N]` (the default isa: the best this CPU has; more rows put the matrix beyond the
//! caches; COLS a multiple of 128, so that every encoding can hold it)

use deltafin_kernels::{codec::f32_to_bf16, isa, matmul, set_isa, Matrix, FP8_BLOCK};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::{Duration, Instant};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    if let Err(e) = set_isa(value("--isa").map(String::as_str)) {
        eprintln!("{e}");
        std::process::exit(2);
    }
    let number = |flag: &str, multiple: usize| -> usize {
        match value(flag).map_or(Ok(4096), |v| v.parse::<usize>()) {
            Ok(v) if v > 0 && v % multiple == 0 => v,
            _ => {
                let what = match multiple {
                    1 => "a positive number".to_string(),
                    m => format!("a positive multiple of {m}"),
                };
                eprintln!(
                    "{flag} takes {what}, not {:?}",
                    value(flag).map_or("", String::as_str)
                );
                std::process::exit(2);
            }
        }
    };
    let (rows, cols) = (number("--rows", 1), number("--cols", FP8_BLOCK));
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let bf16: Vec<u16> = (0..rows * cols)
        .map(|_| f32_to_bf16(rng.gen_range(-1.0..1.0)))
        .collect();
    let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|_| rng.gen_range(120..130))
        .collect();
    // Every e4m3 byte but the NaNs (0x7f, 0xff).
    let fp8: Vec<u8> = (0..rows * cols)
        .map(|_| rng.gen_range(0..0x7F) | (rng.gen::<u8>() & 0x80))
        .collect();
    let scale_inv: Vec<f32> = (0..(rows.div_ceil(FP8_BLOCK)) * (cols / FP8_BLOCK))
        .map(|_| rng.gen_range(1e-4..1e-2))
        .collect();
    let int4: Vec<u8> = (0..rows * cols / 2).map(|_| rng.gen()).collect();
    let int4_scales: Vec<u16> = (0..rows * cols / 32)
        .map(|_| f32_to_bf16(rng.gen_range(1e-3..1e-1)))
        .collect();
    let matrices = [
        (
            "bf16",
            Matrix::bf16(&bf16, rows, cols).unwrap(),
            bf16.len() * 2,
        ),
        (
            "mxfp4",
            Matrix::mxfp4(&packed, &scales, rows, cols).unwrap(),
            packed.len() + scales.len(),
        ),
        (
            "fp8",
            Matrix::fp8_block(&fp8, &scale_inv, rows, cols).unwrap(),
            fp8.len() + scale_inv.len() * 4,
        ),
        (
            "int4",
            Matrix::int4_group(&int4, &int4_scales, rows, cols).unwrap(),
            int4.len() + int4_scales.len() * 2,
        ),
    ];
    let all = rayon::current_num_threads();
    println!("isa {}, {rows}x{cols}, median of timed runs", isa());
    for threads in [1, all] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        for (name, w, bytes) in &matrices {
            for n in [1, 3, 16, 64] {
                let x: Vec<f32> = (0..n * cols).map(|_| rng.gen_range(-1.0..1.0)).collect();
                let mut y = vec![0.0; n * rows];
                let time = pool.install(|| median_time(|| matmul(w, &x, n, &mut y)));
                let gbs = *bytes as f64 / time.as_secs_f64() / 1e9;
                let gflops = 2.0 * (rows * cols * n) as f64 / time.as_secs_f64() / 1e9;
                println!(
                    "{name:5} n={n:2} threads={threads}: {:8.3} ms  {gbs:6.2} GB/s weights  {gflops:6.1} GFLOP/s",
                    time.as_secs_f64() * 1e3
                );
            }
        }
    }
}

/// Median of repeated runs after a warm-up, running for about half a second.
fn median_time(mut f: impl FnMut()) -> Duration {
    f();
    let mut times = Vec::new();
    let start = Instant::now();
    while times.len() < 5 || (start.elapsed() < Duration::from_millis(500) && times.len() < 200) {
        let t = Instant::now();
        f();
        times.push(t.elapsed());
    }
    times.sort();
    times[times.len() / 2]
}
