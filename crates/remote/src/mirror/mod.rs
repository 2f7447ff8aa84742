//! A local mirror of a remote checkpoint: the same files, the shards sparse — header and spine present, each
//! routed expert written into its own byte range when it is first routed. The journal says which bytes are
//! there; nothing reads a byte the journal does not vouch for.

mod create;
mod experts;
mod spine;

pub use create::create;

use crate::http::Source;
use crate::journal::Journal;
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::Checkpoint;
use deltafin_formats::checksums::{self, Checksums};
use deltafin_formats::mirror::{self as marker, MirrorState};
use deltafin_store::RecordLoc;
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

#[derive(Clone, Debug, Default)]
pub struct MirrorOptions {
    /// Bytes of routed experts the mirror may keep on disk; least recently used ones go beyond it.
    pub disk_budget: Option<u64>,
}

struct Present {
    checksum: u64,
    last_use: u64,
    /// Brought by a lookahead download and not yet asked for.
    ahead: bool,
}

struct Inner {
    present: HashMap<(usize, usize), Present>,
    /// Checksums of every record published in this run, evicted ones too: a read racing an eviction is
    /// caught rather than trusted.
    known: HashMap<(usize, usize), u64>,
    clock: u64,
    journal: Journal,
    chunks: std::collections::HashSet<(usize, u64, u64)>,
    spine: Option<bool>,
    /// Experts being downloaded now (by demand or lookahead): nobody starts a second download of them.
    in_flight: std::collections::HashSet<(usize, usize)>,
    /// Disk-budget records set aside for the lookahead download in flight.
    reserved: usize,
    /// Experts lookahead downloads brought, and how many of them demand then asked for.
    ahead_brought: u64,
    ahead_used: u64,
}

pub struct Mirror {
    dir: PathBuf,
    state: MirrorState,
    /// `None`: offline, the network is never touched.
    source: Option<Source>,
    checksums: Option<Checksums>,
    ck: Checkpoint,
    /// Per shard: (offset, bytes, name) of every tensor, sorted by offset, to find a range's tensors quickly.
    by_offset: Vec<Vec<(u64, u64, String)>>,
    shards: Vec<File>,
    records: Vec<Vec<RecordLoc>>,
    record_len: usize,
    opts: MirrorOptions,
    inner: Mutex<Inner>,
    /// Signalled whenever experts leave `Inner::in_flight`.
    arrived: Condvar,
    /// A lookahead download is running (at most one, so it never crowds out demand).
    prefetching: AtomicBool,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Mirror({} of {})", self.dir.display(), self.state.url)
    }
}

impl Mirror {
    /// Opens the mirror in `dir`; `source` is `None` offline.
    pub fn open(dir: &Path, source: Option<Source>, opts: MirrorOptions) -> Result<Mirror> {
        let state = marker::read_state(dir)?
            .with_context(|| format!("{} is not a mirror of a remote repository", dir.display()))?;
        let source = source.map(|mut s| {
            if let Some(c) = &state.commit {
                s.pin(c);
            }
            s.require_etags(
                state
                    .shards
                    .iter()
                    .filter_map(|f| Some((f.name.clone(), f.etag.clone()?))),
            );
            s
        });
        let checksums = match std::fs::read(dir.join(checksums::FILE)) {
            Ok(b) if state.checksums => Some(Checksums::parse(
                &b,
                &dir.join(checksums::FILE).display().to_string(),
            )?),
            _ => None,
        };
        let ck = Checkpoint::open(dir)?;
        let (paths, records, record_len) = deltafin_store::record::expert_sources(dir)?;
        let shards = paths
            .iter()
            .map(|p| {
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(p)
                    .with_context(|| format!("cannot open {} for writing", p.display()))
            })
            .collect::<Result<Vec<_>>>()?;
        if shards.len() != state.shards.len() {
            bail!(
                "{} lists {} shards but the checkpoint has {}; the mirror is damaged — delete it and fetch again",
                marker::state_path(dir).display(),
                state.shards.len(),
                shards.len()
            );
        }
        let mut by_offset = vec![Vec::new(); shards.len()];
        for t in ck.tensors() {
            by_offset[t.shard].push((t.offset, t.nbytes, t.name.clone()));
        }
        by_offset.iter_mut().for_each(|v| v.sort_unstable());
        let (journal, r) = Journal::open(&dir.join(marker::STATE_DIR).join("journal"))?;
        let present = r
            .experts
            .iter()
            .enumerate()
            .map(|(i, &(k, h))| {
                (
                    k,
                    Present {
                        checksum: h,
                        last_use: i as u64,
                        ahead: false,
                    },
                )
            })
            .collect();
        Ok(Mirror {
            dir: dir.to_path_buf(),
            state,
            source,
            checksums,
            ck,
            by_offset,
            shards,
            records,
            record_len,
            opts,
            inner: Mutex::new(Inner {
                known: r.experts.iter().copied().collect(),
                present,
                clock: r.experts.len() as u64,
                journal,
                chunks: r.chunks,
                spine: r.spine,
                in_flight: Default::default(),
                reserved: 0,
                ahead_brought: 0,
                ahead_used: 0,
            }),
            arrived: Condvar::new(),
            prefetching: AtomicBool::new(false),
        })
    }

    pub fn url(&self) -> &str {
        &self.state.url
    }

    fn online(&self) -> Result<&Source> {
        self.source.as_ref().with_context(|| {
            format!(
                "{} needs bytes it does not have yet, and --offline forbids fetching them from {}",
                self.dir.display(),
                self.state.url
            )
        })
    }

    /// MoE layers and their expert counts.
    pub fn expert_layers(&self) -> Vec<(usize, usize)> {
        self.records
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.is_empty())
            .map(|(l, r)| (l, r.len()))
            .collect()
    }

    pub fn record_len(&self) -> usize {
        self.record_len
    }

    /// Experts on local disk now.
    pub fn experts_present(&self) -> usize {
        self.inner.lock().unwrap().present.len()
    }

    /// When every expert and the spine are local: checks each whole shard against its stated SHA-256 and
    /// marks the mirror complete (an ordinary checkpoint from then on). Returns what was verified.
    pub fn complete(&mut self) -> Result<Option<String>> {
        let all: usize = self.records.iter().map(Vec::len).sum();
        if self.spine_status().is_none() || self.experts_present() < all {
            return Ok(None);
        }
        let mut verified = 0;
        for s in &self.state.shards {
            let Some(want) = &s.sha256 else { continue };
            let got = checksums::file_sum(&self.dir.join(&s.name))?;
            if &got.sha256 != want {
                bail!(
                    "{} was fetched in full but its SHA-256 is {}, not the {want} the server states; the mirror stays partial",
                    s.name,
                    got.sha256
                );
            }
            verified += 1;
        }
        self.state.complete = true;
        marker::write_state(&self.dir, &self.state)?;
        Ok(Some(format!(
            "{verified} of {} shard(s) verified whole by SHA-256",
            self.state.shards.len()
        )))
    }

    /// Says plainly what was verified.
    pub fn verification(&self) -> String {
        let spine = match self.spine_status() {
            Some(true) => format!("spine verified against {}", checksums::FILE),
            Some(false) => format!(
                "spine NOT verified (the server publishes no {})",
                checksums::FILE
            ),
            None => "spine incomplete".into(),
        };
        let experts = if self.checksums.is_some() {
            "every fetched expert verified tensor by tensor before it is cached"
        } else {
            "fetched experts NOT verified against the source (no manifest); their xxh3 is recorded and checked on every read from disk"
        };
        format!("{spine}; {experts}")
    }
}

/// Runs `work` over `items` on up to `threads` threads (blocking network I/O: not the compute pool); the first
/// error stops the others from starting new items.
fn parallel<T: Sync>(
    threads: usize,
    items: &[T],
    work: impl Fn(&T) -> Result<()> + Sync,
) -> Result<()> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let first_error: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1).min(items.len()) {
            s.spawn(|| {
                while !failed.load(Ordering::Relaxed) {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else { break };
                    if let Err(e) = work(item) {
                        failed.store(true, Ordering::Relaxed);
                        first_error.lock().unwrap().get_or_insert(e);
                    }
                }
            });
        }
    });
    match first_error.into_inner().unwrap() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Bytes the mirror's shards occupy on disk (sparse files count only what is allocated).
pub fn disk_usage(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    for s in marker::read_state(dir)?
        .map(|s| s.shards)
        .unwrap_or_default()
    {
        let path = dir.join(&s.name);
        total += std::fs::metadata(&path)
            .with_context(|| format!("cannot read {}", path.display()))?
            .blocks()
            * 512;
    }
    Ok(total)
}
