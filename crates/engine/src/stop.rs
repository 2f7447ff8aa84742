//! Text-level stopping, fed by the caller with each token's decoded bytes (the engine's loop never sees the
//! tokenizer): [`StopMatcher`] finds stop strings across token boundaries and holds back bytes that might be
//! the start of one, so a stop string is never emitted. (Turning bytes into text without splitting a
//! character is the tokenizer's `StreamDecoder`.)

/// What one [`StopMatcher::push`] releases.
#[derive(Debug, PartialEq, Eq)]
pub struct Released {
    /// Bytes that can no longer be part of a stop string (when `stopped`: everything before the match).
    pub bytes: Vec<u8>,
    /// A stop string matched (its index among those given to [`StopMatcher::new`]); generation should end,
    /// and nothing after the match is ever released.
    pub stopped: Option<usize>,
}

pub struct StopMatcher {
    /// (index given, bytes), the empty ones left out.
    stops: Vec<(usize, Vec<u8>)>,
    held: Vec<u8>,
    stopped: Option<usize>,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new<S: AsRef<[u8]>>(stops: &[S]) -> StopMatcher {
        StopMatcher {
            stops: stops
                .iter()
                .enumerate()
                .map(|(i, s)| (i, s.as_ref().to_vec()))
                .filter(|(_, s)| !s.is_empty())
                .collect(),
            held: Vec::new(),
            stopped: None,
        }
    }

    pub fn push(&mut self, bytes: &[u8]) -> Released {
        if self.stopped.is_some() {
            return Released {
                bytes: Vec::new(),
                stopped: self.stopped,
            };
        }
        self.held.extend_from_slice(bytes);
        // The earliest match; of two at one place, the first given.
        let first_match = self
            .stops
            .iter()
            .filter_map(|(i, s)| find(&self.held, s).map(|at| (at, *i)))
            .min();
        if let Some((at, i)) = first_match {
            self.stopped = Some(i);
            let mut before = std::mem::take(&mut self.held);
            before.truncate(at);
            return Released {
                bytes: before,
                stopped: self.stopped,
            };
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let keep = self
            .stops
            .iter()
            .map(|(_, s)| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .find(|&k| self.held.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let tail = self.held.split_off(self.held.len() - keep);
        Released {
            bytes: std::mem::replace(&mut self.held, tail),
            stopped: None,
        }
    }

    /// At the end of generation: the held-back bytes (they never completed a stop string).
    pub fn flush(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.held)
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `pieces` and returns (released text, the stop that matched).
    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let mut m = StopMatcher::new(stops);
        let mut out = Vec::new();
        for p in pieces {
            let r = m.push(p.as_bytes());
            out.extend(r.bytes);
            if r.stopped.is_some() {
                return (String::from_utf8(out).unwrap(), r.stopped);
            }
        }
        out.extend(m.flush());
        (String::from_utf8(out).unwrap(), None)
    }

    #[test]
    fn a_stop_split_across_tokens_is_found_and_never_released() {
        assert_eq!(
            run(&["END"], &["hello E", "N", "D tail"]),
            ("hello ".into(), Some(0))
        );
        assert_eq!(run(&["\n\n"], &["a\n", "\nb"]), ("a".into(), Some(0)));
    }

    #[test]
    fn a_false_start_is_released_once_it_cannot_match() {
        let mut m = StopMatcher::new(&["abc"]);
        assert_eq!(m.push(b"xa").bytes, b"x");
        assert_eq!(m.push(b"b").bytes, b"");
        assert_eq!(m.push(b"d").bytes, b"abd");
        assert_eq!(run(&["abc"], &["ab"]), ("ab".into(), None));
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(run(&["zz", "b"], &["abzz"]), ("a".into(), Some(1)));
        assert_eq!(run(&["", "q"], &["qabc"]), ("".into(), Some(1)));
        assert_eq!(run(&["ab", "a"], &["xab"]), ("x".into(), Some(0)));
        assert_eq!(run(&["", "q"], &["abc"]), ("abc".into(), None));
    }
}
