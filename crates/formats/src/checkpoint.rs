//! A Hugging Face checkpoint directory: `model.safetensors.index.json` + shards, or one `model.safetensors`.
//!
//! Opening reads only the shard headers (through a memory map, so no payload page is touched); tensor bytes
//! are read later with positioned reads, which is what lets routed experts stay on disk until routed.

use crate::Dtype;
use anyhow::{bail, Context, Result};
use safetensors::tensor::{Metadata, SafeTensorError};
use safetensors::SafeTensors;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Where one tensor lives.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub shard: usize,
    /// Absolute byte offset of the payload in the shard file.
    pub offset: u64,
    pub nbytes: u64,
}

pub struct Shard {
    pub path: PathBuf,
    pub file: File,
}

pub struct Checkpoint {
    pub dir: PathBuf,
    pub shards: Vec<Shard>,
    tensors: HashMap<String, TensorInfo>,
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (shard_names, weight_map) = if index_path.exists() {
            let bytes = std::fs::read(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let index = parse_index(&bytes, &index_path.display().to_string())?;
            (index.shards, Some(index.weight_map))
        } else if single.exists() {
            (vec!["model.safetensors".to_string()], None)
        } else {
            bail!(
                "{} holds neither model.safetensors.index.json nor model.safetensors; point --model at a Hugging Face checkpoint directory",
                dir.display()
            );
        };

        let mut shards = Vec::new();
        let mut tensors = HashMap::new();
        for (shard_idx, name) in shard_names.iter().enumerate() {
            let path = dir.join(name);
            let file = File::open(&path).with_context(|| {
                format!("cannot open shard {} (listed in the index)", path.display())
            })?;
            for info in read_header(&path, &file, shard_idx)? {
                if let Some(map) = &weight_map {
                    match map.get(&info.name) {
                        Some(listed) if listed == name => {}
                        Some(listed) => bail!(
                            "tensor `{}` is in {} but the index says {listed}",
                            info.name,
                            path.display()
                        ),
                        // Shards may carry tensors the index omits (e.g. a vision tower); keep them reachable.
                        None => {}
                    }
                }
                if let Some(prev) = tensors.insert(info.name.clone(), info) {
                    bail!(
                        "tensor `{}` appears in two shards ({} and {})",
                        prev.name,
                        shard_names[prev.shard],
                        name
                    );
                }
            }
            shards.push(Shard { path, file });
        }
        if let Some(map) = &weight_map {
            for (tensor, shard) in map {
                if !tensors.contains_key(tensor) {
                    bail!(
                        "the index maps `{tensor}` to {shard}, but that shard has no such tensor"
                    );
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    /// Every tensor of the checkpoint, in no particular order.
    pub fn tensors(&self) -> impl Iterator<Item = &TensorInfo> {
        self.tensors.values()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .get(name)
            .with_context(|| format!("checkpoint {} has no tensor `{name}`", self.dir.display()))
    }

    /// Looks a tensor up and checks its dtype (one of `dtypes`) and shape.
    pub fn expect(&self, name: &str, dtypes: &[Dtype], shape: &[usize]) -> Result<&TensorInfo> {
        let info = self.info(name)?;
        if !dtypes.contains(&info.dtype) {
            let want: Vec<_> = dtypes.iter().map(|d| d.name()).collect();
            bail!(
                "tensor `{name}` in {} has dtype {}, expected {}",
                self.shards[info.shard].path.display(),
                info.dtype.name(),
                want.join(" or ")
            );
        }
        if info.shape != shape {
            bail!(
                "tensor `{name}` in {} has shape {:?}, expected {:?}",
                self.shards[info.shard].path.display(),
                info.shape,
                shape
            );
        }
        Ok(info)
    }

    /// Reads a whole tensor's bytes.
    pub fn read(&self, info: &TensorInfo) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; info.nbytes as usize];
        self.read_at(info.shard, info.offset, &mut buf)
            .with_context(|| format!("reading tensor `{}`", info.name))?;
        Ok(buf)
    }

    /// Positioned read of `buf.len()` bytes at `offset` of shard `shard`.
    pub fn read_at(&self, shard: usize, offset: u64, buf: &mut [u8]) -> Result<()> {
        let s = &self.shards[shard];
        s.file.read_exact_at(buf, offset).with_context(|| {
            format!(
                "short read or I/O error: {} bytes at offset {offset} of {}",
                buf.len(),
                s.path.display()
            )
        })
    }
}

/// `model.safetensors.index.json`: which shard holds each tensor.
pub struct Index {
    /// The distinct shard file names, sorted.
    pub shards: Vec<String>,
    /// Tensor name → shard file name.
    pub weight_map: HashMap<String, String>,
}

/// Parses an index file's bytes; `origin` names it in errors.
pub fn parse_index(bytes: &[u8], origin: &str) -> Result<Index> {
    let v: serde_json::Value =
        serde_json::from_slice(bytes).with_context(|| format!("{origin} is not valid JSON"))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{origin}: missing object field `weight_map`"))?;
    let mut shards: Vec<String> = Vec::new();
    let mut weight_map = HashMap::new();
    for (tensor, shard) in map {
        let shard = shard
            .as_str()
            .with_context(|| format!("{origin}: `weight_map.{tensor}` must be a file name"))?;
        if shard.is_empty() || shard.contains('/') || shard.contains("..") {
            bail!("{origin}: `weight_map.{tensor}` names {shard:?}, which is not a file in the model directory");
        }
        if !shards.iter().any(|n| n == shard) {
            shards.push(shard.to_string());
        }
        weight_map.insert(tensor.clone(), shard.to_string());
    }
    shards.sort();
    Ok(Index { shards, weight_map })
}

/// How a Git LFS pointer file starts: what a clone without LFS leaves where the weights should be.
pub const LFS_POINTER: &[u8] = b"version https://git-lfs.github.com/spec/v1";

fn read_header(path: &Path, file: &File, shard: usize) -> Result<Vec<TensorInfo>> {
    // SAFETY: the map is read-only and only the header pages are touched; a concurrent truncation by another
    // process is outside what any reader can defend against and would fault, not corrupt.
    let map = unsafe { memmap2::Mmap::map(file) }
        .with_context(|| format!("cannot map {}", path.display()))?;
    parse_header(path, &map, shard)
}

/// The tensors a whole safetensors file's bytes describe (`path` names it in errors); they are numbered as
/// shard `shard`.
pub fn parse_header(path: &Path, map: &[u8], shard: usize) -> Result<Vec<TensorInfo>> {
    if map.starts_with(LFS_POINTER) {
        bail!(
            "{} is a Git LFS pointer, not the weights (the repository was cloned without LFS); run `git lfs pull` there, or mirror the repository with `deltafin fetch --from URL`",
            path.display()
        );
    }
    let (header_len, metadata) = match SafeTensors::read_metadata(map) {
        Ok(ok) => ok,
        Err(SafeTensorError::MetadataIncompleteBuffer) => bail!(
            "{} is truncated or has trailing bytes: its header describes {} bytes of tensor data but the file holds {} after the header; re-download or re-create it",
            path.display(),
            described_data_len(map).unwrap_or(0),
            map.len().saturating_sub(header_len_of(map).unwrap_or(0).saturating_add(8))
        ),
        Err(e) => bail!("{} is not a valid safetensors file: {e}", path.display()),
    };
    let data_start = 8 + header_len as u64;
    tensor_infos(path, &metadata, shard, data_start)
}

fn tensor_infos(
    path: &Path,
    metadata: &Metadata,
    shard: usize,
    data_start: u64,
) -> Result<Vec<TensorInfo>> {
    let mut out = Vec::new();
    for (name, info) in metadata.tensors() {
        let dtype_name = format!("{:?}", info.dtype);
        let dtype = Dtype::from_name(&dtype_name).with_context(|| {
            format!(
                "tensor `{name}` in {} has dtype {dtype_name}; deltafin reads BF16, F32, U8, F8_E4M3, I32 and I64",
                path.display()
            )
        })?;
        let (begin, end) = info.data_offsets;
        out.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape: info.shape.clone(),
            shard,
            offset: data_start + begin as u64,
            nbytes: (end - begin) as u64,
        });
    }
    Ok(out)
}

fn header_len_of(map: &[u8]) -> Option<usize> {
    Some(u64::from_le_bytes(map.get(..8)?.try_into().ok()?) as usize)
}

/// The data length a (valid-JSON) header claims, for the truncation message.
fn described_data_len(map: &[u8]) -> Option<u64> {
    let n = header_len_of(map)?;
    let header: serde_json::Value = serde_json::from_slice(map.get(8..n.checked_add(8)?)?).ok()?;
    header
        .as_object()?
        .values()
        .filter_map(|t| t.get("data_offsets")?.get(1)?.as_u64())
        .max()
}
