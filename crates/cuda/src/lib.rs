//! `deltafin-cuda`: the CPU path's math on an NVIDIA GPU.
//!
//! - The CUDA driver and NVRTC are loaded at run time (cudarc, dynamic loading): the same binary runs on
//!   machines without CUDA, and [`availability`] says why the GPU cannot be used there.
//! - Kernels are CUDA C (`kernels.cu`) compiled by NVRTC for the GPU in hand. Dot products follow the CPU
//!   kernels' 32-lane order (32 accumulators per output, held by one thread, four or a warp), except the
//!   routed MXFP4 experts, rearranged in VRAM into a layout and order of their own for speed (within 1e-4 of
//!   the CPU); every order is fixed per row, so a row's result never depends on its batch.
//! - Memory is one hierarchy: the spine resident in VRAM (layers beyond `--spine-vram` copied in one layer
//!   ahead of compute from page-locked host memory); routed experts in a VRAM slot cache with a budget
//!   (filled at load when it holds them all), else filled from the CPU-side [`deltafin_store::ExpertStore`]
//!   (RAM cache ← disk), copied straight from its page-locked slab on their own stream while resident experts
//!   compute.

mod devptr;
pub mod gpu;
mod kernels;
mod launch;
mod model;
pub mod plan;
pub mod probe;
pub mod timeline;

pub use gpu::availability;
pub use model::{CudaCounters, CudaModel, CudaOptions, CudaSession, Source};

use anyhow::{bail, Result};

/// Where a model runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::str::FromStr for Device {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Device::Cuda(n)),
                _ => bail!("unknown device {s:?}: use cpu, cuda or cuda:N"),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!("cuda:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert!("gpu".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
