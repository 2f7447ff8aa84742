//! Routed experts on first use: adjacent missing ones fetched as one range, each checked against the
//! manifest, published in the journal, and the least recently used evicted beyond the disk budget; the
//! store's [`Backfill`].

use super::{parallel, Mirror, Present};
use crate::journal::Entry;
use anyhow::{bail, Context, Result};
use deltafin_formats::checksums;
use deltafin_store::Backfill;
use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

/// Adjacent missing experts are fetched as one range up to this size.
const MAX_SPAN: u64 = 64 << 20;

impl Mirror {
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
