//! The marker of a checkpoint directory that mirrors a remote repository: its shards hold the header and the
//! spine, and routed experts arrive on first use. Everything that reads shards directly (loading without the
//! remote source, packing) must refuse such a directory until it is complete, since a missing expert reads
//! as zeros.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const STATE_DIR: &str = ".deltafin-mirror";
const STATE_FILE: &str = "mirror.json";

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct RemoteFile {
    pub name: String,
    pub size: u64,
    /// SHA-256 of the whole file as the server or the checksum manifest states it (lower-case hex).
    pub sha256: Option<String>,
    /// The file's strong ETag when the mirror started: every range request requires it (`If-Match`).
    #[serde(default)]
    pub etag: Option<String>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct MirrorState {
    pub url: String,
    /// The Hugging Face commit every file is read at, when the server named one.
    #[serde(default)]
    pub commit: Option<String>,
    /// The shards, in the order the checkpoint opens them.
    pub shards: Vec<RemoteFile>,
    /// The server published `deltafin.checksums.json`, so every range can be verified.
    pub checksums: bool,
    /// Every byte of every shard is local and verified as far as checksums allow: an ordinary checkpoint.
    pub complete: bool,
}

pub fn state_path(dir: &Path) -> PathBuf {
    dir.join(STATE_DIR).join(STATE_FILE)
}

pub fn read_state(dir: &Path) -> Result<Option<MirrorState>> {
    let path = state_path(dir);
    match std::fs::read(&path) {
        Ok(bytes) => parse_state(&bytes)
            .with_context(|| {
                format!(
                    "{} is damaged; delete {} and fetch again",
                    path.display(),
                    dir.display()
                )
            })
            .map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// Parses the bytes of a mirror's `mirror.json`.
pub fn parse_state(bytes: &[u8]) -> Result<MirrorState> {
    Ok(serde_json::from_slice(bytes)?)
}

pub fn write_state(dir: &Path, state: &MirrorState) -> Result<()> {
    let state_dir = dir.join(STATE_DIR);
    std::fs::create_dir_all(&state_dir)
        .with_context(|| format!("cannot create {}", state_dir.display()))?;
    crate::write_atomically(&state_path(dir), &serde_json::to_vec_pretty(state)?)
}

/// Errors when `dir` is a mirror whose experts are not all local: `what` ("packing", …) needs every byte.
pub fn require_complete(dir: &Path, what: &str) -> Result<()> {
    if let Some(s) = read_state(dir)? {
        if !s.complete {
            anyhow::bail!(
                "{} is a partial mirror of {} (routed experts arrive on first use), so {what} would read experts that are not there; fetch them all first with `deltafin fetch --from {} --out {}`",
                dir.display(),
                s.url,
                s.url,
                dir.display()
            );
        }
    }
    Ok(())
}
