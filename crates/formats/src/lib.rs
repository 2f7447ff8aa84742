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
}

impl Dtype {
    /// The safetensors spelling ("BF16", "F32", "U8").
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::U8 => "U8",
        }
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::Bf16 => 2,
            Dtype::F32 => 4,
            Dtype::U8 => 1,
        }
    }

    pub fn from_name(name: &str) -> Option<Dtype> {
        match name {
            "BF16" => Some(Dtype::Bf16),
            "F32" => Some(Dtype::F32),
            "U8" => Some(Dtype::U8),
            _ => None,
        }
    }
}
