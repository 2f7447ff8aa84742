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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<Rope> {
        parse(v.as_object().unwrap())
    }

    #[test]
    fn reads_transformers_fields_and_defaults() {
        // DeepSeek-V3's form: `type`, mscale fields, truncate left to its default.
        let r = read(
            json!({"rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40,
            "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707}}),
        )
        .unwrap();
        let y = r.yarn.unwrap();
        assert_eq!(
            (r.theta, y.factor, y.beta_fast, y.beta_slow),
            (10000.0, 40.0, 32.0, 1.0)
        );
        assert_eq!(
            (y.mscale, y.mscale_all_dim, y.truncate),
            (Some(1.0), Some(0.707), true)
        );
        // transformers 5's `rope_parameters`, theta inside it; "default" is plain RoPE.
        let r =
            read(json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})).unwrap();
        assert_eq!((r.theta, r.yarn), (5e5, None));
        assert_eq!(read(json!({"rope_theta": 1e4})).unwrap().yarn, None);
    }

    #[test]
    fn refuses_what_it_does_not_implement_by_name() {
        let e = |v: Value| format!("{:#}", read(v).unwrap_err());
        let yarn = |extra: (&str, Value)| {
            let mut s =
                json!({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 64});
            s[extra.0] = extra.1;
            json!({"rope_theta": 1e4, "rope_scaling": s})
        };
        assert!(e(yarn(("attention_factor", json!(1.5))))
            .contains("`rope_scaling.attention_factor` is set"));
        assert!(e(yarn(("factor", json!(0.5)))).contains("factor 0.5"));
        assert!(e(yarn(("beta_fast", json!(-1)))).contains("`rope_scaling.beta_fast` is -1"));
        assert!(e(yarn(("truncate", json!("no"))))
            .contains("`rope_scaling.truncate` must be true or false"));
        assert!(e(yarn(("rope_type", json!("dynamic"))))
            .contains("`rope_scaling.rope_type` is \"dynamic\""));
        assert!(e(json!({"rope_theta": 0.5})).contains("`rope_theta` is 0.5"));
        assert!(e(json!({})).contains("missing field `rope_theta`"));
    }
}
