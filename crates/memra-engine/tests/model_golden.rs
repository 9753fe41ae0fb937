//! Whole-model checks against llama.cpp's recorded outputs: greedy continuations and
//! perplexity, on the tiny models of every architecture and on the real models.

use memra_engine::models::{LogitRows, Model};
mod common;

use common::{golden, model_path};
use memra_gguf::test_files::shared_dir;
use serde_json::Value as Json;

fn argmax(v: &[f32]) -> usize {
    v.iter()
        .enumerate()
        .fold(
            (0, f32::NEG_INFINITY),
            |b, (i, &x)| if x > b.1 { (i, x) } else { b },
        )
        .0
}

/// Greedy decoding as llama-completion does it; returns the text and, per step, the two
/// best logits (to tell a near-tie from a bug).
fn greedy(model: &Model, prompt: &str, n: usize) -> (String, Vec<(u32, f32, u32, f32)>) {
    let t = &model.tokenizer;
    let ids = t.encode(prompt, true, true).unwrap();
    let mut cache = model.decoder.new_cache(ids.len() + n + 1);
    let mut logits = model
        .decoder
        .forward(&mut cache, &ids, LogitRows::Last)
        .unwrap();
    let mut out = Vec::new();
    let mut tops = Vec::new();
    for _ in 0..n {
        let best = argmax(&logits);
        let mut rest = logits.clone();
        rest[best] = f32::NEG_INFINITY;
        let second = argmax(&rest);
        tops.push((best as u32, logits[best], second as u32, logits[second]));
        if t.is_end_of_generation(best as u32) {
            break;
        }
        out.push(best as u32);
        logits = model
            .decoder
            .forward(&mut cache, &[best as u32], LogitRows::Last)
            .unwrap();
    }
    (t.decode_lossy(&out, false).unwrap(), tops)
}

/// Logit margin below which two candidates count as tied: the per-logit difference between
/// llama.cpp and memra on these models is about 0.1 (see docs/cpu-engine.md), with or
/// without activation quantization.
const NEAR_TIE: f32 = 0.3;

fn check_greedy(file: &str, filter: impl Fn(&str) -> bool) {
    let mut failures = Vec::new();
    let mut near_ties = Vec::new();
    let mut n_cases = 0;
    let mut loaded: Option<(String, Model)> = None;
    for case in golden(file) {
        let name = case["model"].as_str().unwrap().to_string();
        if !filter(&name) {
            continue;
        }
        if loaded.as_ref().is_none_or(|(n, _)| *n != name) {
            loaded = Some((name.clone(), Model::load(&model_path(&name)).unwrap()));
        }
        let model = &loaded.as_ref().unwrap().1;
        let prompt = case["prompt"].as_str().unwrap();
        let n = case["n_predict"].as_u64().unwrap() as usize;
        let want = case["completion"].as_str().unwrap();
        let (got, tops) = greedy(model, prompt, n);
        n_cases += 1;
        if got == want {
            continue;
        }
        // The texts part: find the step, and accept it only as a near-tie that llama.cpp
        // broke the other way (its token is our runner-up, within NEAR_TIE logits).
        let t = &model.tokenizer;
        let mut text = String::new();
        let mut verdict = String::from("diverged without a differing step");
        for (step, &(a, la, b, lb)) in tops.iter().enumerate() {
            let before = text.clone();
            text += &t.decode_lossy(&[a], false).unwrap();
            if want.starts_with(&text) {
                continue;
            }
            let runner_up = before + &t.decode_lossy(&[b], false).unwrap();
            let near_tie = la - lb < NEAR_TIE && want.starts_with(&runner_up);
            verdict = format!("step {step}: top {a} ({la:.4}) vs {b} ({lb:.4})");
            if near_tie {
                near_ties.push(format!("{name} {prompt:?}: {verdict}"));
                verdict.clear();
            }
            break;
        }
        if !verdict.is_empty() {
            failures.push(format!(
                "{name} {prompt:?}: {verdict}\n  got  {got:?}\n  want {want:?}"
            ));
        }
    }
    eprintln!(
        "{} of {n_cases} continuations part from llama.cpp's at a near-tie:\n{}",
        near_ties.len(),
        near_ties.join("\n")
    );
    assert!(n_cases > 0);
    assert!(
        failures.is_empty(),
        "{} of {n_cases} differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn tiny_models_greedy_equals_llama_cpp() {
    check_greedy("tiny/greedy.json", |_| true);
}

#[test]
fn qwen_0_5b_greedy_equals_llama_cpp() {
    check_greedy("greedy.json", |n| n.contains("qwen"));
}

#[test]
fn gemma_270m_greedy_equals_llama_cpp() {
    check_greedy("greedy.json", |n| n.contains("gemma"));
}

/// Per-position log-probabilities against llama.cpp's (`golden/topk-*.json`): prints the
/// error statistics; fails only on gross disagreement (a forward-pass bug).
fn check_topk(file: &str, model_name: &str) {
    let text = std::fs::read_to_string(shared_dir().join("golden").join(file)).unwrap();
    let g: Json = serde_json::from_str(&text).unwrap();
    let model = Model::load(&model_path(model_name)).unwrap();
    let ctx = g["ctx"].as_u64().unwrap() as usize;
    let tokens: Vec<u32> = g["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let (mut sum_err, mut max_err, mut n, mut top1_agree) = (0f64, 0f64, 0usize, 0usize);
    for (c, ids) in tokens.chunks_exact(ctx).enumerate() {
        let mut ids = ids.to_vec();
        // llama-perplexity puts BOS first in every chunk when the model uses one.
        if model.tokenizer.add_bos {
            ids[0] = model.tokenizer.bos.unwrap();
        }

        let mut cache = model.decoder.new_cache(ctx);
        let logits = model
            .decoder
            .forward(&mut cache, &ids, LogitRows::From(0))
            .unwrap();
        let nv = model.tokenizer.n_vocab();
        for p in g["positions"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["chunk"].as_u64() == Some(c as u64))
        {
            let pos = p["pos"].as_u64().unwrap() as usize;
            let row = &logits[pos * nv..(pos + 1) * nv];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
            let top = p["top"].as_array().unwrap();
            if argmax(row) as u64 == top[0][0].as_u64().unwrap() {
                top1_agree += 1;
            }
            if std::env::var_os("MEMRA_DEBUG_TOPK").is_some() {
                let errs: Vec<String> = top
                    .iter()
                    .map(|t| {
                        format!(
                            "{:+.3}",
                            f64::from(row[t[0].as_u64().unwrap() as usize] - lse)
                                - t[1].as_f64().unwrap()
                        )
                    })
                    .collect();
                eprintln!("pos {pos}: {}", errs.join(" "));
            }
            for t in top {
                let (id, lp) = (t[0].as_u64().unwrap() as usize, t[1].as_f64().unwrap());
                let err = (f64::from(row[id] - lse) - lp).abs();
                sum_err += err;
                max_err = max_err.max(err);
                n += 1;
            }
        }
    }
    let positions = n / 8;
    eprintln!("{model_name}: log-prob error mean {:.4} max {:.4} over {n}; top-1 agrees at {top1_agree}/{positions}", sum_err / n as f64, max_err);
    // Measured 2026-11-30: mean 0.09-0.12, top-1 agreement 119-123 of 126 (the same with f32
    // activations); a forward-pass bug shows as a mean of 0.5 and more.
    let mean = sum_err / n as f64;
    assert!(
        mean < 0.2,
        "log-probabilities far from llama.cpp: mean error {mean:.3}"
    );
    assert!(
        top1_agree * 10 >= positions * 9,
        "top-1 agrees at only {top1_agree}/{positions}"
    );
}

#[test]
fn gemma_270m_log_probs_near_llama_cpp() {
    check_topk("topk-gemma-3-270m.json", "gemma-3-270m-q4_k_m");
}

#[test]
fn qwen_0_5b_log_probs_near_llama_cpp() {
    check_topk(
        "topk-qwen2.5-coder-0.5b.json",
        "qwen2.5-coder-0.5b-instruct-q4_k_m",
    );
}

fn check_perplexity(file: &str, tolerance: f64, filter: impl Fn(&str) -> bool) {
    let text = std::fs::read_to_string(shared_dir().join("golden/texts/GPL-3")).unwrap();
    let text = text.strip_suffix('\n').unwrap_or(&text);
    let mut n = 0;
    let mut report = Vec::new();
    for case in golden(file) {
        let name = case["model"].as_str().unwrap();
        if !filter(name) {
            continue;
        }
        let model = Model::load(&model_path(name)).unwrap();
        let ctx = case["ctx"].as_u64().unwrap() as usize;
        let chunks = case["chunks"].as_u64().unwrap() as usize;
        let mut runner = memra_engine::generate::CpuRunner::new(&model.decoder, ctx, 512);
        let got = memra_engine::generate::perplexity(
            &model,
            &mut runner,
            text,
            ctx,
            Some(chunks),
            |_, _, _| {},
        )
        .unwrap();
        let want = case["ppl"].as_f64().unwrap();
        let rel = (got.ppl - want).abs() / want;
        report.push(format!(
            "{name}: {:.4} vs llama.cpp {want} ({:+.3}%)",
            got.ppl,
            100.0 * (got.ppl - want) / want
        ));
        assert_eq!(got.chunks, chunks, "{name}");
        assert!(
            rel <= tolerance,
            "{name}: perplexity {:.4}, llama.cpp {want}",
            got.ppl
        );
        n += 1;
    }
    eprintln!("{}", report.join("\n"));
    assert!(n > 0);
}

#[test]
fn tiny_models_perplexity_within_2_percent() {
    check_perplexity("tiny/perplexity.json", 0.02, |_| true);
}

#[test]
fn real_models_perplexity_within_half_a_percent() {
    check_perplexity("perplexity.json", 0.005, |_| true);
}

/// The slower tier: `cargo test --release -p memra-engine --test model_golden -- --ignored`.
#[test]
#[ignore = "slow tier: the 1.5B model (1.1 GB, a few minutes on 2 cores)"]
fn qwen_1_5b_greedy_and_perplexity() {
    check_greedy("qwen2.5-coder-1.5b/greedy.json", |_| true);
    check_perplexity("qwen2.5-coder-1.5b/perplexity.json", 0.005, |_| true);
}
