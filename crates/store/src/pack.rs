//! Expert packs: one contiguous, page-aligned record per expert (its tensors in checkpoint order), striped
//! across one directory per drive, described by a manifest with each record's place and checksum.
//!
//! Writing is resumable and never exposes a half-written pack: records go into `experts-N.bin.partial`,
//! `plan.json` fixes the assignment up front, and `manifest.json` — the only file the engine trusts — is
//! written last, atomically, into every stripe directory.

use crate::io::align_up;
#[cfg(test)]
use crate::io::ALIGN;
use crate::{Extent, RecordLoc};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub const MANIFEST: &str = "manifest.json";
const PLAN: &str = "plan.json";
pub const LAYOUT_VERSION: u32 = 1;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct Manifest {
    pub format: String,
    pub layout_version: u32,
    /// Identifies the checkpoint the records came from (hash of its config and index).
    pub model_identity: String,
    pub record_len: usize,
    /// Absolute stripe directories, in stripe order.
    pub stripes: Vec<PathBuf>,
    pub weights: Vec<f64>,
    pub records: Vec<PackedRecord>,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct PackedRecord {
    pub layer: usize,
    pub expert: usize,
    pub stripe: usize,
    pub offset: u64,
    /// xxh3-64 of the record's bytes, hex.
    pub checksum: String,
}

pub fn stripe_file(dir: &Path, stripe: usize) -> PathBuf {
    dir.join(format!("experts-{stripe}.bin"))
}

/// Assigns records to stripes so each stripe's share of bytes follows its weight (measured bandwidth), then
/// lays them out back to back at aligned offsets.
fn plan(n_records: usize, record_len: usize, weights: &[f64]) -> Vec<(usize, u64)> {
    let step = align_up(record_len as u64);
    let mut filled = vec![0u64; weights.len()];
    (0..n_records)
        .map(|_| {
            let s = (0..weights.len())
                .min_by(|&a, &b| {
                    ((filled[a] + step) as f64 / weights[a])
                        .total_cmp(&((filled[b] + step) as f64 / weights[b]))
                })
                .expect("at least one stripe");
            let at = filled[s];
            filled[s] += step;
            (s, at)
        })
        .collect()
}

/// Progress callback: (records done, records total).
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize);

/// Writes (or resumes writing) a pack of `layers[l][e]` records read from `sources`.
pub fn write_pack(
    sources: &[PathBuf],
    layers: &[Vec<RecordLoc>],
    record_len: usize,
    model_identity: &str,
    out_dirs: &[PathBuf],
    weights: &[f64],
    progress: Progress,
) -> Result<Manifest> {
    if out_dirs.is_empty() {
        bail!("give at least one --out directory");
    }
    if weights.len() != out_dirs.len() || weights.iter().any(|w| !(w.is_finite() && *w > 0.0)) {
        bail!("need one positive weight per --out directory, got {weights:?}");
    }
    let mut stripes = Vec::new();
    for d in out_dirs {
        std::fs::create_dir_all(d).with_context(|| format!("cannot create {}", d.display()))?;
        stripes.push(
            d.canonicalize()
                .with_context(|| format!("cannot resolve {}", d.display()))?,
        );
    }
    let keys: Vec<(usize, usize)> = layers
        .iter()
        .enumerate()
        .flat_map(|(l, r)| (0..r.len()).map(move |e| (l, e)))
        .collect();
    let placement = plan(keys.len(), record_len, weights);
    let plan_doc = serde_json::json!({
        "model_identity": model_identity, "record_len": record_len, "stripes": stripes, "weights": weights,
        "layout_version": LAYOUT_VERSION,
    });
    // A plan from an earlier run with other inputs cannot be resumed: start over.
    let plan_path = stripes[0].join(PLAN);
    let resumable = std::fs::read(&plan_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .is_some_and(|v| v == plan_doc);
    for d in &stripes {
        let _ = std::fs::remove_file(d.join(MANIFEST));
    }
    if !resumable {
        for (s, d) in stripes.iter().enumerate() {
            let _ = std::fs::remove_file(partial(&stripe_file(d, s)));
        }
        deltafin_formats::write_atomically(
            &plan_path,
            serde_json::to_vec_pretty(&plan_doc)?.as_slice(),
        )?;
    }

    let mut files: Vec<File> = stripes
        .iter()
        .enumerate()
        .map(|(s, d)| {
            let p = partial(&stripe_file(d, s));
            OpenOptions::new()
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&p)
                .with_context(|| format!("cannot open {}", p.display()))
        })
        .collect::<Result<_>>()?;
    // Records wholly present in a resumed file are kept; anything after the last whole record is rewritten.
    let step = align_up(record_len as u64);
    let mut present: Vec<u64> = Vec::new();
    for (s, f) in files.iter().enumerate() {
        let len = f
            .metadata()
            .with_context(|| format!("cannot read {}", stripe_file(&stripes[s], s).display()))?
            .len();
        present.push(len / step * step);
    }
    let source_paths = sources;
    let sources: Vec<File> = sources
        .iter()
        .map(|p| File::open(p).with_context(|| format!("cannot open {}", p.display())))
        .collect::<Result<_>>()?;
    let mut buf = vec![0u8; step as usize];
    let mut records = Vec::with_capacity(keys.len());
    for (i, (&(l, e), &(s, offset))) in keys.iter().zip(&placement).enumerate() {
        let rec = &layers[l][e];
        let mut at = 0;
        for x in &rec.extents {
            sources[x.file]
                .read_exact_at(&mut buf[at..at + x.len], x.offset)
                .with_context(|| {
                    format!(
                        "reading layer {l} expert {e} from {}",
                        source_paths[x.file].display()
                    )
                })?;
            at += x.len;
        }
        buf[record_len..].fill(0);
        let checksum = xxhash_rust::xxh3::xxh3_64(&buf[..record_len]);
        if offset + step > present[s] {
            files[s].write_all_at(&buf, offset).with_context(|| {
                format!(
                    "writing layer {l} expert {e} to {} at offset {offset}; the pack is resumable: free space there (or add an --out stripe) and run it again",
                    partial(&stripe_file(&stripes[s], s)).display()
                )
            })?;
        }
        records.push(PackedRecord {
            layer: l,
            expert: e,
            stripe: s,
            offset,
            checksum: format!("{checksum:016x}"),
        });
        progress(i + 1, keys.len());
    }
    for (s, f) in files.iter_mut().enumerate() {
        let p = stripe_file(&stripes[s], s);
        f.flush()
            .and_then(|_| f.sync_all())
            .and_then(|_| std::fs::rename(partial(&p), &p))
            .with_context(|| format!("finishing {}", p.display()))?;
    }
    let manifest = Manifest {
        format: "deltafin-pack".into(),
        layout_version: LAYOUT_VERSION,
        model_identity: model_identity.into(),
        record_len,
        stripes: stripes.clone(),
        weights: weights.to_vec(),
        records,
    };
    let bytes = serde_json::to_vec(&manifest)?;
    for d in &stripes {
        deltafin_formats::write_atomically(&d.join(MANIFEST), &bytes)?;
    }
    let _ = std::fs::remove_file(plan_path);
    Ok(manifest)
}

fn partial(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_owned();
    s.push(".partial");
    PathBuf::from(s)
}

/// Reads and checks a pack through any one of its stripe directories: the manifest must match the model, and
/// every stripe directory and file must be present with the length the manifest implies.
pub fn open_pack(dir: &Path, model_identity: &str) -> Result<Manifest> {
    let mpath = dir.join(MANIFEST);
    let bytes = std::fs::read(&mpath).with_context(|| {
        format!("{} has no {MANIFEST}: it is not a finished pack (an interrupted `deltafin pack` resumes when re-run)", dir.display())
    })?;
    let m = Manifest::parse(&bytes, &mpath.display().to_string())?;
    if m.model_identity != model_identity {
        bail!("the pack at {} was made from another checkpoint (identity {} ≠ {model_identity}); re-run `deltafin pack`", dir.display(), m.model_identity);
    }
    let step = align_up(m.record_len as u64);
    for (s, d) in m.stripes.iter().enumerate() {
        if !d.is_dir() {
            bail!(
                "stripe directory {} of the pack is missing (is its drive mounted?)",
                d.display()
            );
        }
        let f = stripe_file(d, s);
        let need = m
            .records
            .iter()
            .filter(|r| r.stripe == s)
            .map(|r| r.offset + step)
            .max()
            .unwrap_or(0);
        let have = std::fs::metadata(&f)
            .with_context(|| format!("stripe file {} is missing", f.display()))?
            .len();
        if have < need {
            bail!(
                "stripe file {} is {have} bytes, the manifest needs {need}; the pack is damaged",
                f.display()
            );
        }
    }
    Ok(m)
}

/// What [`crate::ExpertStore::new`] takes: the data files (path and drive), and each layer's records by
/// expert.
pub type StoreLayout = (Vec<(PathBuf, usize)>, Vec<Vec<RecordLoc>>);

impl Manifest {
    /// Parses a manifest's bytes and checks its format; `origin` names it in errors.
    pub fn parse(bytes: &[u8], origin: &str) -> Result<Manifest> {
        let m: Manifest = serde_json::from_slice(bytes)
            .with_context(|| format!("{origin} is not a valid pack manifest"))?;
        if m.format != "deltafin-pack" || m.layout_version != LAYOUT_VERSION {
            bail!(
                "{origin}: pack format {:?} version {} is not the {LAYOUT_VERSION} this deltafin reads; re-run `deltafin pack`",
                m.format,
                m.layout_version
            );
        }
        Ok(m)
    }

    /// The pack's files (stripe order) and records by layer, for [`crate::ExpertStore::new`].
    pub fn records(&self, n_layers: usize) -> Result<StoreLayout> {
        let files = self
            .stripes
            .iter()
            .enumerate()
            .map(|(s, d)| (stripe_file(d, s), s))
            .collect();
        let mut layers: Vec<Vec<Option<RecordLoc>>> = vec![Vec::new(); n_layers];
        for r in &self.records {
            let Some(layer) = layers.get_mut(r.layer) else {
                bail!(
                    "the pack has layer {} but the model has {n_layers} layers",
                    r.layer
                );
            };
            // Every layer holds every expert, so an expert number is below the count of records; checked
            // before it sizes the layer's list.
            if r.expert >= self.records.len() {
                bail!(
                    "the pack's record for layer {} names expert {}, but the pack holds only {} records; the manifest is damaged",
                    r.layer,
                    r.expert,
                    self.records.len()
                );
            }
            if layer.len() <= r.expert {
                layer.resize(r.expert + 1, None);
            }
            let checksum = u64::from_str_radix(&r.checksum, 16)
                .with_context(|| format!("bad checksum {:?} in the manifest", r.checksum))?;
            layer[r.expert] = Some(RecordLoc {
                extents: vec![Extent {
                    file: r.stripe,
                    offset: r.offset,
                    len: self.record_len,
                }],
                checksum: Some(checksum),
            });
        }
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(l, recs)| {
                recs.into_iter()
                    .enumerate()
                    .map(|(e, r)| {
                        r.with_context(|| {
                            format!("the pack has no record for layer {l} expert {e}")
                        })
                    })
                    .collect::<Result<Vec<_>>>()
            })
            .collect::<Result<_>>()?;
        Ok((files, layers))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An expert number used to size the layer's list unchecked, so a huge one aborted on allocation.
    #[test]
    fn a_huge_expert_number_is_refused_before_allocation() {
        let m = Manifest {
            format: "deltafin-pack".into(),
            layout_version: LAYOUT_VERSION,
            model_identity: "m".into(),
            record_len: 4096,
            stripes: vec!["/nonexistent".into()],
            weights: vec![1.0],
            records: vec![PackedRecord {
                layer: 0,
                expert: usize::MAX / 2,
                stripe: 0,
                offset: 0,
                checksum: "00".into(),
            }],
        };
        let e = format!("{:#}", m.records(1).unwrap_err());
        assert!(
            e.contains("names expert 9223372036854775807, but the pack holds only 1 records"),
            "{e}"
        );
    }

    #[test]
    fn plan_follows_weights_and_aligns() {
        let p = plan(8, 5000, &[1.0, 3.0]);
        let on = |s| p.iter().filter(|x| x.0 == s).count();
        assert_eq!((on(0), on(1)), (2, 6));
        assert!(p.iter().all(|x| x.1 % ALIGN as u64 == 0));
    }
}
