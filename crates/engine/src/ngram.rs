//! Prompt lookup: guesses for any model, with no second checkpoint. The last few tokens (the history and the
//! token just chosen) are looked for earlier in the same sequence — prompt and generated text alike — and the
//! tokens that followed their latest earlier occurrence are the guesses. Text that repeats (a document quoted
//! back, code being edited, a list's pattern) is guessed well; elsewhere there is no match and no guess.

/// The n-grams looked up, longest first: a longer match is the more specific.
const LONGEST: usize = 6;
const SHORTEST: usize = 2;

/// Up to `n` guesses of the tokens after `history` and `first` (none when its last tokens never occurred
/// before).
pub fn guess(history: &[u32], first: u32, n: usize) -> Vec<u32> {
    let mut seq = Vec::with_capacity(history.len() + 1);
    seq.extend_from_slice(history);
    seq.push(first);
    for len in (SHORTEST..=LONGEST).rev().filter(|&len| len < seq.len()) {
        let tail = &seq[seq.len() - len..];
        let earlier = (0..seq.len() - len)
            .rev()
            .find(|&i| &seq[i..i + len] == tail);
        if let Some(i) = earlier {
            let from = i + len;
            return seq[from..(from + n).min(seq.len())].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::guess;

    #[test]
    fn the_longest_latest_match_gives_what_followed_it() {
        // "1 2 3" occurred twice; the latest occurrence (at 5) was followed by 9 9, the first by 4.
        let history = [1, 2, 3, 4, 0, 1, 2, 3, 9, 9, 7, 1, 2];
        assert_eq!(guess(&history, 3, 3), vec![9, 9, 7]);
        // The 2-gram "7 1" matches nothing earlier; "1 5" neither: no guess.
        assert_eq!(guess(&history, 5, 3), Vec::<u32>::new());
        // A continuation stops at the end of the sequence; it may run into the tail itself.
        assert_eq!(guess(&[5, 6, 5], 6, 4), vec![5, 6]);
        assert_eq!(guess(&[5, 6, 5], 6, 0), Vec::<u32>::new());
    }

    #[test]
    fn a_longer_match_wins_over_a_later_shorter_one() {
        // "2 3" last occurred at 6 (followed by 8), but "1 2 3" only at 0 (followed by 4).
        let history = [1, 2, 3, 4, 0, 0, 2, 3, 8, 1, 2];
        assert_eq!(guess(&history, 3, 1), vec![4]);
    }
}
