//! Where a checkpoint keeps its routed experts, and how one expert's bytes are laid out: checkpoint-layout
//! knowledge that the store, packing, remote mirrors and every backend share (none of them computes with it).

use crate::{Extent, RecordLoc};
use anyhow::{bail, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::config::{Family, ModelConfig, Quant};
use deltafin_formats::Dtype;
use std::path::{Path, PathBuf};

/// How a family stores an expert's three matrices.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Encoding {
    /// K3: w1/w2/w3 each as `weight_packed` + `weight_scale` (MXFP4, e8m0 per 32 inputs).
    Mxfp4,
    /// Kimi Linear, BF16 DeepSeek-V3: `.weight` in BF16.
    Bf16,
    /// gpt-oss: MXFP4 `_blocks` (E2M1 pairs) + `_scales` (E8M0 per 32 inputs) + BF16 `_bias`; a layer keeps
    /// each tensor of all its experts in one `[E, …]` tensor.
    Mxfp4Biased,
    /// DeepSeek-V3 FP8: e4m3 `.weight` and F32 `.weight_scale_inv` per 128×128 block.
    Fp8Block,
    /// K2 Thinking: compressed-tensors `.weight_packed` (I32, 8 values a word) and BF16 `.weight_scale` per 32.
    Int4Group,
}

impl Encoding {
    /// The tensors of one `[rows, cols]` matrix: (name suffix, dtype, shape), weights first, then scales, then
    /// the bias ([`Encoding::BIAS`]) where the encoding has one.
    fn tensors(self, rows: usize, cols: usize) -> Vec<(&'static str, Dtype, Vec<usize>)> {
        match self {
            Encoding::Mxfp4 => vec![
                (".weight_packed", Dtype::U8, vec![rows, cols / 2]),
                (".weight_scale", Dtype::U8, vec![rows, cols / 32]),
            ],
            Encoding::Mxfp4Biased => vec![
                ("_blocks", Dtype::U8, vec![rows, cols / 32, 16]),
                ("_scales", Dtype::U8, vec![rows, cols / 32]),
                ("_bias", Dtype::Bf16, vec![rows]),
            ],
            Encoding::Bf16 => vec![(".weight", Dtype::Bf16, vec![rows, cols])],
            Encoding::Fp8Block => vec![
                (".weight", Dtype::F8E4M3, vec![rows, cols]),
                (
                    ".weight_scale_inv",
                    Dtype::F32,
                    vec![rows.div_ceil(128), cols.div_ceil(128)],
                ),
            ],
            Encoding::Int4Group => vec![
                (".weight_packed", Dtype::I32, vec![rows, cols / 8]),
                (".weight_scale", Dtype::Bf16, vec![rows, cols / 32]),
            ],
        }
    }

    /// Which of a matrix's tensors is its bias (only MXFP4 with biases has one).
    pub const BIAS: usize = 2;

    /// Whether a layer stores each tensor once for all its experts (`[E, …]`), expert e being the e-th slice.
    fn stacked(self) -> bool {
        self == Encoding::Mxfp4Biased
    }
}

/// An expert's matrices: `y = down · act(gate x, up x)`; gpt-oss fuses gate and up into one matrix whose
/// rows alternate gate (2j) and up (2j + 1).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Role {
    Gate,
    Up,
    Down,
    GateUp,
}

/// The tensor-name prefix of a family's layers.
pub fn layer_prefix(family: Family) -> &'static str {
    match family {
        Family::KimiK3 => "language_model.model.",
        Family::KimiLinear | Family::DeepseekV3 | Family::GptOss | Family::Qwen3Moe => "model.",
    }
}

/// The MoE block's name inside a layer (`{layer_prefix}layers.{l}.{moe_prefix}gate.weight`, ...).
pub fn moe_prefix(family: Family) -> &'static str {
    match family {
        Family::KimiK3 | Family::KimiLinear => "block_sparse_moe.",
        Family::DeepseekV3 | Family::GptOss | Family::Qwen3Moe => "mlp.",
    }
}

/// A routed expert matrix's name (K3 and Kimi Linear: w1/w3/w2; DeepSeek, gpt-oss: gate/up/gate_up/down_proj).
fn role_name(family: Family, role: Role) -> &'static str {
    match (family, role) {
        (Family::KimiK3 | Family::KimiLinear, Role::Gate) => "w1",
        (Family::KimiK3 | Family::KimiLinear, Role::Up) => "w3",
        (Family::KimiK3 | Family::KimiLinear, Role::Down) => "w2",
        (_, Role::Gate) => "gate_proj",
        (_, Role::Up) => "up_proj",
        (_, Role::Down) => "down_proj",
        (_, Role::GateUp) => "gate_up_proj",
    }
}

/// Whether a tensor belongs to a routed expert (read when routed) rather than the spine.
pub fn is_routed_expert(name: &str) -> bool {
    name.contains(".experts.")
}

/// One expert record: its tensors in checkpoint order, each at a fixed offset, so a record read in one piece
/// is computed in place. K3 / Kimi Linear: w1, w2, w3 (packed then scale for MXFP4); DeepSeek-V3 and
/// Qwen3-MoE as their released shards order them: weights (down, gate, up), then scales in the same order;
/// gpt-oss: gate_up's blocks, scales and bias, then down's.
#[derive(Debug)]
pub struct ExpertRecord {
    pub encoding: Encoding,
    /// Input/output width (K3: the latent; Kimi Linear: hidden) and intermediate width.
    pub width: usize,
    pub inter: usize,
    /// The expert's matrices: (role, rows, cols).
    pub matrices: Vec<(Role, usize, usize)>,
    tensors: Vec<(String, Dtype, Vec<usize>)>,
    /// Each tensor's matrix and its index among that matrix's tensors ([`Encoding::tensors`]).
    roles: Vec<(Role, usize)>,
    /// (offset, length) of each tensor inside the record.
    parts: Vec<(usize, usize)>,
}

impl ExpertRecord {
    pub fn new(cfg: &ModelConfig) -> Result<ExpertRecord> {
        let inter = cfg.moe.intermediate;
        let (encoding, width) = match (cfg.family, cfg.quant) {
            (Family::KimiK3, _) => (Encoding::Mxfp4, cfg.moe.latent.unwrap_or(cfg.hidden)),
            (Family::GptOss, _) => (Encoding::Mxfp4Biased, cfg.hidden),
            (_, Quant::Fp8Block) => (Encoding::Fp8Block, cfg.hidden),
            (_, Quant::Int4Experts) => (Encoding::Int4Group, cfg.hidden),
            (_, Quant::None) => (Encoding::Bf16, cfg.hidden),
        };
        let grouped = matches!(
            encoding,
            Encoding::Mxfp4 | Encoding::Mxfp4Biased | Encoding::Int4Group
        );
        if grouped && (!width.is_multiple_of(32) || !inter.is_multiple_of(32)) {
            bail!(
                "expert widths {width} and {inter} must be multiples of 32 (the {encoding:?} group size)"
            );
        }
        let family = cfg.family;
        let mut matrices = if family == Family::GptOss {
            vec![(Role::GateUp, 2 * inter, width), (Role::Down, width, inter)]
        } else {
            vec![
                (Role::Gate, inter, width),
                (Role::Down, width, inter),
                (Role::Up, inter, width),
            ]
        };
        // The released shards of these families list tensors by name: down, gate, up.
        let by_name = matches!(family, Family::DeepseekV3 | Family::Qwen3Moe);
        if by_name {
            matrices.sort_by_key(|m| role_name(family, m.0));
        }
        let mut tensors = Vec::new();
        let mut roles = Vec::new();
        for &(role, rows, cols) in &matrices {
            for (k, (suffix, dtype, shape)) in encoding.tensors(rows, cols).into_iter().enumerate()
            {
                tensors.push((format!("{}{suffix}", role_name(family, role)), dtype, shape));
                roles.push((role, k));
            }
        }
        if by_name {
            // Weights first, then scales (a stable sort keeps the matrices' order).
            let mut order: Vec<usize> = (0..tensors.len()).collect();
            order.sort_by_key(|&i| roles[i].1);
            tensors = order.iter().map(|&i| tensors[i].clone()).collect();
            roles = order.iter().map(|&i| roles[i]).collect();
        }
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
            matrices,
            tensors,
            roles,
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

    /// (offset, length) of tensor `k` of matrix `role` ([`Encoding`]: weights, then scales, then bias).
    pub fn tensor(&self, role: Role, k: usize) -> (usize, usize) {
        let i = self.roles.iter().position(|&r| r == (role, k));
        self.parts[i.expect("every encoding has the tensors it lists")]
    }

    /// Where every expert of every MoE layer lives in the checkpoint (empty lists for dense layers), checking
    /// each tensor's dtype and shape. Consecutive tensors merge into one extent: one read per K3 expert. Where
    /// a layer keeps all its experts in one tensor each (gpt-oss: `[E, …]`), expert e is the e-th slice of each.
    pub fn locate(&self, ck: &Checkpoint, cfg: &ModelConfig) -> Result<Vec<Vec<RecordLoc>>> {
        let (prefix, moe) = (layer_prefix(cfg.family), moe_prefix(cfg.family));
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
                            let (file, offset) = if self.encoding.stacked() {
                                let full = format!("{prefix}layers.{l}.{moe}experts.{name}");
                                let stacked: Vec<usize> = [cfg.moe.num_experts]
                                    .into_iter()
                                    .chain(shape.clone())
                                    .collect();
                                let info = ck.expect(&full, &[*dtype], &stacked)?;
                                (info.shard, info.offset + (e * len) as u64)
                            } else {
                                let full = format!("{prefix}layers.{l}.{moe}experts.{e}.{name}");
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
