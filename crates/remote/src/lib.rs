//! Remote checkpoints: a Hugging Face-style repository (or any HTTP server with range requests) mirrored into
//! a local directory — small files and the spine up front, each routed expert on first use — verified against
//! the repository's `deltafin.checksums.json` when it publishes one.

pub mod http;
pub mod journal;
pub mod mirror;

pub use http::{HttpOptions, Source};
pub use mirror::{Mirror, MirrorOptions};

use anyhow::{bail, Context, Result};
use std::path::Path;

/// Opens the mirror in `dir`, starting it from `source` when `dir` is new and downloading whatever is missing
/// of the spine; `progress(done, total)` follows the spine download in bytes.
pub fn open_mirror(
    dir: &Path,
    source: Option<Source>,
    opts: MirrorOptions,
    progress: &(dyn Fn(u64, u64) + Sync),
) -> Result<Mirror> {
    let mut source = source;
    if let Some(s) = &mut source {
        mirror::create(dir, s)?;
    }
    let m = Mirror::open(dir, source, opts)?;
    if m.spine_status().is_none() {
        let (todo, total) = m.spine_todo();
        let done = std::sync::atomic::AtomicU64::new(total - todo);
        progress(total - todo, total);
        m.fetch_spine(&|n| {
            let d = done.fetch_add(n, std::sync::atomic::Ordering::Relaxed) + n;
            progress(d, total);
        })
        .with_context(|| format!("fetching the spine into {}", dir.display()))?;
    }
    Ok(m)
}

/// "1-3,5" → [1, 2, 3, 5].
pub fn parse_layers(s: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .with_context(|| format!("--layers {s:?}: {t:?} is not a layer number"))
        };
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (num(a)?, num(b)?);
                if a > b {
                    bail!("--layers {s:?}: the range {part} runs backwards");
                }
                out.extend(a..=b);
            }
            None => out.push(num(part)?),
        }
    }
    if out.is_empty() {
        bail!("--layers {s:?} names no layer; use e.g. 1-3,5");
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_lists_parse() {
        assert_eq!(parse_layers("1-3,5").unwrap(), vec![1, 2, 3, 5]);
        assert_eq!(parse_layers("7, 2,2").unwrap(), vec![2, 7]);
        assert!(parse_layers("3-1").is_err());
        assert!(parse_layers("a").is_err());
        assert!(parse_layers("").is_err());
    }
}
