//! Writes safetensors files: one `model.safetensors`, or shards `model-000NN-of-000MM.safetensors`
//! plus `model.safetensors.index.json`.
//!
//! We write the format ourselves rather than use the `safetensors` crate's serializer because that one
//! reorders tensors (by dtype alignment, then name); deltafin's layout needs the data in the order given,
//! so that one routed expert's six tensors form one contiguous span (one read per expert).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{bail, ensure, Context, Result};

use crate::Dtype;

pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// A tensor's name, dtype and shape: enough to lay out a file before its bytes exist.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: &[usize]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// One tensor with its little-endian, row-major bytes.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl Tensor {
    /// Fails if `data` does not hold exactly `shape`'s element count of `dtype`.
    pub fn new(
        name: impl Into<String>,
        dtype: Dtype,
        shape: &[usize],
        data: Vec<u8>,
    ) -> Result<Tensor> {
        let name = name.into();
        let expected = shape.iter().product::<usize>() * dtype.size();
        ensure!(
            data.len() == expected,
            "tensor {name}: {} bytes given, but {} {shape:?} needs {expected}",
            data.len(),
            dtype.name()
        );
        Ok(Tensor {
            name,
            dtype,
            shape: shape.to_vec(),
            data,
        })
    }

    pub fn spec(&self) -> TensorSpec {
        TensorSpec::new(self.name.clone(), self.dtype, &self.shape)
    }
}

/// How `ShardedWriter::finish` cuts the tensors into shards.
#[derive(Clone, Copy, Debug)]
pub enum ShardLimit {
    /// Each shard holds at most this many payload bytes (a single larger group gets a shard of its own).
    MaxBytes(u64),
    /// About equal shards, this many unless there are fewer groups than shards.
    Count(usize),
}

/// What `ShardedWriter::finish` wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedSummary {
    pub tensors: usize,
    pub payload_bytes: u64,
    pub shards: usize,
}

/// Collects tensor specs in order, then writes them as shards and an index, asking for each tensor's bytes
/// only when its turn comes (so a 10 GB checkpoint never sits in memory). A group of tensors added together
/// is never split across shards and stays contiguous in the order given.
pub struct ShardedWriter {
    dir: PathBuf,
    groups: Vec<Vec<TensorSpec>>,
}

impl ShardedWriter {
    pub fn new(dir: &Path) -> ShardedWriter {
        ShardedWriter {
            dir: dir.to_path_buf(),
            groups: Vec::new(),
        }
    }

    pub fn add(&mut self, tensor: TensorSpec) {
        self.groups.push(vec![tensor]);
    }

    /// Adds tensors that must end up adjacent, in this order, in one shard.
    pub fn add_group(&mut self, group: Vec<TensorSpec>) {
        if !group.is_empty() {
            self.groups.push(group);
        }
    }

    /// Writes the shards, then the index; `data` is called once per tensor, in the order added, for its bytes.
    /// Each file is written under a temporary name and renamed into place; an index left by an earlier run is
    /// removed first and the new one is written last, so an interrupted run never leaves an index that names a
    /// missing or partial shard.
    pub fn finish(
        self,
        limit: ShardLimit,
        mut data: impl FnMut(&TensorSpec) -> Result<Vec<u8>>,
    ) -> Result<ShardedSummary> {
        let mut seen = std::collections::HashSet::new();
        for tensor in self.groups.iter().flatten() {
            ensure!(
                seen.insert(tensor.name.as_str()),
                "tensor {} added twice",
                tensor.name
            );
        }
        ensure!(!self.groups.is_empty(), "no tensors to write");
        fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let index_path = self.dir.join(INDEX_FILE);
        match fs::remove_file(&index_path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(e).with_context(|| format!("removing stale {}", index_path.display()))
            }
            _ => {}
        }

        let shards = plan_shards(&self.groups, limit);
        let mut weight_map = BTreeMap::new();
        let mut payload_bytes = 0u64;
        let mut tensors = 0;
        let mut shard_names = Vec::with_capacity(shards.len());
        for (i, shard) in shards.iter().enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards.len());
            let members: Vec<&TensorSpec> = shard.iter().flat_map(|g| g.iter()).collect();
            write_safetensors(&self.dir.join(&file), &members, &mut data)?;
            for t in &members {
                weight_map.insert(t.name.clone(), serde_json::Value::from(file.clone()));
                payload_bytes += t.nbytes() as u64;
            }
            tensors += members.len();
            shard_names.push(file);
        }
        let index = serde_json::json!({
            "metadata": {"total_size": payload_bytes},
            "weight_map": weight_map,
        });
        let index = serde_json::to_string_pretty(&index)?;
        write_atomically_with(&index_path, |file| Ok(file.write_all(index.as_bytes())?))?;
        remove_stale_shards(&self.dir, &shard_names)?;
        Ok(ShardedSummary {
            tensors,
            payload_bytes,
            shards: shards.len(),
        })
    }
}

/// Writes one unsharded `model.safetensors`-style file, tensors in the order given.
pub fn write_single(path: &Path, tensors: &[Tensor]) -> Result<()> {
    let specs: Vec<TensorSpec> = tensors.iter().map(Tensor::spec).collect();
    let mut next = tensors.iter();
    write_safetensors(path, &specs.iter().collect::<Vec<_>>(), &mut |_| {
        Ok(next.next().expect("one call per tensor").data.clone())
    })
}

/// Assigns whole groups to shards, keeping their order.
fn plan_shards(groups: &[Vec<TensorSpec>], limit: ShardLimit) -> Vec<&[Vec<TensorSpec>]> {
    let sizes: Vec<u64> = groups
        .iter()
        .map(|g| g.iter().map(|t| t.nbytes() as u64).sum())
        .collect();
    let total: u64 = sizes.iter().sum();
    // The shard each group starts in; a new shard starts wherever this index changes.
    let mut shard_of = Vec::with_capacity(groups.len());
    match limit {
        ShardLimit::MaxBytes(max) => {
            let (mut shard, mut filled) = (0usize, 0u64);
            for &size in &sizes {
                if filled > 0 && filled + size > max {
                    shard += 1;
                    filled = 0;
                }
                filled += size;
                shard_of.push(shard);
            }
        }
        ShardLimit::Count(n) => {
            // A group goes to the shard its first byte falls in when the bytes are cut into n equal parts.
            let n = n.max(1) as u128;
            let mut start = 0u64;
            for &size in &sizes {
                shard_of.push((start as u128 * n / total.max(1) as u128) as usize);
                start += size;
            }
        }
    }
    let mut shards = Vec::new();
    let mut begin = 0;
    for i in 1..=groups.len() {
        if i == groups.len() || shard_of[i] != shard_of[begin] {
            shards.push(&groups[begin..i]);
            begin = i;
        }
    }
    shards
}

/// Writes one safetensors file: u64 header length, the JSON header (padded with spaces to a multiple
/// of 8 so the data starts aligned), then the tensors' data back to back in the order given.
fn write_safetensors(
    path: &Path,
    tensors: &[&TensorSpec],
    data: &mut dyn FnMut(&TensorSpec) -> Result<Vec<u8>>,
) -> Result<()> {
    let mut header = String::from(r#"{"__metadata__":{"format":"pt"}"#);
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.nbytes();
        header.push_str(&format!(
            r#",{}:{{"dtype":"{}","shape":{},"data_offsets":[{offset},{end}]}}"#,
            serde_json::Value::from(t.name.as_str()),
            t.dtype.name(),
            serde_json::Value::from(t.shape.clone()),
        ));
        offset = end;
    }
    header.push('}');
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    write_atomically_with(path, |file| {
        file.write_all(&(header.len() as u64).to_le_bytes())?;
        file.write_all(header.as_bytes())?;
        for t in tensors {
            let bytes = data(t)?;
            ensure!(
                bytes.len() == t.nbytes(),
                "tensor {}: {} bytes given, but {} {:?} needs {}",
                t.name,
                bytes.len(),
                t.dtype.name(),
                t.shape,
                t.nbytes()
            );
            file.write_all(&bytes)?;
        }
        Ok(())
    })
}

/// Writes through `write` into a hidden temporary file in the same directory (unique per process and call, so
/// concurrent writers never share one), syncs it and renames it over `path`, so `path` is either absent, the
/// old file, or the complete new one.
pub fn write_atomically_with(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<fs::File>) -> Result<()>,
) -> Result<()> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        bail!("{} is not a file path", path.display());
    };
    let tmp = dir.join(format!(
        ".{}.tmp.{}.{}",
        name.to_string_lossy(),
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| -> Result<()> {
        let mut file = BufWriter::new(fs::File::create(&tmp)?);
        write(&mut file)?;
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(fs::rename(&tmp, path)?)
    })();
    result
        .with_context(|| format!("writing {}", path.display()))
        .inspect_err(|_| {
            let _ = fs::remove_file(&tmp);
        })
}

/// Removes `model-*-of-*.safetensors` shards an earlier run with a different shard count left behind.
fn remove_stale_shards(dir: &Path, keep: &[String]) -> Result<()> {
    for entry in fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        let is_shard =
            name.starts_with("model-") && name.ends_with(".safetensors") && name.contains("-of-");
        if is_shard && !keep.contains(&name) {
            fs::remove_file(dir.join(&name))
                .with_context(|| format!("removing stale shard {name}"))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::SafeTensors;

    fn tensor(name: &str, dtype: Dtype, shape: &[usize], seed: u8) -> Tensor {
        let len = shape.iter().product::<usize>() * dtype.size();
        let data = (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect();
        Tensor::new(name, dtype, shape, data).unwrap()
    }

    fn expert(e: usize) -> Vec<Tensor> {
        ["w1", "w2", "w3"]
            .iter()
            .flat_map(|w| {
                [
                    tensor(
                        &format!("experts.{e}.{w}.weight_packed"),
                        Dtype::U8,
                        &[8, 16],
                        e as u8,
                    ),
                    tensor(
                        &format!("experts.{e}.{w}.weight_scale"),
                        Dtype::U8,
                        &[8, 1],
                        e as u8 + 1,
                    ),
                ]
            })
            .collect()
    }

    /// The data source `finish` asks: each tensor's bytes by name.
    fn bytes_of(all: &[Tensor]) -> impl FnMut(&TensorSpec) -> Result<Vec<u8>> + '_ {
        |s| Ok(all.iter().find(|t| t.name == s.name).unwrap().data.clone())
    }

    fn read(path: &Path) -> Vec<u8> {
        fs::read(path).unwrap()
    }

    /// Names in data order, checking the header is padded so the data is 8-byte aligned.
    fn names_in_order(bytes: &[u8]) -> Vec<String> {
        let (n, meta) = SafeTensors::read_metadata(bytes).unwrap();
        assert_eq!(n % 8, 0);
        assert_eq!(meta.metadata().as_ref().unwrap()["format"], "pt");
        meta.offset_keys()
    }

    #[test]
    fn single_file_round_trips_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let tensors = vec![
            tensor("z.weight", Dtype::Bf16, &[3, 5], 1),
            tensor("a.bias", Dtype::F32, &[7], 2),
            tensor("m.packed", Dtype::U8, &[2, 3, 1], 3),
        ];
        let path = dir.path().join("model.safetensors");
        write_single(&path, &tensors).unwrap();
        let bytes = read(&path);
        assert_eq!(names_in_order(&bytes), ["z.weight", "a.bias", "m.packed"]);
        let st = SafeTensors::deserialize(&bytes).unwrap();
        for (t, dtype) in tensors.iter().zip([
            safetensors::Dtype::BF16,
            safetensors::Dtype::F32,
            safetensors::Dtype::U8,
        ]) {
            let view = st.tensor(&t.name).unwrap();
            assert_eq!(view.dtype(), dtype);
            assert_eq!(view.shape(), t.shape.as_slice());
            assert_eq!(view.data(), t.data.as_slice());
        }
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "no temporary file left"
        );
    }

    #[test]
    fn shards_keep_groups_whole_and_contiguous() {
        let dir = tempfile::tempdir().unwrap();
        let mut writer = ShardedWriter::new(dir.path());
        let mut all = vec![tensor("embed", Dtype::Bf16, &[4, 16], 9)];
        writer.add(all[0].spec());
        for e in 0..5 {
            let group = expert(e);
            all.extend(group.iter().cloned());
            writer.add_group(group.iter().map(Tensor::spec).collect());
        }
        // One expert is 3 * (128 + 8) = 408 bytes, the embedding 128: a 500-byte limit puts each in a
        // shard of its own, so a greedy writer that split groups would show here.
        let summary = writer
            .finish(ShardLimit::MaxBytes(500), bytes_of(&all))
            .unwrap();
        assert_eq!(summary.tensors, all.len());
        assert_eq!(summary.shards, 6);
        assert_eq!(
            summary.payload_bytes,
            all.iter().map(|t| t.data.len() as u64).sum::<u64>()
        );

        let index: serde_json::Value =
            serde_json::from_slice(&read(&dir.path().join(INDEX_FILE))).unwrap();
        assert_eq!(index["metadata"]["total_size"], summary.payload_bytes);
        let weight_map = index["weight_map"].as_object().unwrap();
        assert_eq!(weight_map.len(), all.len());

        let mut order = Vec::new();
        for i in 1..=6 {
            let file = format!("model-{i:05}-of-00006.safetensors");
            let bytes = read(&dir.path().join(&file));
            let names = names_in_order(&bytes);
            let st = SafeTensors::deserialize(&bytes).unwrap();
            for name in &names {
                assert_eq!(weight_map[name], file.as_str());
                let t = all.iter().find(|t| &t.name == name).unwrap();
                let view = st.tensor(name).unwrap();
                assert_eq!(
                    (view.shape(), view.data()),
                    (t.shape.as_slice(), t.data.as_slice())
                );
            }
            if i > 1 {
                assert_eq!(
                    names,
                    expert(i - 2)
                        .iter()
                        .map(|t| t.name.clone())
                        .collect::<Vec<_>>()
                );
            }
            order.extend(names);
        }
        assert_eq!(
            order,
            all.iter().map(|t| t.name.clone()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn count_limit_gives_that_many_shards_and_rewrites_cleanly() {
        let dir = tempfile::tempdir().unwrap();
        let write = |count| {
            let mut writer = ShardedWriter::new(dir.path());
            let all: Vec<Tensor> = (0..9).flat_map(expert).collect();
            (0..9).for_each(|e| writer.add_group(expert(e).iter().map(Tensor::spec).collect()));
            writer
                .finish(ShardLimit::Count(count), bytes_of(&all))
                .unwrap()
        };
        assert_eq!(write(4).shards, 4);
        assert_eq!(write(3).shards, 3);
        let mut files: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        files.sort();
        let expected = [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_FILE,
        ];
        assert_eq!(
            files, expected,
            "the 4-shard files of the first run are gone"
        );
        for file in &expected[..3] {
            assert_eq!(
                names_in_order(&read(&dir.path().join(file))).len(),
                18,
                "3 experts per shard"
            );
        }
    }

    #[test]
    fn rejects_wrong_sizes_and_duplicates() {
        assert!(Tensor::new("x", Dtype::Bf16, &[2, 2], vec![0; 6]).is_err());
        let dir = tempfile::tempdir().unwrap();
        let mut writer = ShardedWriter::new(dir.path());
        writer.add(TensorSpec::new("x", Dtype::U8, &[1]));
        writer.add(TensorSpec::new("x", Dtype::U8, &[1]));
        assert!(writer
            .finish(ShardLimit::Count(1), |_| Ok(vec![0]))
            .is_err());
        assert!(!dir.path().join(INDEX_FILE).exists());
        // A data source that returns the wrong number of bytes fails the write; no index appears.
        let mut writer = ShardedWriter::new(dir.path());
        writer.add(TensorSpec::new("y", Dtype::Bf16, &[2]));
        let err = writer
            .finish(ShardLimit::Count(1), |_| Ok(vec![0; 3]))
            .unwrap_err();
        assert!(format!("{err:#}").contains("3 bytes given"), "{err:#}");
        assert!(!dir.path().join(INDEX_FILE).exists());
    }
}
