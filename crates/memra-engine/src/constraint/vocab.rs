//! The vocabulary as llguidance sees it: a trie of every token's bytes (toktrie), built
//! once per model from our tokenizer.

use std::sync::Arc;

use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::tokenizer::{TokenType, Tokenizer};

/// Our tokenizer's tokens for llguidance: normal tokens by the bytes they decode to,
/// control tokens as toktrie's special tokens (`0xFF` then their text, so that no grammar
/// literal matches them by accident), and every end-of-generation token as an EOS (the
/// mask allows them where the grammar may end).
struct Vocab {
    trie: TokTrie,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Greedy over the trie: llguidance only tokenizes to force tokens, which we do not
    /// use (see `tokenize_is_canonical`).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    /// Our BPE is not greedy, so llguidance must not take the trie's tokenization as the
    /// model's.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The trie over `tok`'s vocabulary.
pub fn token_env(tok: &Tokenizer) -> TokEnv {
    let n = tok.n_vocab() as u32;
    let words: Vec<Vec<u8>> = (0..n)
        .map(|id| match tok.token_type(id) {
            Some(TokenType::Control) => {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                w.extend_from_slice(tok.token_text(id).unwrap_or_default().as_bytes());
                w
            }
            // Unused slots (padding of the vocabulary) decode to nothing: never allowed.
            Some(TokenType::Unused) => Vec::new(),
            _ => tok.token_bytes(id, false).unwrap_or_default(),
        })
        .collect();
    let mut eos: Vec<TokenId> = (0..n).filter(|&t| tok.is_end_of_generation(t)).collect();
    if eos.is_empty() {
        // A vocabulary without one: the trie needs an EOS; the grammar's end stops it.
        eos.push(tok.eos.filter(|&e| e < n).unwrap_or(0));
    }
    let first = eos[0];
    let info = TokRxInfo {
        tok_bos: tok.bos,
        ..TokRxInfo::new(n, first)
    };
    let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
    Arc::new(Vocab { trie })
}
