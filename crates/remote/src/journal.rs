//! The mirror's journal: one line per durable fact, appended and synced only after the bytes it describes are
//! synced. A crash can lose the last facts, never assert bytes that are not there; a torn last line (no
//! newline) is dropped on replay.

use anyhow::{bail, Context, Result};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Entry {
    /// A spine chunk `(shard, offset, len)` is written and synced.
    Chunk(usize, u64, u64),
    /// Every spine chunk is down; `true` when every spine tensor matched the checksum manifest.
    SpineDone(bool),
    /// An expert record is written, synced and (if a manifest exists) verified; its xxh3-64.
    Expert(usize, usize, u64),
    /// An expert record was removed to stay inside the disk budget.
    Evict(usize, usize),
}

impl Entry {
    fn line(&self) -> String {
        match self {
            Entry::Chunk(f, o, l) => format!("chunk {f} {o} {l}\n"),
            Entry::SpineDone(v) => {
                format!("spine {}\n", if *v { "verified" } else { "unverified" })
            }
            Entry::Expert(l, e, h) => format!("expert {l} {e} {h:016x}\n"),
            Entry::Evict(l, e) => format!("evict {l} {e}\n"),
        }
    }

    fn parse(line: &str) -> Option<Entry> {
        let w: Vec<&str> = line.split(' ').collect();
        Some(match w.as_slice() {
            ["chunk", f, o, l] => Entry::Chunk(f.parse().ok()?, o.parse().ok()?, l.parse().ok()?),
            ["spine", "verified"] => Entry::SpineDone(true),
            ["spine", "unverified"] => Entry::SpineDone(false),
            ["expert", l, e, h] => Entry::Expert(
                l.parse().ok()?,
                e.parse().ok()?,
                u64::from_str_radix(h, 16).ok()?,
            ),
            ["evict", l, e] => Entry::Evict(l.parse().ok()?, e.parse().ok()?),
            _ => return None,
        })
    }
}

/// What the journal says is local.
#[derive(Default, Debug)]
pub struct Replayed {
    pub chunks: HashSet<(usize, u64, u64)>,
    pub spine: Option<bool>,
    /// Present experts with their checksums, in the order they were (last) published.
    pub experts: Vec<((usize, usize), u64)>,
}

/// Replays a journal's bytes (`origin` names it in errors): what is local, and whether the journal should be
/// rewritten (its tail is torn, or most lines are history).
pub fn replay(bytes: &[u8], origin: &str) -> Result<(Replayed, bool)> {
    let text = String::from_utf8_lossy(bytes);
    let mut r = Replayed::default();
    let mut experts: HashMap<(usize, usize), (u64, usize)> = HashMap::new();
    let complete = text.rfind('\n').map_or("", |i| &text[..i]);
    for (n, line) in complete.lines().enumerate() {
        match Entry::parse(line) {
            Some(Entry::Chunk(f, o, l)) => {
                r.chunks.insert((f, o, l));
            }
            Some(Entry::SpineDone(v)) => r.spine = Some(v),
            Some(Entry::Expert(l, e, h)) => {
                experts.insert((l, e), (h, n));
            }
            Some(Entry::Evict(l, e)) => {
                experts.remove(&(l, e));
            }
            None => bail!(
                "{origin} line {}: {line:?} is not a journal entry; the mirror's state is damaged — delete the directory and fetch again",
                n + 1
            ),
        }
    }
    let mut ordered: Vec<_> = experts.into_iter().collect();
    ordered.sort_by_key(|(_, (_, n))| *n);
    r.experts = ordered.into_iter().map(|(k, (h, _))| (k, h)).collect();
    // Rewrite when most lines are history (evictions, re-fetches) or the tail is torn.
    let live = r.chunks.len() + r.experts.len() + 1;
    let rewrite = complete.len() != text.len() || complete.lines().count() > 2 * live + 1024;
    Ok((r, rewrite))
}

pub struct Journal {
    path: PathBuf,
    file: File,
}

impl Journal {
    /// Opens (creating) the journal and replays it.
    pub fn open(path: &Path) -> Result<(Journal, Replayed)> {
        let text = match std::fs::read(path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        let (r, torn_or_long) = replay(&text, &path.display().to_string())?;
        let mut journal = Journal {
            path: path.to_path_buf(),
            file: Self::append_handle(path)?,
        };
        if torn_or_long {
            journal.rewrite(&r)?;
        }
        Ok((journal, r))
    }

    fn append_handle(path: &Path) -> Result<File> {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {} for appending", path.display()))
    }

    /// Appends `entries` durably.
    pub fn append(&mut self, entries: &[Entry]) -> Result<()> {
        let text: String = entries.iter().map(Entry::line).collect();
        self.file
            .write_all(text.as_bytes())
            .and_then(|_| self.file.sync_data())
            .with_context(|| format!("cannot write {}", self.path.display()))
    }

    /// Replaces the journal with exactly the facts of `r`, atomically.
    pub fn rewrite(&mut self, r: &Replayed) -> Result<()> {
        let mut chunks: Vec<_> = r.chunks.iter().copied().collect();
        chunks.sort_unstable();
        let mut text: String = chunks
            .into_iter()
            .map(|(f, o, l)| Entry::Chunk(f, o, l).line())
            .collect();
        if let Some(v) = r.spine {
            text += &Entry::SpineDone(v).line();
        }
        for &((l, e), h) in &r.experts {
            text += &Entry::Expert(l, e, h).line();
        }
        deltafin_formats::write_atomically(&self.path, text.as_bytes())?;
        self.file = Self::append_handle(&self.path)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replay_keeps_durable_facts_and_drops_a_torn_tail() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("journal");
        {
            let (mut j, r) = Journal::open(&p).unwrap();
            assert!(r.chunks.is_empty() && r.spine.is_none() && r.experts.is_empty());
            j.append(&[
                Entry::Chunk(0, 4096, 100),
                Entry::Expert(1, 7, 0xabc),
                Entry::Expert(1, 3, 0xdef),
                Entry::Evict(1, 7),
                Entry::SpineDone(true),
            ])
            .unwrap();
        }
        // A crash in the middle of the next append.
        std::fs::OpenOptions::new()
            .append(true)
            .open(&p)
            .unwrap()
            .write_all(b"expert 2 5 00")
            .unwrap();
        let (_, r) = Journal::open(&p).unwrap();
        assert_eq!(r.chunks, HashSet::from([(0, 4096, 100)]));
        assert_eq!(r.spine, Some(true));
        assert_eq!(r.experts, vec![((1, 3), 0xdef)]);
        // The torn tail was cut off by the rewrite.
        assert!(std::fs::read_to_string(&p).unwrap().ends_with('\n'));
    }

    #[test]
    fn damage_is_reported_with_the_line() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("journal");
        std::fs::write(&p, "chunk 0 0 8\nbanana\n").unwrap();
        let err = Journal::open(&p).err().unwrap().to_string();
        assert!(err.contains("line 2") && err.contains("banana"), "{err}");
    }
}
