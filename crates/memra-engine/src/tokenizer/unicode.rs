//! Unicode facts the tokenizers need: the general-category classes of the pre-tokenizer
//! regexes (`\p{L}`, `\p{N}`, `\s`) and GPT-2's byte-to-character alphabet.
//!
//! Categories come from `regex-syntax`'s Unicode tables (the ones the regex engines use),
//! flattened once into sorted ranges. Rust's `char::is_alphabetic` is not `\p{L}`: it also
//! takes combining marks and letter numbers, which llama.cpp's splitters do not.

use std::sync::OnceLock;

use regex_syntax::hir::{Class, HirKind};

/// A set of code points as sorted, disjoint ranges.
struct CharClass(Vec<(u32, u32)>);

impl CharClass {
    fn parse(pattern: &str) -> CharClass {
        let hir = regex_syntax::parse(pattern).expect("valid class pattern");
        match hir.kind() {
            HirKind::Class(Class::Unicode(c)) => CharClass(
                c.ranges()
                    .iter()
                    .map(|r| (u32::from(r.start()), u32::from(r.end())))
                    .collect(),
            ),
            other => panic!("{pattern} is not a Unicode class: {other:?}"),
        }
    }

    fn contains(&self, c: char) -> bool {
        let c = u32::from(c);
        self.0
            .binary_search_by(|&(lo, hi)| {
                if hi < c {
                    std::cmp::Ordering::Less
                } else if lo > c {
                    std::cmp::Ordering::Greater
                } else {
                    std::cmp::Ordering::Equal
                }
            })
            .is_ok()
    }
}

struct Tables {
    letter: CharClass,
    number: CharClass,
    whitespace: CharClass,
}

fn tables() -> &'static Tables {
    static TABLES: OnceLock<Tables> = OnceLock::new();
    TABLES.get_or_init(|| Tables {
        letter: CharClass::parse(r"\p{L}"),
        number: CharClass::parse(r"\p{N}"),
        whitespace: CharClass::parse(r"\s"),
    })
}

/// `\p{L}`: a letter of any script.
pub fn is_letter(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_alphabetic();
    }
    tables().letter.contains(c)
}

/// `\p{N}`: any number character.
pub fn is_number(c: char) -> bool {
    if c.is_ascii() {
        return c.is_ascii_digit();
    }
    tables().number.contains(c)
}

/// `\s`: Unicode white space.
pub fn is_whitespace(c: char) -> bool {
    if c.is_ascii() {
        return matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r');
    }
    tables().whitespace.contains(c)
}

/// GPT-2's printable stand-in for each byte: printable Latin-1 bytes stand for themselves,
/// the rest map to U+0100 upwards in byte order (so a space is `Ġ`, a newline `Ċ`).
pub fn byte_to_char() -> [char; 256] {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..256u32 {
        out[b as usize] = if printable(b) {
            char::from_u32(b).expect("Latin-1")
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below U+0200")
        };
    }
    out
}

/// The inverse of [`byte_to_char`]: `None` for characters outside the alphabet.
pub fn char_to_byte(c: char) -> Option<u8> {
    static INVERSE: OnceLock<std::collections::HashMap<char, u8>> = OnceLock::new();
    INVERSE
        .get_or_init(|| {
            byte_to_char()
                .iter()
                .enumerate()
                .map(|(b, &c)| (c, b as u8))
                .collect()
        })
        .get(&c)
        .copied()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn categories_follow_the_unicode_general_categories() {
        assert!(is_letter('a') && is_letter('É') && is_letter('你') && is_letter('ß'));
        // Combining marks and letter numbers are Alphabetic in Rust but not \p{L}.
        assert!('\u{0301}'.is_alphabetic() || !is_letter('\u{0301}'));
        assert!(!is_letter('\u{093F}'), "Devanagari vowel sign is a mark");
        assert!('Ⅻ'.is_alphabetic() && !is_letter('Ⅻ') && is_number('Ⅻ'));
        assert!(is_number('7') && is_number('٣') && is_number('½'));
        assert!(!is_number('a') && !is_letter('1') && !is_letter('🌍'));
        assert!(is_whitespace('\u{3000}') && is_whitespace('\u{a0}') && is_whitespace('\x0b'));
        assert!(
            !is_whitespace('\u{200b}'),
            "zero-width space is not White_Space"
        );
    }

    #[test]
    fn byte_alphabet_is_a_bijection_without_spaces() {
        let m = byte_to_char();
        let set: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b'a' as usize], 'a');
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert!(!set.contains(&' '));
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(m[b as usize]), Some(b));
        }
        assert_eq!(char_to_byte(' '), None);
    }
}
