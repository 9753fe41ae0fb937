//! Prompt lookup: drafts from the sequence itself. The last `n` tokens are looked for
//! earlier in the prompt and output (the most recent match first, shorter n-grams when the
//! longer ones do not occur); the tokens that followed the match are the draft. It pays
//! where outputs copy their input: code editing, summaries, extraction.

/// Up to `max` tokens that followed the most recent earlier occurrence of the sequence's
/// last `n` tokens (trying `n`, then `n - 1`, down to 1); empty when none occurs. The copy
/// runs on into the draft itself where the match is recent (as LZ77 copies overlap): text
/// that repeats with a period of p tokens drafts the whole `max`, not p (a loop of two
/// tokens had drafted one a step on the H200).
pub fn propose(tokens: &[u32], n: usize, max: usize) -> Vec<u32> {
    let len = tokens.len();
    for size in (1..=n.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - size..];
        // Matches ending before the tail itself, most recent first.
        if let Some(start) = (0..len - size)
            .rev()
            .find(|&s| &tokens[s..s + size] == tail)
        {
            let from = start + size;
            let mut draft: Vec<u32> = Vec::with_capacity(max);
            for i in from..from + max {
                draft.push(if i < len { tokens[i] } else { draft[i - len] });
            }
            return draft;
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_last_match() {
        // "a b c d | a b" -> c d (then the tail itself).
        let t = [1, 2, 3, 4, 9, 1, 2];
        assert_eq!(propose(&t, 2, 2), vec![3, 4]);
        // Past the sequence's end the copy goes on through what it drafted.
        assert_eq!(propose(&t, 2, 7), vec![3, 4, 9, 1, 2, 3, 4]);
        // The most recent of two matches.
        let t = [1, 2, 5, 1, 2, 6, 1, 2];
        assert_eq!(propose(&t, 2, 1), vec![6]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_to_nothing() {
        // "7 2" never occurred before, "2" did.
        let t = [1, 2, 3, 7, 2];
        assert_eq!(propose(&t, 2, 2), vec![3, 7]);
        assert_eq!(propose(&[1, 2, 3], 3, 4), Vec::<u32>::new());
        assert_eq!(propose(&[5], 2, 4), Vec::<u32>::new());
        assert_eq!(propose(&[], 2, 4), Vec::<u32>::new());
        // A run of one token, or a loop of two, drafts as many as asked.
        assert_eq!(propose(&[4, 4, 4], 2, 3), vec![4, 4, 4]);
        assert_eq!(propose(&[7, 1, 2, 1, 2], 3, 5), vec![1, 2, 1, 2, 1]);
    }

    /// Against a brute-force reading of the rule on random short sequences.
    #[test]
    fn matches_a_brute_force_search() {
        let mut seed = 99u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
            (seed >> 33) as u32 % 4
        };
        for _ in 0..2000 {
            let len = (next() * 3 + next()) as usize;
            let t: Vec<u32> = (0..len).map(|_| next()).collect();
            let (n, max) = (1 + next() as usize, 1 + next() as usize);
            let mut want = Vec::new();
            'sizes: for size in (1..=n).rev() {
                if size >= len {
                    continue;
                }
                for start in (0..len - size).rev() {
                    if t[start..start + size] == t[len - size..] {
                        // Extend the sequence by copying, then take what was copied.
                        let mut ext = t.clone();
                        for i in 0..max {
                            ext.push(ext[start + size + i]);
                        }
                        want = ext[len..].to_vec();
                        break 'sizes;
                    }
                }
            }
            assert_eq!(propose(&t, n, max), want, "{t:?} n={n} max={max}");
        }
    }
}
