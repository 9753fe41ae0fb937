//! The grammar engine over a small vocabulary: masks against brute force over languages
//! small enough to list, the end of a grammar, JSON's fixed separators, errors.

use memra_gguf::{string_array, Metadata, Value as GgufValue, ValueType};
use serde_json::json;

use super::*;
use crate::tokenizer::unicode;

/// Multi-byte tokens beside the 256 byte tokens (ids 256..), and the control EOS last.
const WORDS: [&str; 9] = ["\"", "re", "red", "\"r", "gr", "ee", "12", "ab", "c\""];
const EOS_TEXT: &str = "<|end|>";

/// A byte-level vocabulary: token `b` is byte `b` for every byte, then [`WORDS`], then
/// EOS.
fn test_vocab() -> Tokenizer {
    let mut tokens: Vec<String> = unicode::byte_to_char()
        .iter()
        .map(|c| c.to_string())
        .collect();
    let byte_char = |s: &str| -> String {
        s.bytes()
            .map(|b| unicode::byte_to_char()[b as usize])
            .collect()
    };
    tokens.extend(WORDS.iter().map(|w| byte_char(w)));
    tokens.push(EOS_TEXT.into());
    let mut types = vec![1i32; tokens.len()];
    *types.last_mut().unwrap() = 3;
    let mut m = Metadata::new();
    m.set("tokenizer.ggml.model", GgufValue::String("gpt2".into()));
    m.set("tokenizer.ggml.tokens", string_array(tokens.clone()));
    m.set(
        "tokenizer.ggml.token_type",
        GgufValue::Array(
            ValueType::I32,
            types.into_iter().map(GgufValue::I32).collect(),
        ),
    );
    m.set("tokenizer.ggml.merges", string_array(Vec::<String>::new()));
    m.set(
        "tokenizer.ggml.eos_token_id",
        GgufValue::U32(tokens.len() as u32 - 1),
    );
    Tokenizer::from_metadata(&m).unwrap()
}

fn token_bytes(t: u32) -> Vec<u8> {
    match t {
        0..=255 => vec![t as u8],
        _ => WORDS
            .get(t as usize - 256)
            .map(|w| w.as_bytes().to_vec())
            .unwrap_or_default(),
    }
}

/// What the grammar allows after `prefix`, by brute force over the whole language: token
/// `t` is allowed iff some string of the language starts with `prefix` + its bytes; EOS
/// iff `prefix` is in the language.
fn brute_force(language: &[String], prefix: &[u8], n_vocab: usize, eos: u32) -> Vec<bool> {
    (0..n_vocab as u32)
        .map(|t| {
            if t == eos {
                return language.iter().any(|s| s.as_bytes() == prefix);
            }
            let mut p = prefix.to_vec();
            p.extend(token_bytes(t));
            !token_bytes(t).is_empty() && language.iter().any(|s| s.as_bytes().starts_with(&p))
        })
        .collect()
}

/// Random walks through the grammar, picking allowed tokens by the brute force: at every
/// step llguidance's mask must be the brute force's, and every walk must end (by EOS or
/// with the grammar complete) on a string of the language.
fn check_against_brute_force(g: &Grammar, language: &[String]) {
    let (grammars, tok) = (Grammars::new(&test_vocab()).unwrap(), test_vocab());
    let n = tok.n_vocab();
    let eos = n as u32 - 1;
    let mut seed = 7u64;
    let mut next = |m: usize| {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (seed >> 33) as usize % m
    };
    let mut ended = std::collections::HashSet::new();
    for walk in 0..60 {
        let mut c = grammars.compile(g).unwrap();
        let mut text = Vec::new();
        loop {
            let mask = c.mask().unwrap();
            let want = brute_force(language, &text, n, eos);
            let got: Vec<bool> = (0..n).map(|t| allows(&mask, t)).collect();
            let diff: Vec<usize> = (0..n).filter(|&t| want[t] != got[t]).collect();
            assert!(
                diff.is_empty(),
                "{g:?}, walk {walk}, after {:?}: tokens {diff:?} differ (brute force: {:?})",
                String::from_utf8_lossy(&text),
                diff.iter().map(|&t| want[t]).collect::<Vec<_>>()
            );
            let allowed: Vec<u32> = (0..n as u32).filter(|&t| want[t as usize]).collect();
            let t = allowed[next(allowed.len())];
            if t == eos {
                break;
            }
            c.accept(t).unwrap();
            text.extend(token_bytes(t));
            if c.is_finished() {
                assert_eq!(
                    c.mask().unwrap(),
                    {
                        let mut only_eos = vec![0u32; n.div_ceil(32)];
                        only_eos[eos as usize / 32] |= 1 << (eos % 32);
                        only_eos
                    },
                    "a finished grammar allows EOS only"
                );
                break;
            }
        }
        let s = String::from_utf8(text).unwrap();
        assert!(language.contains(&s), "{g:?}: walk {walk} ended on {s:?}");
        ended.insert(s);
    }
    assert!(
        ended.len() > 1,
        "the walks should reach several strings: {ended:?}"
    );
}

#[test]
fn json_enum_masks_match_brute_force() {
    let g = Grammar::JsonSchema(json!({"enum": ["red", "green", "re", 12, true]}));
    let language: Vec<String> = ["\"red\"", "\"green\"", "\"re\"", "12", "true"]
        .map(String::from)
        .to_vec();
    check_against_brute_force(&g, &language);
}

#[test]
fn lark_and_gbnf_masks_match_brute_force() {
    // The same finite language in both syntaxes: one to three digits, then ab or cc.
    let mut language = Vec::new();
    for len in 1..=3u32 {
        for d in 0..10usize.pow(len) {
            for tail in ["ab", "cc"] {
                language.push(format!("{d:0w$}{tail}", w = len as usize));
            }
        }
    }
    let lark = Grammar::Lark("start: /[0-9]{1,3}/ (\"ab\" | \"c\" \"c\")".into());
    check_against_brute_force(&lark, &language);
    let gbnf = Grammar::Gbnf(
        "root ::= digit digit? digit? tail\ndigit ::= [0-9]\ntail ::= \"ab\" | \"c\" \"c\"".into(),
    );
    check_against_brute_force(&gbnf, &language);
}

/// Feeds `text` byte by byte; whether every byte was allowed by the mask before it.
fn feed(c: &mut Constraint, text: &str) -> bool {
    for b in text.bytes() {
        if !allows(&c.mask().unwrap(), b as usize) {
            return false;
        }
        c.accept(b as u32).unwrap();
    }
    true
}

#[test]
fn json_object_schema_ends_when_complete_with_json_dumps_separators() {
    let grammars = Grammars::new(&test_vocab()).unwrap();
    let schema = json!({
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"type": "integer", "minimum": 1, "maximum": 3}},
        "required": ["a", "b"],
        "additionalProperties": false,
    });
    let g = Grammar::JsonSchema(schema);
    let mut c = grammars.compile(&g).unwrap();
    assert!(feed(&mut c, "{\"a\": true, \"b\": 2}"));
    assert!(c.is_finished());
    // No other spacing, no value out of bounds, no missing field.
    for bad in [
        "{\"a\":true",
        "{ \"a\"",
        "{\"a\": true, \"b\": 4",
        "{\"a\": true}",
        "{\"b\": 2, \"c\"",
    ] {
        let mut c = grammars.compile(&g).unwrap();
        assert!(!feed(&mut c, bad), "{bad:?} should be refused");
    }
    // json_object: any object, and only an object.
    let mut c = grammars.compile(&Grammar::JsonObject).unwrap();
    assert!(feed(&mut c, "{\"x\": [1, {\"y\": null}]}"));
    assert!(c.is_finished());
    let mut c = grammars.compile(&Grammar::JsonObject).unwrap();
    assert!(!feed(&mut c, "[1]"));
}

/// Local `$ref`s resolve, and Lark embeds a schema with `%json` (what the server's tool
/// call grammars do).
#[test]
fn refs_and_embedded_schemas_compile() {
    let grammars = Grammars::new(&test_vocab()).unwrap();
    let g = Grammar::JsonSchema(json!({
        "$defs": {"digit": {"type": "integer", "minimum": 0, "maximum": 9}},
        "type": "array", "items": {"$ref": "#/$defs/digit"}, "maxItems": 2,
    }));
    let mut c = grammars.compile(&g).unwrap();
    assert!(feed(&mut c, "[1, 2]") && c.is_finished());
    assert!(!feed(&mut grammars.compile(&g).unwrap(), "[12"));
    let lark = "start: \"<c>\" j \"</c>\"\nj: %json {\"type\": \"integer\", \"minimum\": 0, \"maximum\": 9}\n";
    let mut c = grammars.compile(&Grammar::Lark(lark.into())).unwrap();
    assert!(feed(&mut c, "<c>7</c>") && c.is_finished());
    assert!(!feed(
        &mut grammars.compile(&Grammar::Lark(lark.into())).unwrap(),
        "<c>10"
    ));
}

#[test]
fn bad_grammars_are_errors_naming_the_problem() {
    let grammars = Grammars::new(&test_vocab()).unwrap();
    let err = |g: Grammar| match grammars.compile(&g) {
        Ok(_) => panic!("{g:?} compiled"),
        Err(e) => e.to_string(),
    };
    assert!(err(Grammar::JsonSchema(json!(["a"]))).contains("must be an object"));
    assert!(err(Grammar::JsonSchema(json!({"type": "strin"}))).contains("strin"));
    assert!(err(Grammar::JsonSchema(json!({"$ref": "#/$defs/missing"}))).contains("missing"));
    assert!(err(Grammar::Lark("start: foo".into())).contains("foo"));
    assert!(err(Grammar::Lark("start: (\"a\"".into())).len() > 10);
    assert!(err(Grammar::Gbnf("item ::= \"a\"".into())).contains("root"));
    assert!(err(Grammar::Gbnf("root ::= [a-".into())).contains("class"));
    let big = format!("start: \"{}\"", "a".repeat(MAX_GRAMMAR_BYTES));
    assert!(err(Grammar::Lark(big)).contains("at most"));
    // A schema no output satisfies.
    let e = err(Grammar::JsonSchema(
        json!({"type": "integer", "minimum": 5, "maximum": 1}),
    ));
    assert!(!e.is_empty());
}

/// GBNF's other pieces compile and mean what they say: `.`, escapes in strings and
/// classes, negated classes, `{m,n}` and empty strings.
#[test]
fn gbnf_features_compile_and_match() {
    let grammars = Grammars::new(&test_vocab()).unwrap();
    let g = Grammar::Gbnf(
        "root ::= \"\\x41\" [^\\n\\]] . \"\" [\\x30-\\x39]{2,3} (\"\\\"\" | \"\\u00e9\")\n".into(),
    );
    let mut c = grammars.compile(&g).unwrap();
    assert!(feed(&mut c, "Ab\n12\""));
    assert!(c.is_finished());
    let mut c = grammars.compile(&g).unwrap();
    assert!(feed(&mut c, "A?x123é"));
    assert!(c.is_finished());
    for bad in ["B", "A\n", "A]", "Ab\n1\"", "Ab\n1234"] {
        let mut c = grammars.compile(&g).unwrap();
        assert!(!feed(&mut c, bad) || !c.is_finished(), "{bad:?}");
    }
}

#[test]
fn masks_ban_what_they_do_not_allow() {
    let mut logits = vec![1.0f32; 70];
    let mask = [0b101u32, 0, 1 << 5];
    apply_mask(&mut logits, &mask);
    let allowed: Vec<usize> = (0..70).filter(|&i| logits[i] == 1.0).collect();
    assert_eq!(allowed, [0, 2, 69]);
    assert_eq!(logits[68], f32::NEG_INFINITY);
    // Tokens past the mask's words are banned.
    let mut logits = vec![1.0f32; 40];
    apply_mask(&mut logits, &[u32::MAX]);
    assert_eq!(logits.iter().filter(|v| v.is_finite()).count(), 32);
}
