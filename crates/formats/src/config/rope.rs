//! `rope_theta` with `rope_scaling` (transformers 5: `rope_parameters`) → [`Rope`]: one reading for every
//! family with rotary embeddings, as transformers' `_compute_yarn_parameters` reads it.

use super::*;

/// Rotary position embedding: the base and, optionally, YaRN context extension.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub theta: f64,
    /// `rope_scaling` of type yarn; `None`: plain RoPE.
    pub yarn: Option<Yarn>,
}

/// `rope_scaling` of type yarn.
#[derive(Clone, Debug, PartialEq)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position: usize,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// With `mscale_all_dim`, the attention factor is `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`;
    /// without either, `mscale(factor, 1)`.
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    /// Whether the correction range is floored/ceiled (transformers' default: true; gpt-oss: false).
    pub truncate: bool,
}

pub(super) fn parse(root: &Map<String, Value>) -> Result<Rope> {
    let scaling = ["rope_scaling", "rope_parameters"]
        .iter()
        .find(|f| root.get(**f).is_some_and(|v| !v.is_null()))
        .map(|f| obj_field(root, f).map(|o| (*f, o)))
        .transpose()?;
    let theta_in = |o: &Map<String, Value>| -> Result<Option<f64>> {
        o.get("rope_theta")
            .map(|v| {
                v.as_f64()
                    .with_context(|| format!("field `rope_theta` must be a number, found {v}"))
            })
            .transpose()
    };
    let theta = match (theta_in(root)?, scaling) {
        (Some(t), _) => t,
        (None, Some((_, o))) => theta_in(o)?.context("missing field `rope_theta`")?,
        (None, None) => bail!("missing field `rope_theta`"),
    };
    if !(theta.is_finite() && theta > 1.0) {
        bail!("field `rope_theta` is {theta}; it must be a finite number above 1");
    }
    let Some((field, s)) = scaling else {
        return Ok(Rope { theta, yarn: None });
    };
    let (key, kind) = match ["rope_type", "type"]
        .iter()
        .find_map(|k| s.get(*k).map(|v| (*k, v)))
    {
        Some((k, v)) => (k, v.as_str().unwrap_or_default()),
        None => ("rope_type", "default"),
    };
    match kind {
        "default" => return Ok(Rope { theta, yarn: None }),
        "yarn" => {}
        other => {
            bail!("field `{field}.{key}` is {other:?}; deltafin implements \"yarn\" (and none)")
        }
    }
    if s.get("attention_factor").is_some_and(|v| !v.is_null()) {
        bail!("field `{field}.attention_factor` is set; deltafin derives the attention factor from `factor`, `mscale` and `mscale_all_dim` only");
    }
    let opt = |f: &str| -> Result<Option<f64>> {
        match s.get(f) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .with_context(|| format!("field `{field}.{f}` must be a number, found {v}")),
        }
    };
    let positive = |f: &str, default: Option<f64>| -> Result<f64> {
        match (opt(f)?, default) {
            (Some(x), _) if x > 0.0 => Ok(x),
            (Some(x), _) => bail!("field `{field}.{f}` is {x}; it must be positive"),
            (None, Some(d)) => Ok(d),
            (None, None) => bail!("missing field `{field}.{f}`"),
        }
    };
    let truncate = match s.get("truncate") {
        None | Some(Value::Null) => true,
        Some(v) => v.as_bool().with_context(|| {
            format!("field `{field}.truncate` must be true or false, found {v}")
        })?,
    };
    let yarn = Yarn {
        factor: positive("factor", None)?,
        original_max_position: bounded(s, "original_max_position_embeddings", MAX_DIM << 4)?,
        beta_fast: positive("beta_fast", Some(32.0))?,
        beta_slow: positive("beta_slow", Some(1.0))?,
        mscale: opt("mscale")?,
        mscale_all_dim: opt("mscale_all_dim")?,
        truncate,
    };
    if yarn.factor < 1.0 || yarn.original_max_position == 0 {
        bail!(
            "field `{field}` has factor {} and original_max_position_embeddings {}; YaRN needs factor ≥ 1 and a positive length",
            yarn.factor,
            yarn.original_max_position
        );
    }
    Ok(Rope {
        theta,
        yarn: Some(yarn),
    })
}
