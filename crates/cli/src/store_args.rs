//! Flags that choose where routed experts are read from and how (shared by every command that loads a model).

use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_models::LoadOptions;
use deltafin_remote::{HttpOptions, MirrorOptions, Source};
use deltafin_store::policy::Policy;
use deltafin_store::StoreOptions;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

#[derive(Args, Clone, Debug)]
pub struct StoreArgs {
    /// RAM for cached expert records, e.g. 8G, 512M or 0 (no cache beyond one layer's working set).
    /// Default: a quarter of physical memory, leaving the OS room for everything else.
    #[arg(long, value_name = "SIZE")]
    pub expert_cache: Option<String>,
    /// Read routed experts from this pack (made by `deltafin pack`; any one of its stripe directories).
    #[arg(long, value_name = "DIR")]
    pub pack: Option<PathBuf>,
    /// Eviction policy of the expert cache: lfu (decayed frequency; measured best on routing traces), lru or
    /// blend.
    #[arg(long, default_value = "lfu")]
    pub cache_policy: Policy,
    /// Turn off lookahead prefetch (the next layer's router predicting its experts).
    #[arg(long)]
    pub no_prefetch: bool,
    /// Read through the page cache instead of direct I/O (O_DIRECT).
    #[arg(long)]
    pub buffered_io: bool,
    /// Reads in flight per drive.
    #[arg(long, default_value_t = 8)]
    pub io_workers: usize,
    /// How reads are kept in flight: "pool" (reader threads) or "uring" (one io_uring ring per drive).
    #[arg(long, default_value = "pool")]
    pub io_engine: deltafin_store::io::Backend,
    /// Memory for all weights (e.g. 48G). Spine layers beyond it are read from disk on every pass,
    /// double-buffered. Default: no limit (the whole spine stays resident), unless the spine and the expert
    /// cache would not fit in available memory — then 85% of it.
    #[arg(long, value_name = "SIZE")]
    pub memory_budget: Option<String>,
    #[command(flatten)]
    pub remote: RemoteArgs,
}

/// Where a mirrored model's missing bytes come from, and how they are fetched.
#[derive(Args, Clone, Debug, Default)]
pub struct RemoteArgs {
    /// Mirror the model from this repository (a Hugging Face repo URL or any HTTP(S) server with range
    /// requests) into --model: the spine once, each routed expert on first use, verified and kept on disk.
    /// A mirror directory remembers its URL, so later runs need only --model.
    #[arg(long, value_name = "URL")]
    pub remote: Option<String>,
    /// Never touch the network: use only what the mirror in --model already holds.
    #[arg(long)]
    pub offline: bool,
    /// Disk for a mirror's routed experts (e.g. 200G); least recently used ones are removed beyond it.
    /// Default: no limit.
    #[arg(long, value_name = "SIZE")]
    pub disk_cache: Option<String>,
    #[command(flatten)]
    pub http: HttpArgs,
}

#[derive(Args, Clone, Debug)]
pub struct HttpArgs {
    /// HTTP requests in flight at once.
    #[arg(long, default_value_t = 8)]
    pub connections: usize,
    /// Retries of a failed request (timeouts, resets, 5xx, bad responses), with exponential backoff.
    #[arg(long, default_value_t = 5)]
    pub retries: u32,
    /// Seconds to wait for a connection or for the next bytes of a response.
    #[arg(long, default_value_t = 30.0)]
    pub http_timeout: f64,
}

impl Default for HttpArgs {
    fn default() -> Self {
        HttpArgs {
            connections: 8,
            retries: 5,
            http_timeout: 30.0,
        }
    }
}

impl HttpArgs {
    pub fn source(&self, url: &str) -> Result<Source> {
        if self.connections == 0 {
            bail!("--connections must be at least 1");
        }
        if !(self.http_timeout > 0.0 && self.http_timeout.is_finite()) {
            bail!("--http-timeout must be a positive number of seconds");
        }
        let timeout = Duration::from_secs_f64(self.http_timeout);
        Source::new(
            url,
            HttpOptions {
                retries: self.retries,
                // A tenth of the timeout, so a short timeout (tests, a LAN mirror) also backs off briefly.
                backoff: (timeout / 10).min(HttpOptions::default().backoff),
                timeout,
                connections: self.connections,
            },
        )
    }
}

impl RemoteArgs {
    /// Opens `model` as a mirror when it is one (or --remote makes it one), downloading what is missing of
    /// its spine; `None` for an ordinary checkpoint.
    pub fn mirror(&self, model: &Path) -> Result<Option<deltafin_remote::Mirror>> {
        let state = deltafin_formats::mirror::read_state(model)?;
        let url = match (&self.remote, &state) {
            (_, Some(s)) if s.complete => return Ok(None),
            (Some(u), _) => u.clone(),
            (None, Some(s)) => s.url.clone(),
            (None, None) => return Ok(None),
        };
        let source = if self.offline {
            None
        } else {
            Some(self.http.source(&url)?)
        };
        let opts = MirrorOptions {
            disk_budget: self.disk_cache.as_deref().map(parse_size).transpose()?,
        };
        let bar = bytes_bar("spine");
        let m = deltafin_remote::open_mirror(model, source, opts, &|done, total| {
            bar.set_length(total);
            bar.set_position(done);
        })?;
        bar.finish_and_clear();
        eprintln!(
            "{}: mirror of {} ({} of its experts local; {})",
            model.display(),
            m.url(),
            m.experts_present(),
            m.verification()
        );
        Ok(Some(m))
    }
}

/// A byte-count progress bar (hidden when stderr is not a terminal).
pub fn bytes_bar(what: &str) -> ProgressBar {
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{what} {{bar:40}} {{bytes}}/{{total_bytes}} ({{bytes_per_sec}}, {{eta}} left)"
        ))
        .expect("the template parses"),
    );
    bar
}

impl StoreArgs {
    /// How to open the model in `model`: a mirror is opened (and its spine completed) here.
    pub fn load_options(&self, model: &Path) -> Result<LoadOptions> {
        let backfill = self
            .remote
            .mirror(model)?
            .map(|m| Arc::new(m) as Arc<dyn deltafin_store::Backfill>);
        let explicit_cache = self.expert_cache.as_deref().map(parse_size).transpose()?;
        let memory_budget = match self.memory_budget.as_deref().map(parse_size).transpose()? {
            Some(b) => Some(b),
            None => {
                let cache = explicit_cache.unwrap_or(physical_memory().unwrap_or(0) / 4);
                // An unreadable checkpoint gets no budget here; loading says what is wrong with it.
                let auto = deltafin_models::resident_bytes(model)
                    .ok()
                    .zip(meminfo("MemAvailable:"))
                    .and_then(|(spine, avail)| auto_budget(spine, cache, avail));
                if let Some(b) = auto {
                    eprintln!(
                        "note: the spine of {} and the expert cache would not fit in available memory; streaming spine layers from disk under a memory budget of {:.1} GB (choose one with --memory-budget)",
                        model.display(),
                        b as f64 / 1e9
                    );
                }
                auto
            }
        };
        let cache_bytes = match (explicit_cache, memory_budget) {
            (Some(c), _) => c,
            // Under a budget the expert cache takes a quarter of it, the spine the rest.
            (None, Some(b)) => b / 4,
            (None, None) => physical_memory().unwrap_or(0) / 4,
        };
        if self.io_workers == 0 {
            bail!("--io-workers must be at least 1");
        }
        Ok(LoadOptions {
            store: StoreOptions {
                cache_bytes,
                direct_io: !self.buffered_io,
                workers_per_drive: self.io_workers,
                policy: self.cache_policy,
                prefetch: !self.no_prefetch,
                backend: self.io_engine,
                ..StoreOptions::default()
            },
            pack: self.pack.clone(),
            memory_budget,
            backfill,
        })
    }
}

impl Default for StoreArgs {
    fn default() -> Self {
        StoreArgs {
            expert_cache: None,
            pack: None,
            cache_policy: Policy::default(),
            no_prefetch: false,
            buffered_io: false,
            io_workers: 8,
            io_engine: deltafin_store::io::Backend::Pool,
            memory_budget: None,
            remote: RemoteArgs::default(),
        }
    }
}

/// "8G", "512M", "64k", "1.5G" or plain bytes (binary units).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = t[i..].to_ascii_uppercase();
            let mult: u64 = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                "T" => 1 << 40,
                _ => bail!("size {s:?} has an unknown unit; use K, M, G or T (e.g. 8G)"),
            };
            (&t[..i], mult)
        }
        None => (t, 1),
    };
    let v: f64 = num
        .trim()
        .parse()
        .with_context(|| format!("size {s:?} is not a number with an optional unit (e.g. 8G)"))?;
    if !(v >= 0.0 && v.is_finite()) {
        bail!("size {s:?} must be a non-negative number");
    }
    Ok((v * mult as f64) as u64)
}

/// MemTotal from /proc/meminfo.
pub fn physical_memory() -> Option<u64> {
    meminfo("MemTotal:")
}

/// A /proc/meminfo field in bytes.
fn meminfo(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with(field))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Without --memory-budget, a spine and cache that would not fit in 90% of available memory get a budget of
/// 85% of it (spine layers beyond it stream from disk) instead of an out-of-memory kill.
fn auto_budget(spine: u64, cache: u64, available: u64) -> Option<u64> {
    (spine + cache > available / 10 * 9).then_some(available / 100 * 85)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spine_that_does_not_fit_gets_a_budget() {
        const G: u64 = 1 << 30;
        assert_eq!(auto_budget(10 * G, 4 * G, 64 * G), None);
        // K3 on a 64 GB machine: 115 GB of spine.
        assert_eq!(
            auto_budget(115 * G, 16 * G, 60 * G),
            Some(60 * G / 100 * 85)
        );
        assert_eq!(auto_budget(50 * G, 10 * G, 64 * G), Some(64 * G / 100 * 85));
    }

    #[test]
    fn sizes_parse_with_units_and_reject_garbage() {
        assert_eq!(parse_size("0").unwrap(), 0);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("8G").unwrap(), 8 << 30);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert!(parse_size("8Q")
            .unwrap_err()
            .to_string()
            .contains("unknown unit"));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1G").is_err());
    }
}
