//! Raw copy bandwidths measured on the device in the same run as a benchmark: pinned host → device (the
//! ceiling of streaming experts) and device → device (the ceiling of everything-resident decoding).

use crate::gpu::{Doing, Gpu, Pinned};
use anyhow::Result;
use cudarc::driver::result as cu;

/// Median GB/s of `reps` copies of `bytes` from pinned host memory to the device, timed with events.
pub fn h2d_pinned(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
    let mut host = Pinned::new(gpu, bytes, true)?;
    host.as_mut_slice().fill(1);
    let dev = gpu.alloc(bytes)?;
    let s = &gpu.copy;
    let mut gbps = Vec::new();
    for _ in 0..reps + 1 {
        let (a, b) = (gpu.event()?, gpu.event()?);
        a.record(s).doing("measuring a copy bandwidth")?;
        // SAFETY: both buffers hold `bytes`.
        unsafe { cu::memcpy_htod_async(dev.ptr, host.as_slice(), s.cu_stream()) }
            .doing("measuring a copy bandwidth")?;
        b.record(s).doing("measuring a copy bandwidth")?;
        b.synchronize().doing("measuring a copy bandwidth")?;
        let ms = a.elapsed_ms(&b).doing("measuring a copy bandwidth")? as f64;
        gbps.push(bytes as f64 / (ms * 1e-3) / 1e9);
    }
    Ok(median(&mut gbps[1..].to_vec()))
}

/// Median GB/s of device-to-device copies of `bytes`, counting bytes read plus bytes written.
pub fn d2d(gpu: &Gpu, bytes: usize, reps: usize) -> Result<f64> {
    let (src, dst) = (gpu.alloc(bytes)?, gpu.alloc(bytes)?);
    let s = &gpu.stream;
    let mut gbps = Vec::new();
    for _ in 0..reps + 1 {
        let (a, b) = (gpu.event()?, gpu.event()?);
        a.record(s).doing("measuring a copy bandwidth")?;
        gpu.dtod(dst.ptr, src.ptr, bytes)?;
        b.record(s).doing("measuring a copy bandwidth")?;
        b.synchronize().doing("measuring a copy bandwidth")?;
        let ms = a.elapsed_ms(&b).doing("measuring a copy bandwidth")? as f64;
        gbps.push(2.0 * bytes as f64 / (ms * 1e-3) / 1e9);
    }
    Ok(median(&mut gbps[1..].to_vec()))
}

pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}
