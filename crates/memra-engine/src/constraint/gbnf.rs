//! llama.cpp's GBNF (`grammars/README.md` there) translated to llguidance's Lark, as
//! llama.cpp's own `gbnf_to_lark.py` does: `name ::= ...` becomes `name: ...` on one line,
//! `root` becomes `start`, strings become JSON strings, character classes and `.` become
//! regular expressions; groups, alternatives and repetitions (`* + ? {m} {m,} {m,n}`)
//! are the same in both.
//!
//! Rules are told apart by `name ::=`, so newlines are dropped: GBNF ends a rule at a
//! newline outside parentheses, and a grammar that relies on that only to be refused reads
//! as one rule running on here (never a different language for a valid grammar).

use std::collections::HashMap;

#[derive(Debug, PartialEq)]
enum Tok {
    Name(String),
    Defines,
    /// A string literal, decoded.
    Str(String),
    /// A character class as a Rust regex class (`[...]`).
    Class(String),
    Any,
    /// `( ) | * + ?` and repetitions `{...}`, as written.
    Punct(String),
}

/// The Lark grammar for `src`, or what is wrong with it (with the byte offset).
pub fn to_lark(src: &str) -> Result<String, String> {
    let toks = lex(src)?;
    let mut names: HashMap<String, String> = HashMap::new();
    let mut lark_name = |n: &str| -> String {
        let fresh = names.len();
        names
            .entry(n.to_string())
            .or_insert_with(|| match n {
                "root" => "start".to_string(),
                _ if n.starts_with(|c: char| c.is_ascii_lowercase())
                    && n.chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    && n != "start" =>
                {
                    n.to_string()
                }
                // Lark reads capitalized names as terminals: rename.
                _ => format!("r-{fresh}"),
            })
            .clone()
    };
    let mut out = String::new();
    let mut defined = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        let (Tok::Name(n), Some(Tok::Defines)) = (&toks[i], toks.get(i + 1)) else {
            return Err(format!("expected `name ::=` at token {}", i + 1));
        };
        defined.push(n.clone());
        out.push_str(&lark_name(n));
        out.push(':');
        i += 2;
        let mut empty = true;
        while i < toks.len()
            && !(matches!(toks[i], Tok::Name(_)) && toks.get(i + 1) == Some(&Tok::Defines))
        {
            out.push(' ');
            match &toks[i] {
                Tok::Name(r) => out.push_str(&lark_name(r)),
                Tok::Str(s) if s.is_empty() => out.push_str("\"\""),
                // Lark's strings are JSON's, less a raw DEL (which JSON leaves unescaped).
                Tok::Str(s) => out.push_str(
                    &serde_json::to_string(s)
                        .expect("a string")
                        .replace('\u{7f}', "\\u007f"),
                ),
                Tok::Class(c) => {
                    out.push('/');
                    out.push_str(c);
                    out.push('/');
                }
                Tok::Any => out.push_str("/(?s:.)/"),
                Tok::Punct(p) => out.push_str(p),
                Tok::Defines => return Err("`::=` without a rule name".into()),
            }
            empty = false;
            i += 1;
        }
        if empty {
            out.push_str(" \"\"");
        }
        out.push('\n');
    }
    if !defined.iter().any(|n| n == "root") {
        return Err("the GBNF grammar has no `root` rule".into());
    }
    Ok(out)
}

fn lex(src: &str) -> Result<Vec<Tok>, String> {
    let b: Vec<char> = src.chars().collect();
    let mut toks = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        match c {
            _ if c.is_whitespace() => i += 1,
            '#' => {
                while i < b.len() && b[i] != '\n' {
                    i += 1;
                }
            }
            ':' if b[i..].starts_with(&[':', ':', '=']) => {
                toks.push(Tok::Defines);
                i += 3;
            }
            '"' => {
                let (s, next) = string(&b, i + 1)?;
                toks.push(Tok::Str(s));
                i = next;
            }
            '[' => {
                let (cls, next) = class(&b, i + 1)?;
                toks.push(Tok::Class(cls));
                i = next;
            }
            '.' => {
                toks.push(Tok::Any);
                i += 1;
            }
            '(' | ')' | '|' | '*' | '+' | '?' => {
                toks.push(Tok::Punct(c.to_string()));
                i += 1;
            }
            '{' => {
                let end = b[i..]
                    .iter()
                    .position(|&c| c == '}')
                    .ok_or_else(|| format!("unclosed `{{` at character {i}"))?;
                let inner: String = b[i + 1..i + end]
                    .iter()
                    .filter(|c| !c.is_whitespace())
                    .collect();
                let ok = !inner.is_empty()
                    && inner.chars().all(|c| c.is_ascii_digit() || c == ',')
                    && inner.matches(',').count() <= 1;
                if !ok {
                    return Err(format!("bad repetition {{{inner}}} at character {i}"));
                }
                let inner = if inner.starts_with(',') {
                    format!("0{inner}")
                } else {
                    inner
                };
                toks.push(Tok::Punct(format!("{{{inner}}}")));
                i += end + 1;
            }
            _ if c.is_ascii_alphanumeric() || c == '-' || c == '_' => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == '-' || b[i] == '_') {
                    i += 1;
                }
                toks.push(Tok::Name(
                    b[start..i].iter().collect::<String>().replace('_', "-"),
                ));
            }
            _ => return Err(format!("unexpected {c:?} at character {i}")),
        }
    }
    Ok(toks)
}

/// `\x`, `\u`, `\U` escapes: the code point of `n` hex digits at `b[i..]`.
fn hex(b: &[char], i: usize, n: usize) -> Result<char, String> {
    let digits: String = b.get(i..i + n).ok_or("a short escape")?.iter().collect();
    u32::from_str_radix(&digits, 16)
        .ok()
        .and_then(char::from_u32)
        .ok_or_else(|| format!("bad escape \\{digits} at character {i}"))
}

/// One character of a string or class at `b[i]` (escapes decoded); the next position.
fn char_at(b: &[char], i: usize) -> Result<(char, bool, usize), String> {
    let c = *b.get(i).ok_or("unterminated literal")?;
    if c != '\\' {
        return Ok((c, false, i + 1));
    }
    let e = *b.get(i + 1).ok_or("unterminated escape")?;
    Ok(match e {
        'x' => (hex(b, i + 2, 2)?, true, i + 4),
        'u' => (hex(b, i + 2, 4)?, true, i + 6),
        'U' => (hex(b, i + 2, 8)?, true, i + 10),
        'n' => ('\n', true, i + 2),
        'r' => ('\r', true, i + 2),
        't' => ('\t', true, i + 2),
        _ => (e, true, i + 2),
    })
}

fn string(b: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut s = String::new();
    loop {
        if b.get(i) == Some(&'"') {
            return Ok((s, i + 1));
        }
        let (c, _, next) = char_at(b, i)?;
        s.push(c);
        i = next;
    }
}

/// A class's contents up to `]`, rewritten for Rust's regex syntax: every character
/// written as an escape or itself (where Rust gives it no meaning in a class).
fn class(b: &[char], mut i: usize) -> Result<(String, usize), String> {
    let mut out = String::from("[");
    if b.get(i) == Some(&'^') {
        out.push('^');
        i += 1;
    }
    let mut after_char = false;
    loop {
        match b.get(i) {
            None => return Err("unterminated character class".into()),
            Some(']') => {
                out.push(']');
                return Ok((out, i + 1));
            }
            // A range's dash, between two characters.
            Some('-') if after_char && b.get(i + 1) != Some(&']') => {
                out.push('-');
                after_char = false;
                i += 1;
            }
            _ => {
                let (c, _, next) = char_at(b, i)?;
                // Rust's regex refuses `\<` and `\>` (word boundaries) in a class.
                if c.is_ascii_alphanumeric() || c == '<' || c == '>' {
                    out.push(c);
                } else if c.is_ascii_graphic() {
                    out.push('\\');
                    out.push(c);
                } else {
                    out.push_str(&format!("\\x{{{:x}}}", c as u32));
                }
                after_char = true;
                i = next;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_strings_classes_and_repetitions_translate() {
        let g = r#"
# a comment
root ::= "{" ws item ("," ws item){0,3} "}"   # trailing
item ::= [a-z_]+ | "\"q\"" | [^"\\] | . | Other
Other ::=
  ( "x" |
    "y" ){2,}
ws ::= [ \t\n]?
"#;
        let lark = to_lark(g).unwrap();
        let want = "start: \"{\" ws item ( \",\" ws item ) {0,3} \"}\"\n\
item: /[a-z\\_]/ + | \"\\\"q\\\"\" | /[^\\\"\\\\]/ | /(?s:.)/ | r-3\n\
r-3: ( \"x\" | \"y\" ) {2,}\n\
ws: /[\\x{20}\\x{9}\\x{a}]/ ?\n";
        assert_eq!(lark, want);
    }

    #[test]
    fn malformed_grammars_are_errors() {
        assert!(to_lark("item ::= \"a\"").unwrap_err().contains("root"));
        assert!(to_lark("root ::= \"a").is_err());
        assert!(to_lark("root ::= [a-z").is_err());
        assert!(to_lark("root ::= \"a\"{x}").is_err());
        assert!(to_lark("root ::= \"\\x4\"").is_err());
        assert!(to_lark("root \"a\"").is_err());
        assert!(to_lark("root ::= @").is_err());
    }
}
