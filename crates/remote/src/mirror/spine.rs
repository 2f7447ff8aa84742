//! The spine (every tensor but the routed experts): downloaded in chunks, resumed where a run stopped, then
//! checked tensor by tensor against the manifest; bad tensors' chunks are forgotten and fetched again.

use super::{parallel, Mirror, Present};
use crate::journal::{Entry, Replayed};
use anyhow::{bail, Context, Result};
use deltafin_formats::checkpoint::TensorInfo;
use deltafin_formats::checksums::{self, Checksums};
use std::collections::HashMap;
use std::os::unix::fs::FileExt;

/// Spine downloads go in chunks of this size: the unit of parallelism and of resumption.
const SPINE_CHUNK: u64 = 8 << 20;

impl Mirror {
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
}

fn present_in_order(present: &HashMap<(usize, usize), Present>) -> Vec<((usize, usize), u64)> {
    let mut v: Vec<_> = present.iter().collect();
    v.sort_by_key(|(k, p)| (p.last_use, **k));
    v.into_iter().map(|(k, p)| (*k, p.checksum)).collect()
}
