//! Token ids and chat prompts against llama.cpp's and transformers' recorded outputs
//! (`../shared/golden`), and round trips on random text.

use std::collections::HashMap;

use memra_engine::tokenizer::template::{ChatInput, ChatTemplate};
use memra_engine::tokenizer::{IncrementalDecoder, Tokenizer, TokenizerError};
mod common;

use common::{golden, model_path};
use memra_gguf::{GgufFile, Metadata, Value};
use proptest::prelude::*;

fn metadata(name: &str) -> Metadata {
    GgufFile::open(model_path(name)).unwrap().metadata
}

fn tokenizer(name: &str) -> Tokenizer {
    Tokenizer::from_metadata(&metadata(name)).unwrap()
}

#[test]
fn token_ids_equal_llama_cpp() {
    let mut tokenizers: HashMap<String, Tokenizer> = HashMap::new();
    let mut checked = 0;
    let mut failures = Vec::new();
    for file in [
        "tokenize.json",
        "tiny/tokenize.json",
        "qwen2.5-coder-1.5b/tokenize.json",
    ] {
        for case in golden(file) {
            let model = case["model"].as_str().unwrap().to_string();
            let t = tokenizers
                .entry(model.clone())
                .or_insert_with(|| tokenizer(&model));
            let text = case["text"].as_str().unwrap();
            let parse_special = case["parse_special"].as_bool().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            let got = t.encode(text, true, parse_special).unwrap();
            if got != want {
                failures.push(format!("{model} {text:?} parse_special={parse_special}:\n  got  {got:?}\n  want {want:?}"));
            }
            checked += 1;
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {checked} differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(checked, 48 + 50 + 24);
}

#[test]
fn chat_templates_render_like_transformers() {
    let mut checked = 0;
    for case in golden("chat_template.json") {
        let model = case["model"].as_str().unwrap();
        let m = metadata(model);
        let source = m.get_str("tokenizer.chat_template").unwrap().unwrap();
        let t = tokenizer(model);
        let token = |id: Option<u32>| id.and_then(|i| t.token_text(i)).unwrap_or("").to_string();
        let tools = case.get("tools").filter(|v| !v.is_null());
        let out = ChatTemplate::new(source)
            .unwrap()
            .render(&ChatInput {
                messages: &case["messages"],
                tools,
                add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
                bos_token: &token(t.bos),
                eos_token: &token(t.eos),
            })
            .unwrap();
        assert_eq!(
            out,
            case["rendered"].as_str().unwrap(),
            "{model}: {}",
            case["messages"]
        );
        checked += 1;
    }
    assert_eq!(checked, 8);
}

fn golden_texts() -> Vec<String> {
    let mut v: Vec<String> = golden("tokenize.json")
        .iter()
        .chain(golden("tiny/tokenize.json").iter())
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect();
    v.dedup();
    v
}

const ROUND_TRIP_MODELS: [&str; 3] = [
    "qwen2.5-coder-0.5b-instruct-q4_k_m",
    "gemma-3-270m-q4_k_m",
    "tiny-llama",
];

#[test]
fn golden_strings_round_trip() {
    for name in ROUND_TRIP_MODELS {
        let t = tokenizer(name);
        for text in golden_texts() {
            // Without special-token parsing every string is plain text and must come back.
            let ids = t.encode(&text, true, false).unwrap();
            assert_eq!(
                t.decode(&ids, false).unwrap(),
                text.as_bytes(),
                "{name}: {text:?}"
            );
            let mut d = IncrementalDecoder::new(&t, false);
            let mut streamed = String::new();
            for &id in &ids {
                streamed += &d.push(id).unwrap();
            }
            streamed += &d.finish();
            assert_eq!(streamed, text, "{name} streaming: {text:?}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_unicode_round_trips(text in "\\PC{0,40}", which in 0..ROUND_TRIP_MODELS.len()) {
        thread_local! {
            static TOKENIZERS: Vec<Tokenizer> = ROUND_TRIP_MODELS.iter().map(|n| tokenizer(n)).collect();
        }
        TOKENIZERS.with(|ts| {
            let t = &ts[which];
            let ids = t.encode(&text, false, false).unwrap();
            prop_assert_eq!(t.decode(&ids, false).unwrap(), text.as_bytes());
            let mut d = IncrementalDecoder::new(t, false);
            let mut streamed = String::new();
            for &id in &ids {
                let piece = d.push(id).unwrap();
                let replaced = piece.contains('\u{FFFD}') && !text.contains('\u{FFFD}');
                prop_assert!(!replaced, "replacement character in {:?}", piece);
                streamed += &piece;
            }
            streamed += &d.finish();
            prop_assert_eq!(streamed, text);
            Ok(())
        })?;
    }
}

#[test]
fn bad_input_gives_clear_errors() {
    let t = tokenizer("tiny-qwen2");
    let n = t.n_vocab() as u32;
    assert!(
        matches!(t.decode(&[1, n], false), Err(TokenizerError::IdOutOfRange { id, .. }) if id == n as i64)
    );
    let mut d = IncrementalDecoder::new(&t, false);
    assert!(d.push(u32::MAX).is_err());

    let mut m = metadata("tiny-qwen2");
    m.set("tokenizer.ggml.pre", Value::String("mystery-pre".into()));
    let e = Tokenizer::from_metadata(&m).err().unwrap();
    assert!(e.to_string().contains("mystery-pre"), "{e}");

    let mut m = metadata("tiny-qwen2");
    m.set(
        "tokenizer.ggml.model",
        Value::String("wordpiece-ish".into()),
    );
    assert!(matches!(
        Tokenizer::from_metadata(&m),
        Err(TokenizerError::UnknownModel(_))
    ));

    let mut m = metadata("tiny-qwen2");
    m.set("tokenizer.ggml.bos_token_id", Value::U32(100_000));
    let e = Tokenizer::from_metadata(&m).err().unwrap();
    assert!(e.to_string().contains("BOS id 100000 is outside"), "{e}");

    let mut m = metadata("tiny-qwen2");
    m.set(
        "tokenizer.ggml.token_type",
        Value::Array(memra_gguf::ValueType::I32, vec![Value::I32(1)]),
    );
    assert!(Tokenizer::from_metadata(&m).is_err());
}
