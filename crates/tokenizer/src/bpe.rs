//! Rank BPE over the bytes of one piece, with tiktoken's semantics.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Appends the ids of `piece` to `out`: start from single bytes and repeatedly merge the adjacent pair
/// whose concatenation has the lowest rank (leftmost on ties) until no adjacent pair is a token.
///
/// tiktoken rescans all pairs after every merge (quadratic in the piece length); a heap of candidate pairs
/// with lazy invalidation picks the same pair each step in O(n log n), so long pieces stay cheap.
/// `byte_rank[b]` must be the rank of the single byte `b` (the loader checks all 256 exist).
pub(crate) fn encode_piece(
    piece: &[u8],
    ranks: &HashMap<Vec<u8>, u32>,
    byte_rank: &[u32; 256],
    out: &mut Vec<u32>,
) {
    let n = piece.len();
    if n <= 1 {
        out.extend(piece.iter().map(|&b| byte_rank[b as usize]));
        return;
    }
    // Parts are identified by their start offset: `end[s]` is the end of the part starting at s, 0 once
    // s is no longer a part start; `prev[s]` is the start of the part before it.
    let mut end: Vec<usize> = (1..=n).collect();
    let mut prev: Vec<Option<usize>> = (0..n).map(|i| i.checked_sub(1)).collect();
    // Candidates (rank, left start, right end). A rank depends only on the bytes of the span, so an
    // entry is valid exactly when its span is still two adjacent parts.
    let mut heap = BinaryHeap::new();
    for i in 0..n - 1 {
        if let Some(&r) = ranks.get(&piece[i..i + 2]) {
            heap.push(Reverse((r, i, i + 2)));
        }
    }
    while let Some(Reverse((_, start, span_end))) = heap.pop() {
        let mid = end[start];
        if mid == 0 || mid >= n || end[mid] != span_end {
            continue;
        }
        end[start] = span_end;
        end[mid] = 0;
        if span_end < n {
            prev[span_end] = Some(start);
            let next_end = end[span_end];
            if let Some(&r) = ranks.get(&piece[start..next_end]) {
                heap.push(Reverse((r, start, next_end)));
            }
        }
        if let Some(p) = prev[start] {
            if let Some(&r) = ranks.get(&piece[p..span_end]) {
                heap.push(Reverse((r, p, span_end)));
            }
        }
    }
    let mut start = 0;
    while start < n {
        let e = end[start];
        // Every surviving part is a single byte or the product of a merge, so it has a rank.
        out.push(if e == start + 1 {
            byte_rank[piece[start] as usize]
        } else {
            ranks[&piece[start..e]]
        });
        start = e;
    }
}

#[cfg(test)]
mod tests {
    use super::encode_piece;
    use std::collections::HashMap;

    /// tiktoken's algorithm written the slow, obvious way, as an oracle for the heap version.
    fn reference(piece: &[u8], ranks: &HashMap<Vec<u8>, u32>) -> Vec<u32> {
        let mut parts: Vec<Vec<u8>> = piece.iter().map(|&b| vec![b]).collect();
        loop {
            let best = (0..parts.len().saturating_sub(1))
                .filter_map(|i| {
                    ranks
                        .get(&[&parts[i][..], &parts[i + 1][..]].concat())
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = parts.remove(i + 1);
            parts[i].extend(right);
        }
        parts.iter().map(|p| ranks[p]).collect()
    }

    #[test]
    fn heap_merge_matches_quadratic_reference() {
        let mut vocab: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for t in [
            "ab", "bc", "abc", "aa", "aaa", "aaaa", "ca", "bca", "cab", "abca", "bb",
        ] {
            vocab.push(t.as_bytes().to_vec());
        }
        let ranks: HashMap<Vec<u8>, u32> = vocab.iter().cloned().zip(0..).collect();
        let byte_rank: [u32; 256] = std::array::from_fn(|b| b as u32);
        // A deterministic pseudo-random stream over a small alphabet exercises ties and chains of merges.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 0..200 {
            let piece: Vec<u8> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    b"aabbc"[(x % 5) as usize]
                })
                .collect();
            let mut got = Vec::new();
            encode_piece(&piece, &ranks, &byte_rank, &mut got);
            assert_eq!(
                got,
                reference(&piece, &ranks),
                "piece {:?}",
                String::from_utf8_lossy(&piece)
            );
        }
    }
}
