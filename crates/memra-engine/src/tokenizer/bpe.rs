//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`): each pre-tokenized word is mapped
//! byte by byte to GPT-2's alphabet, then adjacent symbols are merged by merge rank,
//! lowest rank first, leftmost first among equals (llama.cpp `llm_tokenizer_bpe`).
//!
//! Merging runs on a linked list with a heap of candidate pairs, so a word of n
//! characters costs O(n log n): a megabyte without a space must not take minutes.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use super::unicode::byte_to_char;
use super::TokenizerError;

pub struct BytePairEncoder {
    /// `(left, right) -> (rank, merged)`, for merges whose parts and result are tokens.
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// The token of each byte's GPT-2 character.
    byte_tokens: [Option<u32>; 256],
    byte_chars: [char; 256],
    /// Take a word that is itself a token without merging (Llama 3).
    ignore_merges: bool,
}

impl BytePairEncoder {
    pub fn new(
        merges: &[&str],
        token_id: &HashMap<String, u32>,
        ignore_merges: bool,
    ) -> Result<BytePairEncoder, TokenizerError> {
        let mut table = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            // The first space separates the parts; GPT-2 characters contain no spaces.
            let Some((a, b)) = m.split_once(' ') else {
                return Err(TokenizerError::Invalid(format!(
                    "merge {rank} {m:?} is not two space-separated parts"
                )));
            };
            let (Some(&l), Some(&r), Some(&joined)) = (
                token_id.get(a),
                token_id.get(b),
                token_id.get(&format!("{a}{b}")),
            ) else {
                // llama.cpp keeps such merges, but they can never apply: a symbol that is not
                // a token never forms, and a result that is not a token cannot be emitted.
                continue;
            };
            table.entry((l, r)).or_insert((rank as u32, joined));
        }
        let byte_chars = byte_to_char();
        let byte_tokens = byte_chars.map(|c| token_id.get(c.to_string().as_str()).copied());
        Ok(BytePairEncoder {
            merges: table,
            byte_tokens,
            byte_chars,
            ignore_merges,
        })
    }

    /// The word in GPT-2's alphabet.
    fn mapped(&self, word: &[u8]) -> String {
        word.iter().map(|&b| self.byte_chars[b as usize]).collect()
    }

    /// Appends the tokens of one pre-tokenized word.
    pub fn encode_word(
        &self,
        word: &[u8],
        token_id: &HashMap<String, u32>,
        unknown: Option<u32>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        if self.ignore_merges {
            if let Some(&id) = token_id.get(&self.mapped(word)) {
                out.push(id);
                return Ok(());
            }
        }
        let mut symbols = Vec::with_capacity(word.len());
        for &b in word {
            match (self.byte_tokens[b as usize], unknown) {
                (Some(id), _) | (None, Some(id)) => symbols.push(id),
                (None, None) => {
                    return Err(TokenizerError::Invalid(format!(
                        "the vocabulary has no token for byte 0x{b:02x} and no unknown token"
                    )))
                }
            }
        }
        merge(&mut symbols, &self.merges);
        out.extend_from_slice(&symbols);
        Ok(())
    }
}

/// Applies merges to `symbols` in rank order, in place.
fn merge(symbols: &mut Vec<u32>, merges: &HashMap<(u32, u32), (u32, u32)>) {
    let n = symbols.len();
    if n < 2 {
        return;
    }
    const NONE: usize = usize::MAX;
    let mut next: Vec<usize> = (1..=n).map(|i| if i == n { NONE } else { i }).collect();
    let mut prev: Vec<usize> = (0..n).map(|i| if i == 0 { NONE } else { i - 1 }).collect();
    let mut alive = vec![true; n];
    // Candidates: (rank, left position) smallest first; validated when popped.
    let mut heap = BinaryHeap::new();
    let push = |heap: &mut BinaryHeap<_>, sym: &[u32], l: usize, r: usize| {
        if let Some(&(rank, _)) = merges.get(&(sym[l], sym[r])) {
            heap.push(Reverse((rank, l, sym[l], sym[r])));
        }
    };
    for i in 0..n - 1 {
        push(&mut heap, symbols, i, i + 1);
    }
    while let Some(Reverse((rank, l, left_id, right_id))) = heap.pop() {
        let r = next[l];
        // Stale: the left symbol was merged away or changed, or its neighbour changed.
        if !alive[l] || r == NONE || symbols[l] != left_id || symbols[r] != right_id {
            continue;
        }
        let (_, merged) = merges[&(left_id, right_id)];
        debug_assert_eq!(merges[&(left_id, right_id)].0, rank);
        symbols[l] = merged;
        alive[r] = false;
        next[l] = next[r];
        if next[r] != NONE {
            prev[next[r]] = l;
        }
        if prev[l] != NONE {
            push(&mut heap, symbols, prev[l], l);
        }
        if next[l] != NONE {
            push(&mut heap, symbols, l, next[l]);
        }
    }
    let mut out = Vec::with_capacity(n);
    let mut i = 0;
    while i != NONE {
        out.push(symbols[i]);
        i = next[i];
    }
    *symbols = out;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference: the quadratic textbook loop (merge the best-ranked leftmost pair, repeat).
    fn merge_naive(mut s: Vec<u32>, merges: &HashMap<(u32, u32), (u32, u32)>) -> Vec<u32> {
        loop {
            let best = (0..s.len().saturating_sub(1))
                .filter_map(|i| merges.get(&(s[i], s[i + 1])).map(|&(rank, m)| (rank, i, m)))
                .min();
            match best {
                Some((_, i, m)) => {
                    s[i] = m;
                    s.remove(i + 1);
                }
                None => return s,
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn heap_merging_equals_the_textbook_loop(
            word in proptest::collection::vec(0u32..4, 0..40),
            ranks in proptest::collection::vec((0u32..8, 0u32..8, 0u32..100), 0..30),
        ) {
            let mut merges = HashMap::new();
            for (i, (a, b, _)) in ranks.iter().enumerate() {
                merges.entry((*a, *b)).or_insert((i as u32, 8 + i as u32 % 4));
            }
            let mut fast = word.clone();
            merge(&mut fast, &merges);
            proptest::prop_assert_eq!(fast, merge_naive(word, &merges));
        }
    }
}
