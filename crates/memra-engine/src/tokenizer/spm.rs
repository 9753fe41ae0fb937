//! SentencePiece-style BPE by scores (`tokenizer.ggml.model = "llama"`: Llama 2, Gemma):
//! spaces become `▁`, the text is split into characters, and the adjacent pair whose
//! concatenation is the best-scoring token is merged first (ties: leftmost). Only pairs that
//! form tokens merge, so what is left that is not a token is a single character, which is
//! written as its `<0xNN>` byte tokens (llama.cpp `llm_tokenizer_spm`; its `rev_merge`
//! re-split never fires for that reason and has no counterpart here).

use std::collections::{BinaryHeap, HashMap};

use super::TokenizerError;

/// SentencePiece's visible space.
pub const SPACE_MARKER: char = '\u{2581}';

pub struct SentencePiece {
    /// `<0xNN>` tokens, for bytes of pieces that are not in the vocabulary.
    byte_tokens: [Option<u32>; 256],
}

#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge; the heap pops the best score, then the leftmost.
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    len: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl SentencePiece {
    pub fn new(token_id: &HashMap<String, u32>) -> SentencePiece {
        SentencePiece {
            byte_tokens: std::array::from_fn(|b| token_id.get(&format!("<0x{b:02X}>")).copied()),
        }
    }

    /// Appends the tokens of `text` (spaces already replaced by `▁`).
    pub fn encode(
        &self,
        text: &str,
        token_id: &HashMap<String, u32>,
        scores: &[f32],
        unknown: Option<u32>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        let mut symbols: Vec<Symbol> = Vec::new();
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            });
        }
        if let Some(last) = symbols.last_mut() {
            last.next = None;
        }
        let mut heap = BinaryHeap::new();
        let try_pair = |heap: &mut BinaryHeap<Bigram>,
                        symbols: &[Symbol],
                        left: Option<usize>,
                        right: Option<usize>| {
            let (Some(l), Some(r)) = (left, right) else {
                return;
            };
            let piece = &text[symbols[l].start..symbols[r].start + symbols[r].len];
            if let Some(&id) = token_id.get(piece) {
                heap.push(Bigram {
                    score: scores[id as usize],
                    left: l,
                    right: r,
                    len: piece.len(),
                });
            }
        };
        for i in 1..symbols.len() {
            try_pair(&mut heap, &symbols, Some(i - 1), Some(i));
        }
        while let Some(b) = heap.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale: one side was merged into something else since.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.len {
                continue;
            }
            symbols[b.left].len += r.len;
            symbols[b.right].len = 0;
            symbols[b.left].next = r.next;
            if let Some(n) = r.next {
                symbols[n].prev = Some(b.left);
            }
            let (prev, next) = (symbols[b.left].prev, symbols[b.left].next);
            try_pair(&mut heap, &symbols, prev, Some(b.left));
            try_pair(&mut heap, &symbols, Some(b.left), next);
        }
        let mut i = if symbols.is_empty() { None } else { Some(0) };
        while let Some(s) = i {
            let sym = symbols[s];
            let piece = &text[sym.start..sym.start + sym.len];
            match token_id.get(piece) {
                Some(&id) => out.push(id),
                None => self.bytes(piece, unknown, out)?,
            }
            i = sym.next;
        }
        Ok(())
    }

    fn bytes(
        &self,
        piece: &str,
        unknown: Option<u32>,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        for &b in piece.as_bytes() {
            match (self.byte_tokens[b as usize], unknown) {
                (Some(id), _) | (None, Some(id)) => out.push(id),
                (None, None) => {
                    return Err(TokenizerError::Invalid(format!(
                        "no token for byte 0x{b:02x} and no unknown token"
                    )))
                }
            }
        }
        Ok(())
    }
}
