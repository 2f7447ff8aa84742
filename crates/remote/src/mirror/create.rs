//! Starting a mirror of a source: the small files (checked against the manifest when there is one), the
//! shard headers, and sparse shards of the right length, the marker written first.

use crate::http::Source;
use anyhow::{bail, Context, Result};
use deltafin_formats::checksums::{self, Checksums};
use deltafin_formats::mirror::{self as marker, MirrorState, RemoteFile};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Small files fetched whole when the server has them (config.json and the index are required).
const SMALL_FILES: &[&str] = &[
    "config.json",
    "model.safetensors.index.json",
    "generation_config.json",
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    checksums::FILE,
];
/// A safetensors header larger than this is not a header.
const MAX_HEADER: u64 = 256 << 20;

/// Starts a mirror of `source` in `dir` (or checks that `dir` already mirrors it): the small files, the shard
/// headers, sparse shards of the right length. The marker is written before any shard, so an interrupted
/// start never leaves something that looks like a complete checkpoint.
pub fn create(dir: &Path, source: &mut Source) -> Result<()> {
    let url = source.base().to_string();
    if let Some(s) = marker::read_state(dir)? {
        if s.url != url {
            bail!(
                "{} mirrors {}, not {}; choose another directory",
                dir.display(),
                s.url,
                source.base()
            );
        }
        return Ok(());
    }
    if dir.join("config.json").exists() {
        bail!(
            "{} already holds a checkpoint that is not a mirror; choose an empty directory",
            dir.display()
        );
    }
    // A failure here is reported by the GET of config.json below.
    let commit = source.head("config.json").ok().and_then(|i| i.commit);
    if let Some(c) = &commit {
        source.pin(c);
    }
    let mut small = Vec::new();
    for name in SMALL_FILES {
        if let Some(bytes) = source.get(name)? {
            small.push((*name, bytes));
        }
    }
    let get = |n: &str| small.iter().find(|(m, _)| *m == n).map(|(_, b)| b);
    if get("config.json").is_none() {
        bail!(
            "{} has no config.json; give the repository's base URL (the directory that holds config.json)",
            source.base()
        );
    }
    let sums = get(checksums::FILE)
        .map(|b| Checksums::parse(b, &source.url(checksums::FILE)))
        .transpose()?;
    for (name, bytes) in &small {
        if let Some(want) = sums.as_ref().and_then(|s| s.files.get(*name)) {
            let got = checksums::sha256_hex(bytes);
            if got != want.sha256 {
                bail!(
                    "{} does not match {}: SHA-256 {got}, expected {}",
                    source.url(name),
                    checksums::FILE,
                    want.sha256
                );
            }
        }
    }
    let shard_names: Vec<String> = match get("model.safetensors.index.json") {
        Some(index) => {
            let v: serde_json::Value = serde_json::from_slice(index).with_context(|| {
                format!(
                    "{} is not valid JSON",
                    source.url("model.safetensors.index.json")
                )
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .context("model.safetensors.index.json has no `weight_map` object")?;
            let mut names: Vec<String> = Vec::new();
            for shard in map.values() {
                let s = shard.as_str().unwrap_or("");
                if s.is_empty() || s.contains('/') || s.contains("..") {
                    bail!("model.safetensors.index.json names the shard {shard}, which is not a file name");
                }
                if !names.iter().any(|n| n == s) {
                    names.push(s.to_string());
                }
            }
            names.sort();
            names
        }
        None => vec!["model.safetensors".to_string()],
    };
    let mut shards = Vec::new();
    for name in &shard_names {
        let info = source.head(name)?;
        let stated = sums.as_ref().and_then(|s| s.files.get(name));
        if let Some(s) = stated {
            if s.size != info.size {
                bail!(
                    "{} is {} bytes on the server but {} says {}",
                    source.url(name),
                    info.size,
                    checksums::FILE,
                    s.size
                );
            }
        }
        shards.push(RemoteFile {
            name: name.clone(),
            size: info.size,
            sha256: stated.map(|s| s.sha256.clone()).or(info.sha256),
            etag: info.etag,
        });
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    source.require_etags(
        shards
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.etag.clone()?))),
    );
    let state = MirrorState {
        url: url.clone(),
        commit,
        shards,
        checksums: sums.is_some(),
        complete: false,
    };
    marker::write_state(dir, &state)?;
    for (name, bytes) in &small {
        deltafin_formats::write_atomically(&dir.join(name), bytes)?;
    }
    for s in &state.shards {
        let (head, header) = match sums.as_ref().and_then(|c| c.headers.get(&s.name)) {
            // The manifest states the header: one verified range.
            Some(h) => {
                if h.len < 8 || h.len > s.size {
                    bail!(
                        "{} states a {}-byte header for the {}-byte {}",
                        checksums::FILE,
                        h.len,
                        s.size,
                        s.name
                    );
                }
                let check = |b: &[u8]| {
                    let got = checksums::xxh3_hex(b);
                    if got == h.xxh3 {
                        Ok(())
                    } else {
                        Err(format!(
                            "corrupted header: xxh3 {got}, {} says {}",
                            checksums::FILE,
                            h.xxh3
                        ))
                    }
                };
                let mut all = source.range(&s.name, 0, h.len, s.size, &check)?;
                let header = all.split_off(8);
                (all, header)
            }
            None => {
                let head = source.range(&s.name, 0, 8, s.size, &|_| Ok(()))?;
                if deltafin_formats::checkpoint::LFS_POINTER.starts_with(&head) {
                    bail!(
                        "{} is a Git LFS pointer, not the weights; give the repository's download URL (on Hugging Face: https://huggingface.co/ORG/NAME, which resolves files)",
                        source.url(&s.name)
                    );
                }
                let hlen = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
                if hlen > MAX_HEADER || 8 + hlen > s.size {
                    bail!(
                        "{} starts with a header length of {hlen} bytes, impossible for a {}-byte safetensors file",
                        source.url(&s.name),
                        s.size
                    );
                }
                (head, source.range(&s.name, 8, hlen, s.size, &|_| Ok(()))?)
            }
        };
        let path = dir.join(&s.name);
        let f = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        f.set_len(s.size)?;
        f.write_all_at(&head, 0)?;
        f.write_all_at(&header, 8)?;
        f.sync_all()?;
    }
    Ok(())
}
