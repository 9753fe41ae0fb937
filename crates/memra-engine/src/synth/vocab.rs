//! A working byte-level BPE vocabulary of any size, for synthetic models: the 256 byte
//! tokens of GPT-2's byte-to-unicode alphabet, merges of existing tokens until the vocab is
//! full, and the family's special tokens at the end.

use std::collections::HashSet;

use super::rng::Rng;
use crate::tokenizer::unicode::byte_to_char;

/// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
pub const TOKEN_NORMAL: i32 = 1;
pub const TOKEN_CONTROL: i32 = 3;

#[derive(Clone, Debug)]
pub struct Vocab {
    pub tokens: Vec<String>,
    pub token_types: Vec<i32>,
    /// `"left right"` pairs, in merge priority order.
    pub merges: Vec<String>,
    pub bos: u32,
    pub eos: u32,
}

/// Special tokens of a tokenizer family (`tokenizer.ggml.pre`), padded with reserved ones
/// to 256; returns the names and the (bos, eos) positions among them.
fn specials(pre: &str) -> (Vec<String>, usize, usize) {
    let (named, bos, eos, reserved): (&[&str], usize, usize, &str) = match pre {
        "qwen2" => (
            &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            0,
            0,
            "<|extra_",
        ),
        _ => (
            &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
            0,
            1,
            "<|reserved_special_token_",
        ),
    };
    let mut out: Vec<String> = named.iter().map(|s| s.to_string()).collect();
    let mut i = 0;
    while out.len() < 256 {
        out.push(format!("{reserved}{i}|>"));
        i += 1;
    }
    (out, bos, eos)
}

/// A vocabulary of exactly `n_vocab` tokens (at least 512).
pub fn byte_level_bpe(n_vocab: usize, pre: &str, seed: u64) -> Vocab {
    const MAX_TOKEN_CHARS: usize = 16;
    let (special, bos, eos) = specials(pre);
    assert!(n_vocab >= 256 + special.len(), "vocab too small");
    let n_normal = n_vocab - special.len();
    let mut tokens: Vec<String> = byte_to_char().iter().map(|c| c.to_string()).collect();
    let mut lens: Vec<usize> = vec![1; 256];
    let mut seen: HashSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::with_capacity(n_normal - 256);
    let mut rng = Rng::new(seed, 0xB0CA);
    while tokens.len() < n_normal {
        // Squared uniform draws favour early (short) tokens, as real merge lists do.
        let n = tokens.len() as u64;
        let pick = |rng: &mut Rng| (rng.below(n) * rng.below(n) / n) as usize;
        let (a, b) = (pick(&mut rng), pick(&mut rng));
        if lens[a] + lens[b] > MAX_TOKEN_CHARS {
            continue;
        }
        let joined = format!("{}{}", tokens[a], tokens[b]);
        if seen.contains(&joined) {
            continue;
        }
        merges.push(format!("{} {}", tokens[a], tokens[b]));
        seen.insert(joined.clone());
        lens.push(lens[a] + lens[b]);
        tokens.push(joined);
    }
    let mut token_types = vec![TOKEN_NORMAL; tokens.len()];
    let first_special = tokens.len() as u32;
    tokens.extend(special);
    token_types.resize(tokens.len(), TOKEN_CONTROL);
    Vocab {
        tokens,
        token_types,
        merges,
        bos: first_special + bos as u32,
        eos: first_special + eos as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_build_only_from_earlier_tokens() {
        let v = byte_level_bpe(2000, "llama-bpe", 7);
        assert_eq!(v.tokens.len(), 2000);
        assert_eq!(v.token_types.len(), 2000);
        assert_eq!(v.tokens[v.bos as usize], "<|begin_of_text|>");
        assert_eq!(v.tokens[v.eos as usize], "<|end_of_text|>");
        let unique: HashSet<&String> = v.tokens.iter().collect();
        assert_eq!(unique.len(), 2000);
        let mut known: HashSet<&str> = v.tokens[..256].iter().map(|s| s.as_str()).collect();
        for (i, m) in v.merges.iter().enumerate() {
            let (a, b) = m.split_once(' ').unwrap();
            assert!(known.contains(a) && known.contains(b), "merge {i} {m:?}");
            let joined = &v.tokens[256 + i];
            assert_eq!(*joined, format!("{a}{b}"));
            known.insert(joined);
        }
        let q = byte_level_bpe(1000, "qwen2", 7);
        assert_eq!(q.bos, q.eos);
        assert_eq!(q.tokens[q.eos as usize], "<|endoftext|>");
    }
}
