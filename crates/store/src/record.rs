//! Where a checkpoint keeps its routed experts, and how one expert's bytes are laid out: checkpoint-layout
//! knowledge that the store, packing, remote mirrors and every backend share (none of them computes with it).

use crate::{Extent, RecordLoc};
use anyhow::{bail, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig};
use deltafin_formats::Dtype;
use std::path::{Path, PathBuf};

/// How a family stores an expert's three matrices.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Encoding {
    /// K3: w1/w2/w3 each as `weight_packed` + `weight_scale` (MXFP4, e8m0 per 32 inputs).
    Mxfp4,
    /// Kimi Linear: w1/w2/w3 `.weight` in BF16.
    Bf16,
    /// gpt-oss: `gate_up_proj` (gate and up rows interleaved) and `down_proj`, each `*_blocks` (MXFP4) +
    /// `*_scales` (E8M0 per 32 inputs) + `*_bias` (BF16). All experts of a layer share one tensor each.
    Mxfp4Biased,
}

/// The tensor-name prefix of a family's layers.
pub fn layer_prefix(family: Family) -> &'static str {
    match family {
        Family::KimiK3 => "language_model.model.",
        Family::KimiLinear | Family::GptOss => "model.",
    }
}

/// Whether a tensor belongs to a routed expert (read when routed) rather than the spine.
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// One expert record: its tensors in checkpoint order (w1, w2, w3; packed then scale for MXFP4), each at a
/// fixed offset, so a record read in one piece is computed in place.
#[derive(Debug)]
pub struct ExpertRecord {
    pub encoding: Encoding,
    /// Input/output width (K3: the latent; Kimi Linear: hidden) and intermediate width.
    pub width: usize,
    pub inter: usize,
    tensors: Vec<(String, Dtype, Vec<usize>)>,
    /// (offset, length) of each tensor inside the record.
    parts: Vec<(usize, usize)>,
}

impl ExpertRecord {
    pub fn new(cfg: &ModelConfig) -> Result<ExpertRecord> {
        let inter = cfg.moe.intermediate;
        let (encoding, width) = match cfg.family {
            Family::KimiK3 => (Encoding::Mxfp4, cfg.moe.latent.unwrap_or(cfg.hidden)),
            Family::KimiLinear => (Encoding::Bf16, cfg.hidden),
            Family::GptOss => (Encoding::Mxfp4Biased, cfg.hidden),
        };
        if !width.is_multiple_of(32) || !inter.is_multiple_of(32) {
            bail!(
                "expert widths {width} and {inter} must be multiples of 32 (the MXFP4 group size)"
            );
        }
        let shapes = [
            ("w1", inter, width),
            ("w2", width, inter),
            ("w3", inter, width),
        ];
        let tensors: Vec<(String, Dtype, Vec<usize>)> = match encoding {
            Encoding::Mxfp4 => shapes
                .iter()
                .flat_map(|&(w, rows, cols)| {
                    [
                        (
                            format!("{w}.weight_packed"),
                            Dtype::U8,
                            vec![rows, cols / 2],
                        ),
                        (
                            format!("{w}.weight_scale"),
                            Dtype::U8,
                            vec![rows, cols / 32],
                        ),
                    ]
                })
                .collect(),
            Encoding::Bf16 => shapes
                .iter()
                .map(|&(w, rows, cols)| (format!("{w}.weight"), Dtype::Bf16, vec![rows, cols]))
                .collect(),
            Encoding::Mxfp4Biased => [
                ("gate_up_proj", 2 * inter, width),
                ("down_proj", width, inter),
            ]
            .iter()
            .flat_map(|&(w, rows, cols)| {
                [
                    (format!("{w}_blocks"), Dtype::U8, vec![rows, cols / 32, 16]),
                    (format!("{w}_scales"), Dtype::U8, vec![rows, cols / 32]),
                    (format!("{w}_bias"), Dtype::Bf16, vec![rows]),
                ]
            })
            .collect(),
        };
        let mut parts = Vec::new();
        let mut at = 0;
        for (_, dtype, shape) in &tensors {
            let len = shape.iter().product::<usize>() * dtype.size();
            parts.push((at, len));
            at += len;
        }
        Ok(ExpertRecord {
            encoding,
            width,
            inter,
            tensors,
            parts,
        })
    }

    /// Bytes of one record.
    pub fn len(&self) -> usize {
        self.parts.iter().map(|p| p.1).sum()
    }

    /// Whether a record holds no bytes (never, for a valid config).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// (offset, length) of the record's `i`-th tensor: MXFP4 w1 packed, w1 scales, w2 packed, w2 scales, w3
    /// packed, w3 scales; BF16 w1, w2, w3; MXFP4 with biases gate_up blocks, scales, bias, then down's.
    pub fn part(&self, i: usize) -> (usize, usize) {
        self.parts[i]
    }

    /// Where every expert of every MoE layer lives in the checkpoint (empty lists for dense layers), checking
    /// each tensor's dtype and shape. Consecutive tensors merge into one extent: one read per K3 expert. Where
    /// a layer keeps all its experts in one tensor each (gpt-oss: `[E, …]`), expert e is the e-th slice of each.
    pub fn locate(&self, ck: &Checkpoint, cfg: &ModelConfig) -> Result<Vec<Vec<RecordLoc>>> {
        let prefix = layer_prefix(cfg.family);
        (0..cfg.num_layers)
            .map(|l| {
                if cfg.is_dense(l) {
                    return Ok(Vec::new());
                }
                (0..cfg.moe.num_experts)
                    .map(|e| {
                        let mut extents: Vec<Extent> = Vec::new();
                        for ((name, dtype, shape), &(_, len)) in
                            self.tensors.iter().zip(&self.parts)
                        {
                            let (file, offset) = if self.encoding == Encoding::Mxfp4Biased {
                                let full = format!("{prefix}layers.{l}.mlp.experts.{name}");
                                let stacked: Vec<usize> = [cfg.moe.num_experts]
                                    .into_iter()
                                    .chain(shape.clone())
                                    .collect();
                                let info = ck.expect(&full, &[*dtype], &stacked)?;
                                (info.shard, info.offset + (e * len) as u64)
                            } else {
                                let full = format!(
                                    "{prefix}layers.{l}.block_sparse_moe.experts.{e}.{name}"
                                );
                                let info = ck.expect(&full, &[*dtype], shape)?;
                                (info.shard, info.offset)
                            };
                            match extents.last_mut() {
                                Some(x) if x.file == file && x.offset + x.len as u64 == offset => {
                                    x.len += len
                                }
                                _ => extents.push(Extent { file, offset, len }),
                            }
                        }
                        Ok(RecordLoc {
                            extents,
                            checksum: None,
                        })
                    })
                    .collect()
            })
            .collect()
    }
}

/// The routed experts of the checkpoint in `dir`: its shard files, every expert's place in them, and the
/// record length (for packing and for remote mirrors).
pub type ExpertSources = (Vec<PathBuf>, Vec<Vec<RecordLoc>>, usize);

/// Where the routed experts of the checkpoint in `dir` are.
pub fn expert_sources(dir: &Path) -> Result<ExpertSources> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    let record = ExpertRecord::new(&cfg)?;
    let layers = record.locate(&ck, &cfg)?;
    Ok((
        ck.shards.iter().map(|s| s.path.clone()).collect(),
        layers,
        record.len(),
    ))
}
