//! Flags that choose where routed experts are read from and how (shared by every command that loads a model).

use crate::memory::{self, Allowance};
use anyhow::{bail, Context, Result};
use clap::Args;
use deltafin_models::{LoadOptions, MemoryNeeds};
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
    /// Default: what this process may use (available memory, or its cgroup's limit when lower) less the
    /// spine, the working set and a reserve of 1/32 (at least 384 MiB) — up to every routed expert.
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
    /// When every routed expert fits in the expert cache, read them in place from the page cache through
    /// read-only mappings of the model's files instead of into the cache's own memory: the kernel clears no
    /// pages for them, and a later run finds them still cached. On the 2-core VM measured, cold runs were
    /// no faster with it (BENCHMARKS.md, "First touch"); CPU only.
    #[arg(long)]
    pub map_experts: bool,
    /// Reads in flight per drive.
    #[arg(long, default_value_t = 8)]
    pub io_workers: usize,
    /// How reads are kept in flight: "pool" (reader threads) or "uring" (one io_uring ring per drive).
    #[arg(long, default_value = "pool")]
    pub io_engine: deltafin_store::io::Backend,
    /// Memory for all weights (e.g. 48G). Spine layers beyond it are read from disk on every pass,
    /// double-buffered. Default: no limit (the whole spine stays resident), unless the spine and the expert
    /// cache would not fit in what this process may use — then that, less the reserve.
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
        let mirror = self.remote.mirror(model)?;
        if self.io_workers == 0 {
            bail!("--io-workers must be at least 1");
        }
        let mut store = StoreOptions {
            direct_io: !self.buffered_io,
            workers_per_drive: self.io_workers,
            policy: self.cache_policy,
            prefetch: !self.no_prefetch,
            map_files: self.map_experts,
            backend: self.io_engine,
            ..StoreOptions::default()
        };
        let cache = self.expert_cache.as_deref().map(parse_size).transpose()?;
        let budget = self.memory_budget.as_deref().map(parse_size).transpose()?;
        // An unreadable checkpoint gets no automatic sizes here; loading says what is wrong with it.
        let plan = match (
            deltafin_models::memory_needs(model, &store),
            memory::allowance(),
        ) {
            (Ok(needs), Some(allowed)) => {
                plan_memory(&needs, &allowed, mirror.is_some(), cache, budget)?
            }
            _ => MemoryPlan {
                cache: cache.unwrap_or(0),
                budget,
                streams_spine: false,
            },
        };
        if plan.streams_spine {
            eprintln!(
                "note: the spine of {} and the expert cache would not fit in what this process may use ({}); streaming spine layers from disk under a memory budget of {:.1} GiB (choose one with --memory-budget)",
                model.display(),
                memory::allowance().map_or("unknown".into(), |a| a.to_string()),
                plan.budget.unwrap_or(0) as f64 / GIB
            );
        }
        store.cache_bytes = plan.cache;
        Ok(LoadOptions {
            store,
            pack: self.pack.clone(),
            memory_budget: plan.budget,
            backfill: mirror.map(|m| Arc::new(m) as Arc<dyn deltafin_store::Backfill>),
        })
    }
}

const GIB: f64 = (1u64 << 30) as f64;

/// The expert cache and memory budget of one load.
#[derive(Debug, PartialEq, Eq)]
struct MemoryPlan {
    cache: u64,
    budget: Option<u64>,
    /// No --memory-budget was given, but the spine does not fit beside the expert cache: one was chosen.
    streams_spine: bool,
}

/// Sizes what the flags leave open from what this process may use (`allowed`), keeping back a reserve of
/// 1/32 of it, at least 384 MiB (or a quarter, when less is allowed), for the heap, the session and the page
/// cache charged to a cgroup (plus a layer's downloads, held twice, for a mirror): beside the bench model's
/// 5 GiB cache that was ~310 MiB, and a default leaving less made the kernel reclaim on every step under a
/// 6 GiB limit. The default expert cache takes the rest after the resident spine and the working set,
/// up to every routed expert; when the spine does not fit, spine layers stream under a memory budget and the
/// cache gets a quarter of it. Flags that cannot fit in `allowed` are refused before anything is loaded.
fn plan_memory(
    needs: &MemoryNeeds,
    allowed: &Allowance,
    mirror: bool,
    cache: Option<u64>,
    budget: Option<u64>,
) -> Result<MemoryPlan> {
    let working = needs.working_slots * needs.slot;
    let all = needs.records.saturating_sub(needs.working_slots) * needs.slot;
    let reserve = (384u64 << 20)
        .min(allowed.bytes / 4)
        .max(allowed.bytes / 32)
        + if mirror { working } else { 0 };
    let usable = allowed.bytes.saturating_sub(reserve);
    if let Some(b) = budget.filter(|&b| b > allowed.bytes) {
        bail!(
            "--memory-budget {:.1} GiB cannot fit: {allowed}; lower it or raise the limit",
            b as f64 / GIB
        );
    }
    if let Some(c) = cache.filter(|&c| working + c.min(all) > allowed.bytes) {
        bail!(
            "--expert-cache {:.1} GiB cannot fit: with the {:.1} GiB working set its slab needs {:.1} GiB, but {allowed}; lower --expert-cache or raise the limit",
            c as f64 / GIB,
            working as f64 / GIB,
            (working + c.min(all)) as f64 / GIB
        );
    }
    let room = budget.map_or(usable, |b| b.min(usable));
    let cache = cache.unwrap_or(match room.checked_sub(needs.spine + working) {
        Some(left) => left.min(all),
        None => (room / 4).min(all),
    });
    let streams_spine = budget.is_none() && needs.spine + working + cache.min(all) > usable;
    Ok(MemoryPlan {
        cache,
        budget: budget.or(streams_spine.then_some(usable)),
        streams_spine,
    })
}

impl Default for StoreArgs {
    fn default() -> Self {
        StoreArgs {
            expert_cache: None,
            pack: None,
            cache_policy: Policy::default(),
            no_prefetch: false,
            buffered_io: false,
            map_experts: false,
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

#[cfg(test)]
mod tests {
    use super::*;

    const G: u64 = 1 << 30;

    /// The bench model: a 174 MB spine, 576 records of 17.5 MB, 32 working slots.
    fn bench() -> MemoryNeeds {
        MemoryNeeds {
            spine: 174_414_592,
            slot: 17_555_456,
            records: 576,
            working_slots: 32,
        }
    }

    fn cgroup(bytes: u64) -> Allowance {
        Allowance {
            bytes,
            limit: bytes,
            source: "cgroup /sys/fs/cgroup/memory/job/memory.limit_in_bytes".into(),
        }
    }

    #[test]
    fn the_default_cache_fills_what_the_process_may_use() {
        let n = bench();
        let working = 32 * n.slot;
        let p = plan_memory(&n, &cgroup(6 * G), false, None, None).unwrap();
        assert_eq!(p.cache, 6 * G - 384 * (1 << 20) - n.spine - working);
        assert_eq!((p.budget, p.streams_spine), (None, false));
        // With room for everything, the cache holds every record and no more.
        let p = plan_memory(&n, &cgroup(64 * G), false, None, None).unwrap();
        assert_eq!(p.cache, (576 - 32) * n.slot);
        // A mirror keeps a layer's downloads back.
        let m = plan_memory(&n, &cgroup(6 * G), true, None, None).unwrap();
        assert_eq!(
            m.cache + working,
            plan_memory(&n, &cgroup(6 * G), false, None, None)
                .unwrap()
                .cache
        );
    }

    #[test]
    fn a_spine_that_does_not_fit_streams_under_a_budget() {
        // K3 on a 64 GB machine: 115 GB of spine, 1.4 TB of experts.
        let n = MemoryNeeds {
            spine: 115 * G,
            records: 80_000,
            ..bench()
        };
        let p = plan_memory(&n, &cgroup(64 * G), false, None, None).unwrap();
        assert_eq!(p.budget, Some(62 * G));
        assert_eq!(p.cache, 62 * G / 4);
        assert!(p.streams_spine);
        // An explicit budget is kept, and the cache takes what the spine leaves of it.
        let p = plan_memory(&n, &cgroup(64 * G), false, None, Some(40 * G)).unwrap();
        assert_eq!(
            (p.budget, p.cache, p.streams_spine),
            (Some(40 * G), 10 * G, false)
        );
    }

    #[test]
    fn flags_that_cannot_fit_name_the_limit() {
        let n = bench();
        let e = plan_memory(&n, &cgroup(3 * G), false, Some(4 * G), None).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("--expert-cache 4.0 GiB")
                && msg.contains("memory.limit_in_bytes = 3.0 GiB"),
            "{msg}"
        );
        let e = plan_memory(&n, &cgroup(3 * G), false, None, Some(8 * G)).unwrap_err();
        assert!(e.to_string().contains("--memory-budget 8.0 GiB"), "{e}");
        // A cache larger than the model's experts only takes what they need.
        assert!(plan_memory(&n, &cgroup(12 * G), false, Some(100 * G), None).is_ok());
        // An explicit cache that leaves no room for the spine streams it.
        let p = plan_memory(&n, &cgroup(3 * G), false, Some(2 * G + G / 5), None).unwrap();
        assert!(p.streams_spine && p.cache == 2 * G + G / 5);
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
