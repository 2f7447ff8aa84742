//! Checkpoint formats: `config.json`, safetensors shards and their index, `.npy` output.
//! Knows nothing of the engine: it turns files into typed, validated views and says exactly what is wrong.

pub mod checkpoint;
pub mod checksums;
pub mod config;
pub mod mirror;
pub mod npy;
pub mod writer;

pub use writer::write_atomically_with;

/// Writes `bytes` to `path` so that `path` is either absent, the old file, or the complete new one.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    write_atomically_with(path, |f| Ok(f.write_all(bytes)?))
}

/// Element types deltafin reads from checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bf16,
    F32,
    U8,
    /// FP8 e4m3 (DeepSeek-V3's released weights).
    F8E4M3,
    /// compressed-tensors' packed INT4 words and their `weight_shape`.
    I32,
    I64,
}

impl Dtype {
    const ALL: [(Dtype, &'static str, usize); 6] = [
        (Dtype::Bf16, "BF16", 2),
        (Dtype::F32, "F32", 4),
        (Dtype::U8, "U8", 1),
        (Dtype::F8E4M3, "F8_E4M3", 1),
        (Dtype::I32, "I32", 4),
        (Dtype::I64, "I64", 8),
    ];

    /// The safetensors spelling ("BF16", "F32", "U8", "F8_E4M3", ...).
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|d| d.0 == self).map_or("", |d| d.1)
    }

    pub fn size(self) -> usize {
        Self::ALL.iter().find(|d| d.0 == self).map_or(0, |d| d.2)
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        Self::ALL.iter().find(|d| d.1 == name).map(|d| d.0)
    }
}
