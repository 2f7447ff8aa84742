//! `deltafin.checksums.json`: what a published checkpoint's bytes must be — each file's size and SHA-256, and
//! each tensor's xxh3-64. A client that fetches ranges (one expert, one spine tensor) verifies exactly what it
//! fetched against the tensors' hashes; a whole file against its SHA-256.

use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

pub const FILE: &str = "deltafin.checksums.json";
const FORMAT: &str = "deltafin-checksums";
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct FileSum {
    pub size: u64,
    /// Lower-case hex.
    pub sha256: String,
}

/// A safetensors shard's header: its first `len` bytes (the 8-byte length and the JSON).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct HeaderSum {
    pub len: u64,
    pub xxh3: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Checksums {
    pub format: String,
    pub version: u32,
    /// Every file of the checkpoint directory except this one.
    pub files: BTreeMap<String, FileSum>,
    /// Each shard's header, which a range client fetches before it knows any tensor.
    pub headers: BTreeMap<String, HeaderSum>,
    /// xxh3-64 of each tensor's payload bytes, lower-case hex.
    pub tensors: BTreeMap<String, String>,
}

impl Checksums {
    /// Hashes every file and tensor of the checkpoint in `dir`.
    pub fn compute(dir: &Path) -> Result<Checksums> {
        let ck = Checkpoint::open(dir)?;
        let mut tensors = BTreeMap::new();
        for info in ck.tensors() {
            let bytes = ck.read(info)?;
            tensors.insert(info.name.clone(), xxh3_hex(&bytes));
        }
        let mut headers = BTreeMap::new();
        for shard in &ck.shards {
            let mut len = [0u8; 8];
            ck_read(&shard.file, &mut len, 0, &shard.path)?;
            let mut head = vec![0u8; 8 + u64::from_le_bytes(len) as usize];
            ck_read(&shard.file, &mut head, 0, &shard.path)?;
            let name = shard.path.file_name().unwrap_or_default();
            headers.insert(
                name.to_string_lossy().into_owned(),
                HeaderSum {
                    len: head.len() as u64,
                    xxh3: xxh3_hex(&head),
                },
            );
        }
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name == FILE || name.starts_with('.') || !entry.file_type()?.is_file() {
                continue;
            }
            files.insert(name, file_sum(&entry.path())?);
        }
        Ok(Checksums {
            format: FORMAT.into(),
            version: VERSION,
            files,
            headers,
            tensors,
        })
    }

    pub fn parse(bytes: &[u8], origin: &str) -> Result<Checksums> {
        let c: Checksums = serde_json::from_slice(bytes)
            .with_context(|| format!("{origin} is not a valid {FILE}"))?;
        if c.format != FORMAT || c.version != VERSION {
            bail!(
                "{origin}: format {:?} version {}, expected {FORMAT:?} version {VERSION}",
                c.format,
                c.version
            );
        }
        Ok(c)
    }

    /// Writes `dir/deltafin.checksums.json` atomically.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let text = serde_json::to_vec_pretty(self)?;
        crate::write_atomically(&dir.join(FILE), &text)
    }
}

fn ck_read(f: &std::fs::File, buf: &mut [u8], at: u64, path: &Path) -> Result<()> {
    use std::os::unix::fs::FileExt;
    f.read_exact_at(buf, at)
        .with_context(|| format!("reading the header of {}", path.display()))
}

pub fn xxh3_hex(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Size and SHA-256 of a file, streamed.
pub fn file_sum(path: &Path) -> Result<FileSum> {
    let mut f =
        std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 4 << 20];
    let mut size = 0u64;
    loop {
        let n = f
            .read(&mut buf)
            .with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(FileSum {
        size,
        sha256: hex(&hasher.finalize()),
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
