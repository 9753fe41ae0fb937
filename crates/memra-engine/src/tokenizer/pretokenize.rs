//! Pre-tokenizers of byte-level BPE vocabularies, chosen by `tokenizer.ggml.pre` as
//! llama.cpp chooses them (src/llama-vocab.cpp).
//!
//! The GPT-2 and the Llama 3 / Qwen2 patterns are hand-written splitters: they are the
//! common case and a regex engine with look-ahead (`\s+(?!\S)`) is the slow part of
//! tokenizing. llama.cpp does the same (`unicode_regex_split_custom_*`). The splitters
//! implement exactly the regexes quoted on them; the rarer patterns run through
//! `fancy-regex`, each regex splitting the pieces the previous one left, as llama.cpp's
//! `unicode_regex_split` does.

use fancy_regex::Regex;

use super::unicode::{is_letter, is_number, is_whitespace};
use super::TokenizerError;

/// How text is cut into words before BPE merges.
#[derive(Debug)]
pub enum PreTokenizer {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    Gpt2,
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,D}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// with D = 3 (Llama 3) or D = 1 (Qwen2).
    Llama3 { max_digits: usize },
    /// A sequence of regexes, each splitting the pieces of the previous one.
    Regexes(Vec<Regex>),
}

/// Whether a vocabulary's BPE takes a whole word from the vocabulary before merging
/// (llama.cpp `ignore_merges`, set for Llama 3).
pub fn ignores_merges(pre: &str) -> bool {
    matches!(pre, "llama3" | "llama-v3" | "llama-bpe")
}

// Code points are escaped: an editor normalizing to NFC would turn U+1F7D, U+1FD3 and
// U+1FDB into other characters and reverse their ranges.
const DEEPSEEK_LLM: &[&str] = &[
    r"[\r\n]",
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}+",
];

const DEEPSEEK_CODER: &[&str] = &[
    r"[\r\n]",
    r"\s?\p{L}+",
    r"\s?\p{P}+",
    r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+",
    r"\p{N}",
];

const STARCODER: &[&str] = &[
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
];

const GPT4O: &[&str] = &[
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` value; an unknown name is an error,
    /// never a guess (a wrong split silently changes every token id).
    pub fn from_name(pre: &str) -> Result<PreTokenizer, TokenizerError> {
        let regexes = |list: &[&str]| -> Result<PreTokenizer, TokenizerError> {
            list.iter()
                .map(|r| {
                    Regex::new(r).map_err(|e| TokenizerError::Invalid(format!("regex {r}: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(PreTokenizer::Regexes)
        };
        match pre {
            "default" | "gpt2" | "gpt-2" => Ok(PreTokenizer::Gpt2),
            "llama3" | "llama-v3" | "llama-bpe" => Ok(PreTokenizer::Llama3 { max_digits: 3 }),
            "qwen2" | "deepseek-r1-qwen" => Ok(PreTokenizer::Llama3 { max_digits: 1 }),
            "deepseek-llm" => regexes(DEEPSEEK_LLM),
            "deepseek-coder" => regexes(DEEPSEEK_CODER),
            "starcoder" | "refact" | "command-r" => regexes(STARCODER),
            "gpt-4o" => regexes(GPT4O),
            other => Err(TokenizerError::UnknownPreTokenizer(other.to_string())),
        }
    }

    /// Cuts `text` into words, returned as byte ranges.
    pub fn split(&self, text: &str) -> Result<Vec<(usize, usize)>, TokenizerError> {
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        let bounds = |i: usize| chars.get(i).map_or(text.len(), |&(b, _)| b);
        let to_bytes = |pieces: Vec<(usize, usize)>| {
            pieces
                .into_iter()
                .map(|(s, e)| (bounds(s), bounds(e)))
                .collect()
        };
        match self {
            PreTokenizer::Gpt2 => Ok(to_bytes(split_gpt2(&chars))),
            PreTokenizer::Llama3 { max_digits } => Ok(to_bytes(split_llama3(&chars, *max_digits))),
            PreTokenizer::Regexes(list) => {
                let mut pieces = vec![(0, text.len())];
                for re in list {
                    let mut next = Vec::with_capacity(pieces.len());
                    for (start, end) in pieces {
                        let part = &text[start..end];
                        let mut at = 0;
                        for m in re.find_iter(part) {
                            let m =
                                m.map_err(|e| TokenizerError::Invalid(format!("regex: {e}")))?;
                            if m.start() > at {
                                next.push((start + at, start + m.start()));
                            }
                            if m.end() > m.start() {
                                next.push((start + m.start(), start + m.end()));
                            }
                            at = m.end();
                        }
                        if at < part.len() {
                            next.push((start + at, end));
                        }
                    }
                    pieces = next;
                }
                Ok(pieces)
            }
        }
    }
}

/// Character `i` of the text, or `None` past its end.
fn at(chars: &[(usize, char)], i: usize) -> Option<char> {
    chars.get(i).map(|&(_, c)| c)
}

/// Matches `'s|'t|'re|'ve|'m|'ll|'d` at `pos`; returns its length in characters.
fn contraction(chars: &[(usize, char)], pos: usize, ignore_case: bool) -> usize {
    if at(chars, pos) != Some('\'') {
        return 0;
    }
    let fold = |c: Option<char>| {
        c.map(|c| {
            if ignore_case {
                c.to_ascii_lowercase()
            } else {
                c
            }
        })
    };
    let (c1, c2) = (fold(at(chars, pos + 1)), fold(at(chars, pos + 2)));
    match (c1, c2) {
        (Some('s' | 't' | 'm' | 'd'), _) => 2,
        (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l')) => 3,
        _ => 0,
    }
}

/// Neither white space, letter nor number: `[^\s\p{L}\p{N}]`.
fn is_other(c: char) -> bool {
    !(is_whitespace(c) || is_letter(c) || is_number(c))
}

/// The trailing white-space alternatives `\s+(?!\S)|\s+` at `pos`; 0 when none.
fn trailing_space(chars: &[(usize, char)], pos: usize) -> usize {
    let mut n = 0;
    while at(chars, pos + n).is_some_and(is_whitespace) {
        n += 1;
    }
    // Before a non-space character the last space is left to start the next word.
    if n > 1 && pos + n < chars.len() {
        n - 1
    } else {
        n
    }
}

fn split_gpt2(chars: &[(usize, char)]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < chars.len() {
        let start = pos;
        let c = chars[pos].1;
        let n = contraction(chars, pos, false);
        if n > 0 {
            pos += n;
        } else {
            // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run.
            let lead = usize::from(c == ' ' && pos + 1 < chars.len());
            let first = at(chars, pos + lead).expect("in range");
            let class: Option<fn(char) -> bool> = if is_letter(first) {
                Some(is_letter)
            } else if is_number(first) {
                Some(is_number)
            } else if is_other(first) {
                Some(is_other)
            } else {
                None
            };
            match class {
                Some(class) => {
                    pos += lead;
                    while at(chars, pos).is_some_and(class) {
                        pos += 1;
                    }
                }
                None => pos += trailing_space(chars, pos).max(1),
            }
        }
        out.push((start, pos));
    }
    out
}

fn split_llama3(chars: &[(usize, char)], max_digits: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut pos = 0;
    let newline = |c: char| c == '\r' || c == '\n';
    while pos < chars.len() {
        let start = pos;
        let c = chars[pos].1;
        let n = contraction(chars, pos, true);
        if n > 0 {
            pos += n;
            out.push((start, pos));
            continue;
        }
        // `[^\r\n\p{L}\p{N}]?\p{L}+`
        if !newline(c)
            && !is_number(c)
            && (is_letter(c) || at(chars, pos + 1).is_some_and(is_letter))
        {
            pos += 1;
            while at(chars, pos).is_some_and(is_letter) {
                pos += 1;
            }
            out.push((start, pos));
            continue;
        }
        // `\p{N}{1,D}`
        if is_number(c) {
            while pos - start < max_digits && at(chars, pos).is_some_and(is_number) {
                pos += 1;
            }
            out.push((start, pos));
            continue;
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        let lead = usize::from(c == ' ');
        if at(chars, pos + lead).is_some_and(is_other) {
            pos += lead;
            while at(chars, pos).is_some_and(is_other) {
                pos += 1;
            }
            while at(chars, pos).is_some_and(newline) {
                pos += 1;
            }
            out.push((start, pos));
            continue;
        }
        // `\s*[\r\n]+`: white space up to and including its last line break.
        let mut n = 0;
        let mut last_break = None;
        while let Some(w) = at(chars, pos + n).filter(|&w| is_whitespace(w)) {
            n += 1;
            if newline(w) {
                last_break = Some(pos + n);
            }
        }
        pos = match last_break {
            Some(end) => end,
            None if n > 0 => pos + trailing_space(chars, pos),
            None => pos + 1,
        };
        out.push((start, pos));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: &PreTokenizer, text: &str) -> Vec<String> {
        p.split(text)
            .unwrap()
            .into_iter()
            .map(|(s, e)| text[s..e].to_string())
            .collect()
    }

    /// The hand-written splitters against fancy-regex running the patterns they implement.
    #[test]
    fn splitters_equal_their_regexes() {
        let gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
        let llama3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let qwen2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let texts = [
            "Hello world",
            " Hello  world  ",
            "don't WON'T it's I'M you're we'LL they'd",
            "3.14159 12345678901234567890 1,000,000",
            "   multiple   spaces\t\ttabs\n\n\nnewlines \n x",
            "你好，世界！こんにちは 세계 🌍🚀",
            "def f(x):\n    return x**2 + 1\r\n\r\n",
            "ÀÉÎÕÜ àéîõü ß ñ Ⅻ ½ ٣",
            "a'b 'x '' ' ",
            "\u{a0}\u{3000}x \u{2028}y",
            "",
            " ",
            "  ",
            "!!!?? ...\n\n",
        ];
        for (pattern, splitter) in [
            (gpt2, PreTokenizer::Gpt2),
            (llama3, PreTokenizer::Llama3 { max_digits: 3 }),
            (qwen2, PreTokenizer::Llama3 { max_digits: 1 }),
        ] {
            let re = PreTokenizer::Regexes(vec![Regex::new(pattern).unwrap()]);
            for t in texts {
                assert_eq!(words(&splitter, t), words(&re, t), "{splitter:?} on {t:?}");
            }
        }
    }

    #[test]
    fn unknown_names_are_errors() {
        assert!(matches!(
            PreTokenizer::from_name("bloom-ish"),
            Err(TokenizerError::UnknownPreTokenizer(n)) if n == "bloom-ish"
        ));
        for name in [
            "default",
            "qwen2",
            "llama-bpe",
            "deepseek-llm",
            "deepseek-coder",
            "starcoder",
            "gpt-4o",
        ] {
            PreTokenizer::from_name(name).unwrap();
        }
    }

    #[test]
    fn regex_sequences_split_the_previous_pieces() {
        let p = PreTokenizer::from_name("deepseek-coder").unwrap();
        assert_eq!(words(&p, "ab\ncd 12"), ["ab", "\n", "cd", " ", "1", "2"]);
    }
}
