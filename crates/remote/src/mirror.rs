//! A local mirror of a remote checkpoint: the same files, the shards sparse — header and spine present, each
//! routed expert written into its own byte range when it is first routed. The journal says which bytes are
//! there; nothing reads a byte the journal does not vouch for.

use crate::http::Source;
use crate::journal::{Entry, Journal, Replayed};
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::{Checkpoint, TensorInfo};
use deltafin_formats::checksums::{self, Checksums};
use deltafin_formats::mirror::{self as marker, MirrorState, RemoteFile};
use deltafin_store::{Backfill, RecordLoc};
use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Small files fetched whole when the server has them (config.json and the index are required).
const SMALL_FILES: &[&str] = &[
    "config.json",
    "model.safetensors.index.json",
    "generation_config.json",
    "tiktoken.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    checksums::FILE,
];
/// Spine downloads go in chunks of this size: the unit of parallelism and of resumption.
const SPINE_CHUNK: u64 = 8 << 20;
/// Adjacent missing experts are fetched as one range up to this size.
const MAX_SPAN: u64 = 64 << 20;
/// A safetensors header larger than this is not a header.
const MAX_HEADER: u64 = 256 << 20;

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

/// Starts a mirror of `source` in `dir` (or checks that `dir` already mirrors it): the small files, the shard
/// headers, sparse shards of the right length. The marker is written before any shard, so an interrupted
/// start never leaves something that looks like a complete checkpoint.
pub fn create(dir: &Path, source: &mut Source) -> Result<()> {
    let url = source.base().to_string();
    if let Some(s) = marker::read_state(dir)? {
        if s.url != url {
            bail!(
                "{} mirrors {}, not {}; choose another directory",
                dir.display(),
                s.url,
                source.base()
            );
        }
        return Ok(());
    }
    if dir.join("config.json").exists() {
        bail!(
            "{} already holds a checkpoint that is not a mirror; choose an empty directory",
            dir.display()
        );
    }
    // A failure here is reported by the GET of config.json below.
    let commit = source.head("config.json").ok().and_then(|i| i.commit);
    if let Some(c) = &commit {
        source.pin(c);
    }
    let mut small = Vec::new();
    for name in SMALL_FILES {
        if let Some(bytes) = source.get(name)? {
            small.push((*name, bytes));
        }
    }
    let get = |n: &str| small.iter().find(|(m, _)| *m == n).map(|(_, b)| b);
    if get("config.json").is_none() {
        bail!(
            "{} has no config.json; give the repository's base URL (the directory that holds config.json)",
            source.base()
        );
    }
    let sums = get(checksums::FILE)
        .map(|b| Checksums::parse(b, &source.url(checksums::FILE)))
        .transpose()?;
    for (name, bytes) in &small {
        if let Some(want) = sums.as_ref().and_then(|s| s.files.get(*name)) {
            let got = checksums::sha256_hex(bytes);
            if got != want.sha256 {
                bail!(
                    "{} does not match {}: SHA-256 {got}, expected {}",
                    source.url(name),
                    checksums::FILE,
                    want.sha256
                );
            }
        }
    }
    let shard_names: Vec<String> = match get("model.safetensors.index.json") {
        Some(index) => {
            let v: serde_json::Value = serde_json::from_slice(index).with_context(|| {
                format!(
                    "{} is not valid JSON",
                    source.url("model.safetensors.index.json")
                )
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .context("model.safetensors.index.json has no `weight_map` object")?;
            let mut names: Vec<String> = Vec::new();
            for shard in map.values() {
                let s = shard.as_str().unwrap_or("");
                if s.is_empty() || s.contains('/') || s.contains("..") {
                    bail!("model.safetensors.index.json names the shard {shard}, which is not a file name");
                }
                if !names.iter().any(|n| n == s) {
                    names.push(s.to_string());
                }
            }
            names.sort();
            names
        }
        None => vec!["model.safetensors".to_string()],
    };
    let mut shards = Vec::new();
    for name in &shard_names {
        let info = source.head(name)?;
        let stated = sums.as_ref().and_then(|s| s.files.get(name));
        if let Some(s) = stated {
            if s.size != info.size {
                bail!(
                    "{} is {} bytes on the server but {} says {}",
                    source.url(name),
                    info.size,
                    checksums::FILE,
                    s.size
                );
            }
        }
        shards.push(RemoteFile {
            name: name.clone(),
            size: info.size,
            sha256: stated.map(|s| s.sha256.clone()).or(info.sha256),
            etag: info.etag,
        });
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    source.require_etags(
        shards
            .iter()
            .filter_map(|s| Some((s.name.clone(), s.etag.clone()?))),
    );
    let state = MirrorState {
        url: url.clone(),
        commit,
        shards,
        checksums: sums.is_some(),
        complete: false,
    };
    marker::write_state(dir, &state)?;
    for (name, bytes) in &small {
        deltafin_formats::write_atomically(&dir.join(name), bytes)?;
    }
    for s in &state.shards {
        let (head, header) = match sums.as_ref().and_then(|c| c.headers.get(&s.name)) {
            // The manifest states the header: one verified range.
            Some(h) => {
                if h.len < 8 || h.len > s.size {
                    bail!(
                        "{} states a {}-byte header for the {}-byte {}",
                        checksums::FILE,
                        h.len,
                        s.size,
                        s.name
                    );
                }
                let check = |b: &[u8]| {
                    let got = checksums::xxh3_hex(b);
                    if got == h.xxh3 {
                        Ok(())
                    } else {
                        Err(format!(
                            "corrupted header: xxh3 {got}, {} says {}",
                            checksums::FILE,
                            h.xxh3
                        ))
                    }
                };
                let mut all = source.range(&s.name, 0, h.len, s.size, &check)?;
                let header = all.split_off(8);
                (all, header)
            }
            None => {
                let head = source.range(&s.name, 0, 8, s.size, &|_| Ok(()))?;
                if deltafin_formats::checkpoint::LFS_POINTER.starts_with(&head) {
                    bail!(
                        "{} is a Git LFS pointer, not the weights; give the repository's download URL (on Hugging Face: https://huggingface.co/ORG/NAME, which resolves files)",
                        source.url(&s.name)
                    );
                }
                let hlen = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
                if hlen > MAX_HEADER || 8 + hlen > s.size {
                    bail!(
                        "{} starts with a header length of {hlen} bytes, impossible for a {}-byte safetensors file",
                        source.url(&s.name),
                        s.size
                    );
                }
                (head, source.range(&s.name, 8, hlen, s.size, &|_| Ok(()))?)
            }
        };
        let path = dir.join(&s.name);
        let f = File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        f.set_len(s.size)?;
        f.write_all_at(&head, 0)?;
        f.write_all_at(&header, 8)?;
        f.sync_all()?;
    }
    Ok(())
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

    /// Spine tensors (everything but routed experts).
    fn spine_tensors(&self) -> Vec<&TensorInfo> {
        let mut v: Vec<&TensorInfo> = self
            .ck
            .tensors()
            .filter(|t| !deltafin_store::record::is_routed_expert(&t.name))
            .collect();
        v.sort_by_key(|t| (t.shard, t.offset));
        v
    }

    /// The spine's byte ranges, merged where adjacent and cut into chunks: the same plan on every run, so a
    /// resumed download skips exactly the chunks the journal lists.
    fn spine_chunks(&self) -> Vec<(usize, u64, u64)> {
        let mut spans: Vec<(usize, u64, u64)> = Vec::new();
        for t in self.spine_tensors() {
            match spans.last_mut() {
                Some((f, o, l)) if *f == t.shard && *o + *l == t.offset => *l += t.nbytes,
                _ if t.nbytes > 0 => spans.push((t.shard, t.offset, t.nbytes)),
                _ => {}
            }
        }
        let mut chunks = Vec::new();
        for (f, o, l) in spans {
            let mut at = 0;
            while at < l {
                let n = (l - at).min(SPINE_CHUNK);
                chunks.push((f, o + at, n));
                at += n;
            }
        }
        chunks
    }

    /// `Some(true)`: the spine is local and matched the checksum manifest; `Some(false)`: local, no manifest.
    pub fn spine_status(&self) -> Option<bool> {
        self.inner.lock().unwrap().spine
    }

    /// Spine bytes still to download, and in all.
    pub fn spine_todo(&self) -> (u64, u64) {
        let done = self.inner.lock().unwrap().chunks.clone();
        let all = self.spine_chunks();
        let total = all.iter().map(|c| c.2).sum();
        let todo = all.iter().filter(|c| !done.contains(c)).map(|c| c.2).sum();
        (todo, total)
    }

    /// Downloads what is missing of the spine (resuming where a previous run stopped), then verifies every
    /// spine tensor against the checksum manifest; `progress` gets each chunk's bytes as it lands.
    pub fn fetch_spine(&self, progress: &(dyn Fn(u64) + Sync)) -> Result<()> {
        if self.spine_status().is_some() {
            return Ok(());
        }
        let source = self.online()?;
        for attempt in 0..2 {
            let done = self.inner.lock().unwrap().chunks.clone();
            let todo: Vec<_> = self
                .spine_chunks()
                .into_iter()
                .filter(|c| !done.contains(c))
                .collect();
            parallel(source.opts.connections, &todo, |&(f, o, l)| {
                let name = &self.state.shards[f].name;
                let bytes = source.range(name, o, l, self.state.shards[f].size, &|_| Ok(()))?;
                self.shards[f]
                    .write_all_at(&bytes, o)
                    .and_then(|_| self.shards[f].sync_data())
                    .with_context(|| format!("cannot write {}", self.dir.join(name).display()))?;
                let mut inner = self.inner.lock().unwrap();
                inner.journal.append(&[Entry::Chunk(f, o, l)])?;
                inner.chunks.insert((f, o, l));
                drop(inner);
                progress(l);
                Ok(())
            })?;
            let Some(sums) = &self.checksums else {
                return self.finish_spine(false);
            };
            let bad = self.bad_spine_tensors(sums)?;
            if bad.is_empty() {
                return self.finish_spine(true);
            }
            let (name, want, got) = &bad[0];
            eprintln!(
                "warning: {} spine tensor(s) differ from {} (first: `{name}`, expected xxh3 {want}, got {got}){}",
                bad.len(),
                checksums::FILE,
                if attempt == 0 { "; fetching them again" } else { "" }
            );
            if attempt == 1 {
                bail!(
                    "the server at {} sent different bytes for `{name}` than its {} states (xxh3 {want} expected, {got} received), twice; the spine is not trusted and the mirror stays unusable — check the server or its manifest",
                    self.state.url,
                    checksums::FILE
                );
            }
            self.forget_chunks_of(&bad)?;
        }
        unreachable!("the second attempt returns or fails")
    }

    fn finish_spine(&self, verified: bool) -> Result<()> {
        let mut inner = self.inner.lock().unwrap();
        inner.journal.append(&[Entry::SpineDone(verified)])?;
        inner.spine = Some(verified);
        Ok(())
    }

    /// Spine tensors whose local bytes differ from the manifest: (name, expected, got).
    fn bad_spine_tensors(&self, sums: &Checksums) -> Result<Vec<(String, String, String)>> {
        let mut bad = Vec::new();
        for t in self.spine_tensors() {
            let want = sums.tensors.get(&t.name).with_context(|| {
                format!(
                    "{} has no entry for tensor `{}`; it does not describe this checkpoint",
                    checksums::FILE,
                    t.name
                )
            })?;
            let got = checksums::xxh3_hex(&self.ck.read(t)?);
            if &got != want {
                bad.push((t.name.clone(), want.clone(), got));
            }
        }
        Ok(bad)
    }

    /// Drops the journal's chunks that overlap the named tensors, so they are fetched again.
    fn forget_chunks_of(&self, bad: &[(String, String, String)]) -> Result<()> {
        let ranges: Vec<(usize, u64, u64)> = bad
            .iter()
            .filter_map(|(n, _, _)| self.ck.info(n).ok())
            .map(|t| (t.shard, t.offset, t.offset + t.nbytes))
            .collect();
        let mut inner = self.inner.lock().unwrap();
        inner.chunks.retain(|&(f, o, l)| {
            !ranges
                .iter()
                .any(|&(rf, a, b)| rf == f && o < b && a < o + l)
        });
        let r = Replayed {
            chunks: inner.chunks.clone(),
            spine: None,
            experts: present_in_order(&inner.present),
        };
        inner.journal.rewrite(&r)
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

    /// Makes `experts` of `layer` local: downloads the missing ones nobody is downloading, waits for the ones
    /// a lookahead download is already bringing, and takes over any that download failed to bring.
    fn fetch_experts(
        &self,
        layer: usize,
        experts: &[usize],
        busy: &dyn Fn(usize, usize) -> bool,
    ) -> Result<()> {
        loop {
            let (mine, waiting) = self.claim(layer, experts, true);
            if !mine.is_empty() {
                let result = self.online().and_then(|_| {
                    self.make_room(layer, experts, mine.len(), busy)?;
                    self.download(layer, &mine, false)
                });
                self.unclaim(layer, &mine);
                result.with_context(|| format!("experts {mine:?} are not in the local cache"))?;
            }
            if waiting.is_empty() {
                return Ok(());
            }
            let mut inner = self.inner.lock().unwrap();
            while waiting
                .iter()
                .any(|&e| inner.in_flight.contains(&(layer, e)))
            {
                inner = self.arrived.wait(inner).unwrap();
            }
        }
    }

    /// Splits the experts of `experts` that are not local into (claimed for this caller to download, being
    /// downloaded by someone else); `demand` marks the local ones as used now.
    fn claim(&self, layer: usize, experts: &[usize], demand: bool) -> (Vec<usize>, Vec<usize>) {
        let mut inner = self.inner.lock().unwrap();
        if demand {
            inner.clock += 1;
        }
        let now = inner.clock;
        let (mut mine, mut waiting) = (Vec::new(), Vec::new());
        for &e in experts {
            if let Some(p) = inner.present.get_mut(&(layer, e)) {
                if demand {
                    p.last_use = now;
                    if std::mem::take(&mut p.ahead) {
                        inner.ahead_used += 1;
                    }
                }
            } else if inner.in_flight.contains(&(layer, e)) {
                if !waiting.contains(&e) && !mine.contains(&e) {
                    waiting.push(e);
                }
            } else {
                inner.in_flight.insert((layer, e));
                mine.push(e);
            }
        }
        (mine, waiting)
    }

    fn unclaim(&self, layer: usize, experts: &[usize]) {
        let mut inner = self.inner.lock().unwrap();
        for &e in experts {
            inner.in_flight.remove(&(layer, e));
        }
        self.arrived.notify_all();
    }

    /// Lookahead: starts downloading `experts` of `layer` in the background when no other lookahead download
    /// runs and they fit the disk budget as it stands (the room is reserved; eviction is demand's call).
    fn prefetch_remote(self: Arc<Self>, layer: usize, experts: &[usize]) {
        if self.source.is_none() || self.prefetching.swap(true, Ordering::AcqRel) {
            return;
        }
        let (mine, _) = self.claim(layer, experts, false);
        let fits = {
            let mut inner = self.inner.lock().unwrap();
            let fits = self.opts.disk_budget.is_none_or(|budget| {
                ((inner.present.len() + inner.reserved + mine.len()) * self.record_len) as u64
                    <= budget
            });
            if fits {
                inner.reserved += mine.len();
            }
            fits
        };
        if mine.is_empty() || !fits {
            self.unclaim(layer, &mine);
            self.prefetching.store(false, Ordering::Release);
            return;
        }
        std::thread::spawn(move || {
            // A failure here is not reported: the demand that needs these experts downloads them itself
            // and reports what goes wrong.
            let _ = self.download(layer, &mine, true);
            self.inner.lock().unwrap().reserved -= mine.len();
            self.unclaim(layer, &mine);
            self.prefetching.store(false, Ordering::Release);
        });
    }

    /// Downloads `missing` experts of `layer` (claimed by the caller): adjacent ones coalesced into one
    /// range, several ranges in flight, each expert's tensors checked against the manifest, then written,
    /// synced and only then entered in the journal.
    fn download(&self, layer: usize, missing: &[usize], ahead: bool) -> Result<()> {
        let source = self.online()?;
        let spans = self.plan_spans(layer, missing);
        let bodies: Vec<Mutex<Vec<u8>>> = spans.iter().map(|_| Mutex::new(Vec::new())).collect();
        let idx: Vec<usize> = (0..spans.len()).collect();
        parallel(source.opts.connections, &idx, |&i| {
            let s = &spans[i];
            let file = &self.state.shards[s.file];
            let check = |body: &[u8]| self.check_span(s, body);
            let body = source.range(&file.name, s.offset, s.len, file.size, &check)?;
            *bodies[i].lock().unwrap() = body;
            Ok(())
        })?;
        // Write every piece, sync, then publish.
        let mut records: HashMap<usize, Vec<u8>> = missing
            .iter()
            .map(|&e| (e, vec![0u8; self.record_len]))
            .collect();
        let mut touched = std::collections::BTreeSet::new();
        for (s, body) in spans.iter().zip(&bodies) {
            let body = body.lock().unwrap();
            for p in &s.pieces {
                let bytes = &body[(p.offset - s.offset) as usize..][..p.len];
                self.shards[s.file]
                    .write_all_at(bytes, p.offset)
                    .with_context(|| {
                        format!(
                            "cannot write {}",
                            self.dir.join(&self.state.shards[s.file].name).display()
                        )
                    })?;
                records.get_mut(&p.expert).expect("planned")[p.rec_pos..][..p.len]
                    .copy_from_slice(bytes);
            }
            touched.insert(s.file);
        }
        for f in touched {
            self.shards[f].sync_data()?;
        }
        let entries: Vec<(usize, u64)> = missing
            .iter()
            .map(|&e| (e, xxhash_rust::xxh3::xxh3_64(&records[&e])))
            .collect();
        let mut inner = self.inner.lock().unwrap();
        inner.journal.append(
            &entries
                .iter()
                .map(|&(e, h)| Entry::Expert(layer, e, h))
                .collect::<Vec<_>>(),
        )?;
        let now = inner.clock;
        if ahead {
            inner.ahead_brought += entries.len() as u64;
        }
        for (e, h) in entries {
            inner.known.insert((layer, e), h);
            inner.present.insert(
                (layer, e),
                Present {
                    checksum: h,
                    last_use: now,
                    ahead,
                },
            );
        }
        Ok(())
    }

    /// The missing experts' byte ranges, sorted and merged where they touch.
    fn plan_spans(&self, layer: usize, missing: &[usize]) -> Vec<Span> {
        let mut pieces: Vec<Piece> = Vec::new();
        for &e in missing {
            let mut rec_pos = 0;
            for x in &self.records[layer][e].extents {
                pieces.push(Piece {
                    file: x.file,
                    offset: x.offset,
                    len: x.len,
                    expert: e,
                    rec_pos,
                });
                rec_pos += x.len;
            }
        }
        pieces.sort_by_key(|p| (p.file, p.offset));
        let mut spans: Vec<Span> = Vec::new();
        for p in pieces {
            match spans.last_mut() {
                Some(s)
                    if s.file == p.file
                        && s.offset + s.len == p.offset
                        && s.len + p.len as u64 <= MAX_SPAN =>
                {
                    s.len += p.len as u64;
                    s.pieces.push(p);
                }
                _ => spans.push(Span {
                    file: p.file,
                    offset: p.offset,
                    len: p.len as u64,
                    pieces: vec![p],
                }),
            }
        }
        spans
    }

    /// Every tensor inside the span must match the manifest (when there is one).
    fn check_span(&self, s: &Span, body: &[u8]) -> std::result::Result<(), String> {
        let Some(sums) = &self.checksums else {
            return Ok(());
        };
        let tensors = &self.by_offset[s.file];
        let first = tensors.partition_point(|t| t.0 < s.offset);
        for (offset, nbytes, name) in &tensors[first..] {
            if offset + nbytes > s.offset + s.len {
                break;
            }
            let got =
                checksums::xxh3_hex(&body[(offset - s.offset) as usize..][..*nbytes as usize]);
            match sums.tensors.get(name) {
                Some(want) if *want == got => {}
                Some(want) => {
                    return Err(format!(
                        "corrupted bytes: tensor `{name}` has xxh3 {got}, {} says {want}",
                        checksums::FILE
                    ))
                }
                None => {
                    return Err(format!(
                        "{} has no entry for tensor `{name}`",
                        checksums::FILE
                    ))
                }
            }
        }
        Ok(())
    }

    /// Evicts least recently used experts (never those of this request, nor ones being read) until `incoming`
    /// more records fit.
    fn make_room(
        &self,
        layer: usize,
        keep: &[usize],
        incoming: usize,
        busy: &dyn Fn(usize, usize) -> bool,
    ) -> Result<()> {
        let Some(budget) = self.opts.disk_budget else {
            return Ok(());
        };
        let rec = self.record_len as u64;
        if incoming as u64 * rec > budget {
            bail!(
                "the mirror's disk budget of {budget} bytes cannot hold one layer's {incoming} experts ({} bytes); raise --disk-cache",
                incoming as u64 * rec
            );
        }
        let mut inner = self.inner.lock().unwrap();
        while (inner.present.len() + inner.reserved + incoming) as u64 * rec > budget {
            let victim = inner
                .present
                .iter()
                .filter(|(&(l, e), _)| !(busy(l, e) || l == layer && keep.contains(&e)))
                .min_by_key(|(k, p)| (p.last_use, **k))
                .map(|(k, _)| *k);
            let Some(victim) = victim else {
                if inner.reserved > 0 {
                    // The lookahead download holds the room; once it lands its experts can be evicted.
                    inner = self.arrived.wait(inner).unwrap();
                    continue;
                }
                bail!("the disk budget of {budget} bytes is full of experts in use; raise --disk-cache");
            };
            // Unpublish first: a crash after this line leaves a hole the journal does not vouch for.
            inner.journal.append(&[Entry::Evict(victim.0, victim.1)])?;
            inner.present.remove(&victim);
            for x in &self.records[victim.0][victim.1].extents {
                punch_hole(&self.shards[x.file], x.offset, x.len as u64).with_context(|| {
                    format!(
                        "cannot free the space of layer {} expert {} in {}",
                        victim.0,
                        victim.1,
                        self.dir.join(&self.state.shards[x.file].name).display()
                    )
                })?;
            }
        }
        Ok(())
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

impl Backfill for Mirror {
    fn ensure(
        &self,
        layer: usize,
        experts: &[usize],
        busy: &dyn Fn(usize, usize) -> bool,
    ) -> Result<()> {
        self.fetch_experts(layer, experts, busy)
            .with_context(|| format!("fetching from {}", self.state.url))
    }

    fn present(&self, layer: usize, expert: usize) -> bool {
        self.inner
            .lock()
            .unwrap()
            .present
            .contains_key(&(layer, expert))
    }

    fn checksum(&self, layer: usize, expert: usize) -> Option<u64> {
        self.inner
            .lock()
            .unwrap()
            .known
            .get(&(layer, expert))
            .copied()
    }

    fn prefetch(self: Arc<Self>, layer: usize, experts: &[usize]) {
        self.prefetch_remote(layer, experts);
    }

    fn activity(&self) -> String {
        match &self.source {
            None => format!("mirror {}: offline", self.dir.display()),
            Some(s) => {
                let c = &s.counters;
                let inner = self.inner.lock().unwrap();
                format!(
                    "remote {}: {} requests, {:.1} MB, {} retries, {} bad responses, lookahead brought {} experts ({} used)",
                    self.state.url,
                    c.requests.load(Ordering::Relaxed),
                    c.bytes.load(Ordering::Relaxed) as f64 / 1e6,
                    c.retries.load(Ordering::Relaxed),
                    c.bad_responses.load(Ordering::Relaxed),
                    inner.ahead_brought,
                    inner.ahead_used
                )
            }
        }
    }
}

struct Piece {
    file: usize,
    offset: u64,
    len: usize,
    expert: usize,
    /// Where these bytes go in the expert's record.
    rec_pos: usize,
}

struct Span {
    file: usize,
    offset: u64,
    len: u64,
    pieces: Vec<Piece>,
}

fn present_in_order(present: &HashMap<(usize, usize), Present>) -> Vec<((usize, usize), u64)> {
    let mut v: Vec<_> = present.iter().collect();
    v.sort_by_key(|(k, p)| (p.last_use, **k));
    v.into_iter().map(|(k, p)| (*k, p.checksum)).collect()
}

/// Frees the disk space of `len` bytes at `offset`, keeping the file's size: Linux `fallocate` with
/// `PUNCH_HOLE | KEEP_SIZE`; macOS `fcntl(F_PUNCHHOLE)`, which takes whole filesystem blocks only
/// (Apple's fcntl(2): "holes must be aligned to file system block boundaries"), so the partial blocks
/// at either end keep their bytes. Nothing reads them: an evicted expert is fetched again first.
fn punch_hole(file: &File, offset: u64, len: u64) -> Result<()> {
    #[cfg(target_os = "linux")]
    {
        use rustix::fs::{fallocate, FallocateFlags};
        fallocate(
            file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        )?;
    }
    #[cfg(target_os = "macos")]
    {
        use std::os::unix::io::AsRawFd;
        // The filesystem's block size (statfs f_bsize), which the man page names; st_blksize is the
        // preferred I/O size and need not be it.
        // SAFETY: a valid descriptor and a zeroed statfs the call fills.
        let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatfs(file.as_raw_fd(), &mut fs) } == -1 {
            return Err(std::io::Error::last_os_error().into());
        }
        let Some((offset, len)) = whole_blocks(offset, len, fs.f_bsize as u64) else {
            return Ok(());
        };
        let hole = libc::fpunchhole_t {
            fp_flags: 0,
            reserved: 0,
            fp_offset: offset as libc::off_t,
            fp_length: len as libc::off_t,
        };
        // SAFETY: a valid descriptor and an fpunchhole_t that lives across the call.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_PUNCHHOLE, &hole) } == -1 {
            return Err(std::io::Error::last_os_error().into());
        }
    }
    #[cfg(not(any(target_os = "linux", target_os = "macos")))]
    {
        let _ = (file, offset, len);
        bail!("freeing part of a file (hole punching) is not supported on this system");
    }
    Ok(())
}

/// The whole `block`-byte blocks inside `len` bytes at `offset`, as (offset, len); None if there are none.
#[cfg_attr(not(target_os = "macos"), allow(dead_code))]
fn whole_blocks(offset: u64, len: u64, block: u64) -> Option<(u64, u64)> {
    let block = block.max(1);
    let start = offset.div_ceil(block) * block;
    let end = (offset + len) / block * block;
    (end > start).then_some((start, end - start))
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

#[cfg(test)]
mod tests {
    use super::whole_blocks;

    #[test]
    fn holes_on_macos_cover_only_whole_blocks() {
        assert_eq!(whole_blocks(0, 8192, 4096), Some((0, 8192)));
        // A record from byte 100 to 12388: only the blocks at 4096 and 8192 lie wholly inside.
        assert_eq!(whole_blocks(100, 12288, 4096), Some((4096, 8192)));
        assert_eq!(whole_blocks(4096, 4095, 4096), None);
        assert_eq!(whole_blocks(4000, 200, 4096), None);
        assert_eq!(whole_blocks(5, 0, 4096), None);
    }
}
