//! A small deterministic BPE trainer, for test checkpoints only.

use crate::pretok::pretokenize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};

type Pair = (u32, u32);

/// Learns a byte-level BPE vocabulary on `corpus` and returns up to `n_ranks` tokens in rank order:
/// the 256 single bytes first (rank = byte value), then one token per merge.
///
/// The corpus is cut with the Kimi pre-tokenizer and merges never cross pieces. Each step merges the
/// most frequent adjacent pair (overlapping occurrences such as the two in "aaa" both count); ties go
/// to the lexicographically smallest (left bytes, right bytes). A merge whose bytes already form a token
/// (e.g. "a"+"bc" after "ab"+"c") reuses that token and adds no rank.
///
/// Returns fewer than `n_ranks` tokens when the corpus runs out of pairs (every piece is one token), and
/// only the first `n_ranks` bytes when `n_ranks < 256` (too few for a usable tokenizer).
pub fn train_bpe(corpus: &str, n_ranks: usize) -> Vec<Vec<u8>> {
    let mut tokens: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    if n_ranks <= tokens.len() {
        tokens.truncate(n_ranks);
        return tokens;
    }
    let mut ids: HashMap<Vec<u8>, u32> = tokens.iter().cloned().zip(0..).collect();

    // Distinct pieces with their frequencies; a BTreeMap keeps the word order deterministic.
    let mut freq: BTreeMap<&str, i64> = BTreeMap::new();
    for piece in pretokenize(corpus) {
        *freq.entry(piece).or_default() += 1;
    }
    let mut words: Vec<(Vec<u32>, i64)> = freq
        .into_iter()
        .map(|(w, f)| (w.bytes().map(u32::from).collect(), f))
        .collect();

    let mut counts: HashMap<Pair, i64> = HashMap::new();
    // Words that contained a pair at some point; may hold stale entries, which merging skips.
    let mut holders: HashMap<Pair, BTreeSet<usize>> = HashMap::new();
    for (w, (word, f)) in words.iter().enumerate() {
        for pair in word.windows(2).map(|p| (p[0], p[1])) {
            *counts.entry(pair).or_default() += f;
            holders.entry(pair).or_default().insert(w);
        }
    }
    // Max-heap on (count, smallest bytes); entries whose count is out of date are skipped when popped.
    let key = |tokens: &[Vec<u8>], pair: Pair, count: i64| {
        let (a, b) = (
            tokens[pair.0 as usize].clone(),
            tokens[pair.1 as usize].clone(),
        );
        (count, Reverse((a, b)), pair)
    };
    let mut heap: BinaryHeap<_> = counts.iter().map(|(&p, &c)| key(&tokens, p, c)).collect();

    while tokens.len() < n_ranks {
        let Some((count, _, pair)) = heap.pop() else {
            break;
        };
        if counts.get(&pair) != Some(&count) || count <= 0 {
            continue;
        }
        let merged = [&tokens[pair.0 as usize][..], &tokens[pair.1 as usize][..]].concat();
        let new_id = *ids.entry(merged.clone()).or_insert_with(|| {
            tokens.push(merged);
            (tokens.len() - 1) as u32
        });

        let mut delta: HashMap<Pair, i64> = HashMap::new();
        for w in holders.remove(&pair).unwrap_or_default() {
            let (word, f) = &mut words[w];
            if !word.windows(2).any(|p| (p[0], p[1]) == pair) {
                continue;
            }
            for p in word.windows(2) {
                *delta.entry((p[0], p[1])).or_default() -= *f;
            }
            let mut out = Vec::with_capacity(word.len());
            let mut i = 0;
            while i < word.len() {
                if i + 1 < word.len() && (word[i], word[i + 1]) == pair {
                    out.push(new_id);
                    i += 2;
                } else {
                    out.push(word[i]);
                    i += 1;
                }
            }
            *word = out;
            for p in word.windows(2) {
                let p = (p[0], p[1]);
                *delta.entry(p).or_default() += *f;
                holders.entry(p).or_default().insert(w);
            }
        }
        for (p, d) in delta {
            if d == 0 {
                continue;
            }
            let c = counts.entry(p).or_default();
            *c += d;
            if *c > 0 {
                heap.push(key(&tokens, p, *c));
            }
        }
    }
    tokens
}

#[cfg(test)]
mod tests {
    use super::train_bpe;

    fn strs(tokens: &[Vec<u8>]) -> Vec<String> {
        tokens
            .iter()
            .map(|t| String::from_utf8_lossy(t).into_owned())
            .collect()
    }

    #[test]
    fn learns_hand_checked_merges() {
        // Pieces: "aaab" once, " aab" twice.
        let got = train_bpe("aaab aab aab", 262);
        assert_eq!(
            &got[..256],
            &(0..=255u8).map(|b| vec![b]).collect::<Vec<_>>()[..]
        );
        // Step 1: a+a occurs 2 (in "aaab") + 2 (in " aab" twice) = 4; a+b 1+2 = 3; " "+a 2.
        // Step 2: in "aaab" -> [aa, a, b]; " aab" -> [" ", aa, b]. Counts: aa+b 2, " "+aa 2, aa+a 1, a+b 1.
        //         Tie between (" ", "aa") and ("aa", "b"): " " (0x20) sorts before "a".
        // Step 3: " aa"+b = 2 -> " aab". Then aa+a = 1, a+b = 1: "aa"+"a" < "a"+"b"? "a" < "aa", so a+b
        //         wins first, then aa+ab.
        assert_eq!(strs(&got[256..]), ["aa", " aa", " aab", "ab", "aaab"]);
        // The corpus has no pairs left after that.
        assert_eq!(train_bpe("aaab aab aab", 1000).len(), 261);
    }

    #[test]
    fn deterministic_and_reaches_4096_on_builtin_corpus() {
        let a = train_bpe(crate::builtin_corpus(), 4096);
        assert_eq!(a.len(), 4096);
        assert_eq!(a, train_bpe(crate::builtin_corpus(), 4096));
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert_eq!(distinct.len(), a.len(), "tokens must be distinct");
        // Ranks are a prefix: a smaller budget gives the first merges of the bigger run.
        assert_eq!(train_bpe(crate::builtin_corpus(), 600), a[..600]);
    }

    #[test]
    fn tiny_budgets() {
        assert_eq!(
            train_bpe("hello", 10),
            (0..10u8).map(|b| vec![b]).collect::<Vec<_>>()
        );
        assert_eq!(train_bpe("", 300).len(), 256);
    }
}
