//! Tokenizers built from a GGUF file's `tokenizer.ggml.*` metadata, giving the token ids
//! llama.cpp gives for the same file.
//!
//! Why our own code rather than the `tokenizers` crate: GGUF carries the vocabulary as
//! arrays, not as `tokenizer.json`; SentencePiece vocabularies come with scores and no
//! merges, which `tokenizers`' BPE cannot use; and llama.cpp's rules around special tokens
//! (which token types are matched in raw text, with and without `parse_special`, the space
//! prefix after a special token) are its own. Matching llama.cpp id for id is the contract,
//! so the rules live here, each with the llama.cpp function it mirrors.

mod bpe;
mod decoder;
mod pretokenize;
mod spm;
pub mod template;
pub mod unicode;

use std::collections::HashMap;

use memra_gguf::{Metadata, MetadataError};

use bpe::BytePairEncoder;
pub use decoder::IncrementalDecoder;
pub use pretokenize::PreTokenizer;
use spm::{SentencePiece, SPACE_MARKER};

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error("unknown tokenizer model {0:?} (supported: gpt2, llama)")]
    UnknownModel(String),
    #[error(
        "unknown pre-tokenizer {0:?} (tokenizer.ggml.pre); memra does not guess how to split text"
    )]
    UnknownPreTokenizer(String),
    #[error("{what} id {id} is outside the {n_vocab}-token vocabulary")]
    IdOutOfRange {
        what: &'static str,
        id: i64,
        n_vocab: usize,
    },
    #[error("invalid tokenizer data: {0}")]
    Invalid(String),
}

/// `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_code(code: i64) -> TokenType {
        match code {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Tokens matched as a whole in the input text (llama.cpp `cache_special_tokens`).
    fn is_special(self) -> bool {
        matches!(
            self,
            TokenType::Control | TokenType::UserDefined | TokenType::Unknown
        )
    }
}

enum Model {
    Bpe {
        encoder: Box<BytePairEncoder>,
        pre: PreTokenizer,
    },
    Spm {
        encoder: Box<SentencePiece>,
        scores: Vec<f32>,
        add_space_prefix: bool,
    },
}

/// A piece of the input after special tokens are cut out.
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

pub struct Tokenizer {
    model: Model,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    token_id: HashMap<String, u32>,
    /// Special tokens, longest text first.
    specials: Vec<u32>,
    /// Ranks in `specials` of the tokens starting with each byte.
    specials_by_first_byte: Vec<Vec<usize>>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    unknown: Option<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    /// Tokens that end a generation: EOS, EOT and the like.
    end_of_generation: Vec<u32>,
}

/// Token texts that end a turn in common chat formats, besides EOS.
const END_OF_TURN_TEXTS: [&str; 6] = [
    "<|eot_id|>",
    "<|im_end|>",
    "<end_of_turn>",
    "<|end|>",
    "<|endoftext|>",
    "<|eom_id|>",
];

/// Fill-in-the-middle tokens of a code model: a prompt of prefix, suffix and the middle
/// marker, after which the model writes the middle; repository-level context where the
/// model has its markers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FimTokens {
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// Starts the repository's name (Qwen2.5-Coder's `<|repo_name|>`).
    pub repo: Option<u32>,
    /// Starts each file of the context (`<|file_sep|>`).
    pub file_sep: Option<u32>,
}

/// The FIM markers' texts in the vocabularies that have them: (prefix, suffix, middle).
const FIM_TEXTS: [(&str, &str, &str); 4] = [
    // Qwen2.5-Coder, CodeGemma, StarCoder2's GGUF conversions.
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    // StarCoder, SantaCoder.
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    // DeepSeek-Coder: begin, hole, end.
    (
        "<\u{ff5c}fim\u{2581}begin\u{ff5c}>",
        "<\u{ff5c}fim\u{2581}hole\u{ff5c}>",
        "<\u{ff5c}fim\u{2581}end\u{ff5c}>",
    ),
    // Code Llama (SentencePiece pieces).
    ("\u{2581}<PRE>", "\u{2581}<SUF>", "\u{2581}<MID>"),
];

impl Tokenizer {
    /// The model's fill-in-the-middle tokens, if its vocabulary has a known set.
    pub fn fim(&self) -> Option<FimTokens> {
        FIM_TEXTS.iter().find_map(|&(p, s, m)| {
            Some(FimTokens {
                prefix: self.token_id(p)?,
                suffix: self.token_id(s)?,
                middle: self.token_id(m)?,
                repo: self.token_id("<|repo_name|>"),
                file_sep: self.token_id("<|file_sep|>"),
            })
        })
    }

    /// Builds the tokenizer a GGUF file describes.
    pub fn from_metadata(m: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let model_name = m.require(m.get_str("tokenizer.ggml.model"), "tokenizer.ggml.model")?;
        let tokens: Vec<String> = m
            .require(
                m.get_str_array("tokenizer.ggml.tokens"),
                "tokenizer.ggml.tokens",
            )?
            .into_iter()
            .map(str::to_owned)
            .collect();
        let n = tokens.len();
        if n == 0 {
            return Err(TokenizerError::Invalid("empty vocabulary".into()));
        }
        let types: Vec<TokenType> = match m.get_i64_array("tokenizer.ggml.token_type")? {
            Some(t) if t.len() == n => t.into_iter().map(TokenType::from_code).collect(),
            Some(t) => {
                return Err(TokenizerError::Invalid(format!(
                    "{} token types for {n} tokens",
                    t.len()
                )))
            }
            None => vec![TokenType::Normal; n],
        };
        let mut token_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // The first of duplicate texts wins, as in llama.cpp's `token_to_id`.
            token_id.entry(t.clone()).or_insert(i as u32);
        }
        let id = |key: &'static str, what: &'static str| -> Result<Option<u32>, TokenizerError> {
            match m.get_i64(key)? {
                None => Ok(None),
                // -1 is how some converters write "none".
                Some(-1) => Ok(None),
                Some(v) if v >= 0 && (v as usize) < n => Ok(Some(v as u32)),
                Some(v) => Err(TokenizerError::IdOutOfRange {
                    what,
                    id: v,
                    n_vocab: n,
                }),
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id", "BOS")?;
        let eos = id("tokenizer.ggml.eos_token_id", "EOS")?;
        let eot = id("tokenizer.ggml.eot_token_id", "EOT")?;
        let unknown = id("tokenizer.ggml.unknown_token_id", "unknown-token")?;
        let is_spm = match model_name {
            "llama" => true,
            "gpt2" => false,
            other => return Err(TokenizerError::UnknownModel(other.to_string())),
        };
        let add_bos = m
            .get_bool("tokenizer.ggml.add_bos_token")?
            .unwrap_or(is_spm);
        let add_eos = m.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(TokenizerError::Invalid(
                "BOS is to be added but there is no BOS token".into(),
            ));
        }
        if add_eos && eos.is_none() {
            return Err(TokenizerError::Invalid(
                "EOS is to be added but there is no EOS token".into(),
            ));
        }
        let model = if is_spm {
            let scores = m
                .get_f32_array("tokenizer.ggml.scores")?
                .unwrap_or_else(|| vec![0.0; n]);
            if scores.len() != n {
                return Err(TokenizerError::Invalid(format!(
                    "{} scores for {n} tokens",
                    scores.len()
                )));
            }
            Model::Spm {
                encoder: Box::new(SentencePiece::new(&token_id)),
                scores,
                add_space_prefix: m
                    .get_bool("tokenizer.ggml.add_space_prefix")?
                    .unwrap_or(true),
            }
        } else {
            let pre_name = m.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let merges = m.require(
                m.get_str_array("tokenizer.ggml.merges"),
                "tokenizer.ggml.merges",
            )?;
            Model::Bpe {
                encoder: Box::new(BytePairEncoder::new(
                    &merges,
                    &token_id,
                    pretokenize::ignores_merges(pre_name),
                )?),
                pre: PreTokenizer::from_name(pre_name)?,
            }
        };
        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| types[i as usize].is_special() && !tokens[i as usize].is_empty())
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let mut specials_by_first_byte = vec![Vec::new(); 256];
        for (rank, &id) in specials.iter().enumerate() {
            specials_by_first_byte[tokens[id as usize].as_bytes()[0] as usize].push(rank);
        }
        let mut end_of_generation: Vec<u32> = eos.into_iter().chain(eot).collect();
        for text in END_OF_TURN_TEXTS {
            if let Some(&i) = token_id.get(text) {
                if types[i as usize] == TokenType::Control && !end_of_generation.contains(&i) {
                    end_of_generation.push(i);
                }
            }
        }
        Ok(Tokenizer {
            model,
            tokens,
            types,
            token_id,
            specials,
            specials_by_first_byte,
            bos,
            eos,
            unknown,
            add_bos,
            add_eos,
            end_of_generation,
        })
    }

    pub fn n_vocab(&self) -> usize {
        self.tokens.len()
    }

    /// The token's text as stored in the vocabulary.
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.tokens.get(id as usize).map(String::as_str)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }

    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_id.get(text).copied()
    }

    /// Whether generating `id` ends the generation (EOS, EOT, end-of-turn tokens).
    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// Cuts special-token texts out of the input, as llama.cpp's `tokenizer_st_partition`
    /// does: specials are taken longest first, each claiming its occurrences left to right
    /// in the text the longer ones left. Without `parse_special`, control and unknown
    /// tokens stay plain text; user-defined tokens are always matched.
    ///
    /// llama.cpp scans the whole text once per special token, which is slow for vocabularies
    /// with thousands of them (Gemma 3: 6,414); here one pass finds every occurrence through
    /// a first-byte index, and the claiming replays llama.cpp's order on those occurrences.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        let bytes = text.as_bytes();
        let eligible = |id: u32| {
            parse_special
                || !matches!(
                    self.types[id as usize],
                    TokenType::Control | TokenType::Unknown
                )
        };
        // Occurrences of each special token, by its rank in `self.specials`.
        let mut found: Vec<(usize, usize)> = Vec::new(); // (rank, position)
        for (pos, &b) in bytes.iter().enumerate() {
            for &rank in &self.specials_by_first_byte[b as usize] {
                let id = self.specials[rank];
                if eligible(id) && bytes[pos..].starts_with(self.tokens[id as usize].as_bytes()) {
                    found.push((rank, pos));
                }
            }
        }
        if found.is_empty() {
            // Empty text has no fragment at all (no space prefix either).
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text(0, text.len())]
            };
        }
        found.sort_unstable();
        // Claimed spans: start -> (end, token).
        let mut claimed: std::collections::BTreeMap<usize, (usize, u32)> = Default::default();
        let mut last = (usize::MAX, 0); // (rank, end of its previous claim)
        for (rank, pos) in found {
            let id = self.specials[rank];
            let end = pos + self.tokens[id as usize].len();
            if last.0 == rank && pos < last.1 {
                continue; // overlaps this token's previous occurrence
            }
            let before = claimed.range(..end).next_back();
            if before.is_some_and(|(_, &(e, _))| e > pos) {
                continue; // overlaps a longer token's claim
            }
            claimed.insert(pos, (end, id));
            last = (rank, end);
        }
        let mut fragments = Vec::with_capacity(2 * claimed.len() + 1);
        let mut at = 0;
        for (start, (end, id)) in claimed {
            if start > at {
                fragments.push(Fragment::Text(at, start));
            }
            fragments.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            fragments.push(Fragment::Text(at, text.len()));
        }
        fragments
    }

    /// Text to token ids. `add_special` adds BOS/EOS as the model asks; `parse_special`
    /// turns special-token text in the input into those tokens.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos.expect("checked at load"));
        }
        match &self.model {
            Model::Bpe { encoder, pre } => {
                for f in self.partition(text, parse_special) {
                    match f {
                        Fragment::Token(id) => out.push(id),
                        Fragment::Text(s, e) => {
                            let piece = &text[s..e];
                            for (ws, we) in pre.split(piece)? {
                                encoder.encode_word(
                                    &piece.as_bytes()[ws..we],
                                    &self.token_id,
                                    self.unknown,
                                    &mut out,
                                )?;
                            }
                        }
                    }
                }
            }
            Model::Spm {
                encoder,
                scores,
                add_space_prefix,
            } => {
                // llama.cpp prefixes a space to text at the start and after each special
                // token, when the vocabulary asks for a space prefix.
                let mut after_special = true;
                for f in self.partition(text, parse_special) {
                    match f {
                        Fragment::Token(id) => {
                            out.push(id);
                            after_special = true;
                        }
                        Fragment::Text(s, e) => {
                            let mut piece = String::with_capacity(e - s + 3);
                            if *add_space_prefix && after_special {
                                piece.push(SPACE_MARKER);
                            }
                            piece.extend(text[s..e].chars().map(|c| {
                                if c == ' ' {
                                    SPACE_MARKER
                                } else {
                                    c
                                }
                            }));
                            encoder.encode(
                                &piece,
                                &self.token_id,
                                scores,
                                self.unknown,
                                &mut out,
                            )?;
                            after_special = false;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.expect("checked at load"));
        }
        Ok(out)
    }

    /// The bytes a token stands for (llama.cpp `token_to_piece`). Control tokens give their
    /// text only with `special`, nothing otherwise.
    pub fn token_bytes(&self, id: u32, special: bool) -> Result<Vec<u8>, TokenizerError> {
        let (Some(text), Some(ty)) = (self.token_text(id), self.token_type(id)) else {
            return Err(TokenizerError::IdOutOfRange {
                what: "token",
                id: id.into(),
                n_vocab: self.n_vocab(),
            });
        };
        let spm = matches!(self.model, Model::Spm { .. });
        Ok(match ty {
            TokenType::Control if !special => Vec::new(),
            TokenType::Control => text.as_bytes().to_vec(),
            TokenType::Unknown if spm => "\u{2585}".as_bytes().to_vec(),
            TokenType::Byte if spm => parse_byte_token(text)
                .map(|b| vec![b])
                .unwrap_or_else(|| text.as_bytes().to_vec()),
            TokenType::UserDefined if !spm => text.as_bytes().to_vec(),
            _ if spm => text.replace(SPACE_MARKER, " ").into_bytes(),
            _ => {
                let mut bytes = Vec::with_capacity(text.len());
                for c in text.chars() {
                    match unicode::char_to_byte(c) {
                        Some(b) => bytes.push(b),
                        // Not GPT-2 alphabet: keep the character itself.
                        None => bytes.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                bytes
            }
        })
    }

    /// Whether decoding drops the leading space of the first text: SentencePiece
    /// vocabularies with a space prefix add one when encoding (llama.cpp `llama_detokenize`).
    pub fn strips_first_space(&self) -> bool {
        matches!(
            self.model,
            Model::Spm {
                add_space_prefix: true,
                ..
            }
        )
    }

    /// Token ids back to bytes, control tokens left out unless `special`.
    pub fn decode(&self, ids: &[u32], special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        let mut first_text = true;
        for &id in ids {
            let piece = self.token_bytes(id, special)?;
            if piece.is_empty() {
                continue;
            }
            let skip = usize::from(first_text && self.strips_first_space() && piece[0] == b' ');
            out.extend_from_slice(&piece[skip..]);
            first_text = false;
        }
        Ok(out)
    }

    /// [`Tokenizer::decode`] as text; invalid UTF-8 becomes U+FFFD.
    pub fn decode_lossy(&self, ids: &[u32], special: bool) -> Result<String, TokenizerError> {
        Ok(String::from_utf8_lossy(&self.decode(ids, special)?).into_owned())
    }
}

/// `<0x0A>` -> 0x0A.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::{string_array, Value, ValueType};

    /// A byte-level vocabulary plus overlapping special tokens of every kind.
    fn tokenizer_with_specials() -> Tokenizer {
        let mut tokens: Vec<String> = unicode::byte_to_char()
            .iter()
            .map(|c| c.to_string())
            .collect();
        let mut types = vec![1i32; tokens.len()];
        for (text, ty) in [
            ("ab", 3),
            ("abc", 4),
            ("bca", 3),
            ("ca", 4),
            ("<x>", 3),
            ("x", 2),
            ("cab", 4),
        ] {
            tokens.push(text.into());
            types.push(ty);
        }
        let mut m = Metadata::new();
        m.set("tokenizer.ggml.model", Value::String("gpt2".into()));
        m.set("tokenizer.ggml.tokens", string_array(tokens));
        m.set(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, types.into_iter().map(Value::I32).collect()),
        );
        m.set("tokenizer.ggml.merges", string_array(Vec::<String>::new()));
        Tokenizer::from_metadata(&m).unwrap()
    }

    /// llama.cpp's partition as written there: one pass over the fragments per token.
    fn partition_naive(
        t: &Tokenizer,
        text: &str,
        parse_special: bool,
    ) -> Vec<(bool, usize, usize)> {
        let mut frags = vec![(false, 0usize, text.len())]; // (is_token, start/id, end)
        for &id in &t.specials {
            let ty = t.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let needle = &t.tokens[id as usize];
            let mut next = Vec::new();
            for f in frags {
                if f.0 {
                    next.push(f);
                    continue;
                }
                let (mut s, e) = (f.1, f.2);
                while let Some(k) = text[s..e].find(needle.as_str()) {
                    if k > 0 {
                        next.push((false, s, s + k));
                    }
                    next.push((true, id as usize, 0));
                    s += k + needle.len();
                }
                if s < e {
                    next.push((false, s, e));
                }
            }
            frags = next;
        }
        frags
    }

    proptest::proptest! {
        #[test]
        fn partition_equals_llama_cpp_order(text in "[abcx<> ]{0,30}", parse_special: bool) {
            let t = tokenizer_with_specials();
            let got: Vec<(bool, usize, usize)> = t
                .partition(&text, parse_special)
                .into_iter()
                .map(|f| match f {
                    Fragment::Text(s, e) => (false, s, e),
                    Fragment::Token(id) => (true, id as usize, 0),
                })
                .collect();
            proptest::prop_assert_eq!(got, partition_naive(&t, &text, parse_special));
        }
    }
}
