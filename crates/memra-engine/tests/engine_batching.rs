//! The serving engine on the CPU: a sequence batched with others gives the tokens it gives
//! alone, however the step budget chunks its prompt, whether its prefix comes from the
//! cache, and when a small pool forces preemption; bad requests are refused before they
//! start; a request whose client goes away gives its blocks back.

use std::sync::Arc;

use memra_engine::engine::{
    CpuBatchRunner, Engine, EngineConfig, EngineError, Event, FinishReason, GenerationParams,
    Request, Usage,
};
use memra_engine::models::{LogitRows, Model};
use memra_engine::sampler::{argmax, SamplerConfig};
use memra_engine::scheduler::SchedulerConfig;
use memra_engine::spec::draft::{check_vocab, DraftModel};
use memra_engine::spec::{DraftPolicy, SpecConfig};

mod common;
use common::model_path;

const N_CTX: usize = 512;

fn greedy_config() -> SamplerConfig {
    SamplerConfig {
        temperature: 0.0,
        ..SamplerConfig::default()
    }
}

/// Greedy tokens of one prompt by the model's single-sequence forward (no engine, no
/// scheduler), stopping at an end-of-generation token as the engine does.
fn alone(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.decoder.new_cache(prompt.len() + n);
    let mut logits = model
        .decoder
        .forward(&mut cache, prompt, LogitRows::Last)
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        let best = argmax(&logits);
        if model.tokenizer.is_end_of_generation(best) {
            break;
        }
        out.push(best);
        if out.len() < n {
            logits = model
                .decoder
                .forward(&mut cache, &[best], LogitRows::Last)
                .unwrap();
        }
    }
    out
}

fn engine(model: &Arc<Model>, kv_tokens: usize, max_running: usize, budget: usize) -> Engine {
    engine_with(model, kv_tokens, max_running, budget, None, None)
}

/// An engine on the CPU, speculating as `spec` says (with `draft`'s model, if any).
fn engine_with(
    model: &Arc<Model>,
    kv_tokens: usize,
    max_running: usize,
    budget: usize,
    spec: Option<SpecConfig>,
    draft: Option<DraftModel>,
) -> Engine {
    let runner = CpuBatchRunner::new(model.clone(), kv_tokens, 16);
    Engine::start_with_draft(
        model.clone(),
        Box::new(runner),
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running,
                token_budget: budget,
                prompt_chunk: budget,
            },
            n_ctx: N_CTX,
            spec,
        },
        draft,
    )
}

fn request(prompt: &[u32], n: usize, sampler: SamplerConfig) -> Request {
    Request {
        prompt: prompt.to_vec(),
        params: GenerationParams {
            max_tokens: n,
            sampler,
            ..GenerationParams::default()
        },
    }
}

/// Submits every request at once; returns each one's tokens and usage.
fn run_all(e: &Engine, reqs: &[Request]) -> Vec<(Vec<u32>, Usage)> {
    let handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    handles
        .into_iter()
        .map(|h| {
            let mut ids = Vec::new();
            for ev in h {
                match ev {
                    Event::Token(t) => ids.push(t.id),
                    Event::Finished { usage, .. } => return (ids, usage),
                    Event::Error(e) => panic!("{e}"),
                    Event::PromptScores(_) | Event::Embedding(_) => {}
                }
            }
            panic!("no finish")
        })
        .collect()
}

/// Prompts of different lengths (3 to ~60 tokens) and contents.
fn prompts(model: &Model) -> Vec<Vec<u32>> {
    [
        "Hello",
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who \
         every morning rowed out before dawn and came back with the tide.",
        "1, 2, 3, 4, 5,",
        "// Binary search in C\nint search(int *a, int n, int x) {",
    ]
    .iter()
    .map(|p| model.tokenizer.encode(p, true, true).unwrap())
    .collect()
}

const MODELS: [&str; 6] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-qwen3moe",
    "tiny-gemma3",
    "qwen2.5-coder-0.5b-instruct-q4_k_m",
];

#[test]
fn a_batch_gives_each_sequence_its_tokens_alone() {
    for name in MODELS {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let n = 12;
        let ps = prompts(&model);
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, n)).collect();
        let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
        // Whole prompts in one step, and prompts chunked by small budgets (a budget of 5
        // splits every prompt but the first, and mixes chunks with decodes).
        for budget in [2048, 5, 17] {
            let e = engine(&model, N_CTX * 8, 8, budget);
            let got = run_all(&e, &reqs);
            for (i, ((ids, _), w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(ids, w, "{name}: prompt {i}, budget {budget}");
            }
        }
        eprintln!("{name}: 6 sequences batched = alone at budgets 2048, 5, 17");
    }
}

#[test]
fn prefix_cache_hits_change_nothing() {
    for name in [
        "tiny-llama",
        "tiny-gemma3",
        "qwen2.5-coder-0.5b-instruct-q4_k_m",
    ] {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let shared = model
            .tokenizer
            .encode(
                &"You are a helpful assistant. Answer briefly and precisely, and say so when \
                  you do not know. Here is the question of the user, who asks about"
                    .repeat(2),
                true,
                true,
            )
            .unwrap();
        assert!(shared.len() >= 32, "two full blocks at least");
        let ps: Vec<Vec<u32>> = [" cats", " the history of Rome", " prime numbers", ""]
            .iter()
            .map(|tail| {
                let mut p = shared.clone();
                p.extend(model.tokenizer.encode(tail, false, true).unwrap());
                p
            })
            .collect();
        let n = 10;
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, n)).collect();
        let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
        let e = engine(&model, N_CTX * 8, 8, 2048);
        // All at once: the first computes the shared blocks, the others wait and reuse them.
        let got = run_all(&e, &reqs);
        let full_blocks = shared.len() / 16 * 16;
        for (i, ((ids, usage), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(ids, w, "{name}: prompt {i}");
            if i > 0 {
                assert!(
                    usage.cached_tokens >= full_blocks.min(ps[i].len() - 1) / 16 * 16,
                    "{name}: prompt {i}: {usage:?}"
                );
            }
        }
        // Again, later: the finished sequences' blocks are still cached.
        let again = run_all(&e, &reqs[..1]);
        assert_eq!(again[0].0, want[0], "{name}: cached rerun");
        assert!(again[0].1.cached_tokens >= full_blocks, "{:?}", again[0].1);
        eprintln!("{name}: prefix hits, same tokens");
    }
}

#[test]
fn preemption_in_a_small_pool_loses_and_duplicates_nothing() {
    for name in [
        "tiny-qwen2",
        "tiny-qwen3moe",
        "qwen2.5-coder-0.5b-instruct-q4_k_m",
    ] {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let n = 24;
        let ps = prompts(&model);
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, n)).collect();
        // Exactly the prompts' blocks (every prompt admitted in the first step), or the
        // longest request's: sequences growing into a new block find none free.
        let longest = ps.iter().map(|p| p.len()).max().unwrap() + n;
        let prompt_blocks: usize = ps.iter().map(|p| p.len().div_ceil(16)).sum();
        let e = engine(
            &model,
            prompt_blocks.max(longest.div_ceil(16)) * 16,
            8,
            2048,
        );
        let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
        let got = run_all(&e, &reqs);
        let preemptions: usize = got.iter().map(|(_, u)| u.preemptions).sum();
        assert!(preemptions > 0, "{name}: the pool was meant to run out");
        for (i, ((ids, _), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(ids, w, "{name}: prompt {i}");
        }
        eprintln!("{name}: {preemptions} preemptions, every sequence complete and unchanged");
        // Scoring requests (completions' echo with logprobs) preempted: their prompt is
        // recomputed, its scores go out once.
        let mut scored = reqs.clone();
        scored
            .iter_mut()
            .for_each(|r| r.params.score_from = Some(0));
        let handles: Vec<_> = scored
            .iter()
            .map(|r| e.submit(r.clone()).unwrap())
            .collect();
        let mut preempted = 0;
        for ((h, p), w) in handles.into_iter().zip(&ps).zip(&want) {
            let events: Vec<Event> = h.collect();
            let scores: Vec<&Vec<_>> = events
                .iter()
                .filter_map(|e| match e {
                    Event::PromptScores(s) => Some(s),
                    _ => None,
                })
                .collect();
            assert_eq!(scores.len(), 1, "{name}: scores sent once");
            assert_eq!(scores[0].len(), p.len() - 1);
            assert!(scores[0]
                .iter()
                .all(|s| s.logprob <= 0.0 && s.logprob.is_finite()));
            let ids: Vec<u32> = events
                .iter()
                .filter_map(|e| match e {
                    Event::Token(t) => Some(t.id),
                    _ => None,
                })
                .collect();
            assert_eq!(&ids, w, "{name}: scored and generated");
            preempted += events
                .iter()
                .map(|e| match e {
                    Event::Finished { usage, .. } => usage.preemptions,
                    _ => 0,
                })
                .sum::<usize>();
        }
        assert!(
            preempted > 0,
            "{name}: the scoring requests were meant to be preempted"
        );
    }
}

#[test]
fn sampled_sequences_batched_equal_alone() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let ps = prompts(&model);
    let reqs: Vec<Request> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            request(
                p,
                16,
                SamplerConfig {
                    seed: 100 + i as u64,
                    repeat_penalty: 1.1,
                    ..SamplerConfig::default()
                },
            )
        })
        .collect();
    let batched = run_all(&engine(&model, N_CTX * 8, 8, 2048), &reqs);
    for (i, r) in reqs.iter().enumerate() {
        let one = run_all(&engine(&model, N_CTX, 1, 2048), std::slice::from_ref(r));
        assert_eq!(one[0].0, batched[i].0, "prompt {i}");
    }
}

#[test]
fn stop_strings_logprobs_and_scores() {
    let model = Arc::new(Model::load(&model_path("tiny-qwen2")).unwrap());
    let e = engine(&model, N_CTX * 2, 2, 2048);
    let prompt = &prompts(&model)[3];
    let want = alone(&model, prompt, 16);
    let text = model.tokenizer.decode_lossy(&want, false).unwrap();
    // A stop string inside the greedy text: the output ends right before it.
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(3).collect();
    let mut r = request(prompt, 16, greedy_config());
    r.params.stop = vec![stop.clone()];
    r.params.logprobs = Some(3);
    let mut out = String::new();
    let mut reason = None;
    for ev in e.submit(r).unwrap() {
        match ev {
            Event::Token(t) => {
                out.push_str(&t.text);
                let lp = t.logprob.unwrap();
                assert!(lp <= 0.0);
                assert_eq!(t.top_logprobs.len(), 3);
                // Greedy: the chosen token is the best alternative.
                assert_eq!(t.top_logprobs[0].0, t.id);
                assert!((t.top_logprobs[0].1 - lp).abs() < 1e-5);
                assert!(t.top_logprobs[1].1 <= t.top_logprobs[0].1);
            }
            Event::Finished {
                reason: r, text, ..
            } => {
                out.push_str(&text);
                reason = Some(r);
            }
            _ => {}
        }
    }
    assert_eq!(reason, Some(FinishReason::StopString));
    assert_eq!(out, text[..text.find(&stop).unwrap()], "stop {stop:?}");
    // Prompt scores equal log-softmax of the single-sequence logits.
    let mut cache = model.decoder.new_cache(prompt.len());
    let logits = model
        .decoder
        .forward(&mut cache, prompt, LogitRows::From(0))
        .unwrap();
    let nv = model.decoder.hp.n_vocab;
    let from = 5;
    let mut r = request(prompt, 0, greedy_config());
    r.params.score_from = Some(from);
    let scores = e
        .submit(r)
        .unwrap()
        .find_map(|ev| match ev {
            Event::PromptScores(s) => Some(s),
            _ => None,
        })
        .unwrap();
    assert_eq!(scores.len(), prompt.len() - 1 - from);
    let log_softmax = |k: usize| -> Vec<f32> {
        let row = &logits[(from + k) * nv..(from + k + 1) * nv];
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let lse = max + row.iter().map(|&v| (v - max).exp()).sum::<f32>().ln();
        row.iter().map(|&v| v - lse).collect()
    };
    for (k, s) in scores.iter().enumerate() {
        let want = log_softmax(k)[prompt[from + k + 1] as usize];
        let got = s.logprob;
        assert!(
            (got - want).abs() < 1e-3,
            "position {}: {got} vs {want}",
            from + k
        );
        assert!(s.top_logprobs.is_empty(), "no alternatives asked");
    }
    // With `logprobs` (completions' echo): each position's best alternatives too, and
    // the scores come before the first generated token.
    let mut r = request(prompt, 2, greedy_config());
    r.params.score_from = Some(from);
    r.params.logprobs = Some(3);
    r.params.ignore_eos = true;
    let events: Vec<Event> = e.submit(r).unwrap().collect();
    let at = |f: fn(&Event) -> bool| events.iter().position(f).unwrap();
    assert!(at(|e| matches!(e, Event::PromptScores(_))) < at(|e| matches!(e, Event::Token(_))));
    let Some(Event::PromptScores(scores)) =
        events.iter().find(|e| matches!(e, Event::PromptScores(_)))
    else {
        unreachable!()
    };
    for (k, s) in scores.iter().enumerate() {
        let ls = log_softmax(k);
        let mut best: Vec<u32> = (0..nv as u32).collect();
        best.sort_by(|&a, &b| ls[b as usize].total_cmp(&ls[a as usize]));
        assert_eq!(s.top_logprobs.len(), 3);
        for (&(id, lp), &want) in s.top_logprobs.iter().zip(&best) {
            assert!(
                (lp - ls[want as usize]).abs() < 1e-3,
                "position {}",
                from + k
            );
            // Near-ties may order otherwise than the reference's rounding.
            assert!(id == want || (ls[id as usize] - ls[want as usize]).abs() < 1e-3);
        }
    }
}

#[test]
fn bad_requests_are_refused_before_they_start() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let e = engine(&model, 64, 2, 2048);
    let ok = vec![1u32, 2, 3];
    let nv = model.decoder.hp.n_vocab as u32;
    let cases: Vec<(Request, EngineError)> = vec![
        (request(&[], 4, greedy_config()), EngineError::EmptyPrompt),
        (
            request(&[1, nv], 4, greedy_config()),
            EngineError::BadToken(nv),
        ),
        (request(&ok, 0, greedy_config()), EngineError::NoTokens),
        (
            request(&ok, N_CTX, greedy_config()),
            EngineError::TooLong {
                prompt: 3,
                max_tokens: N_CTX,
                n_ctx: N_CTX,
            },
        ),
        // A count that would overflow the sum is still too long.
        (
            request(&ok, usize::MAX, greedy_config()),
            EngineError::TooLong {
                prompt: 3,
                max_tokens: usize::MAX,
                n_ctx: N_CTX,
            },
        ),
        (
            request(&ok, 100, greedy_config()),
            EngineError::PoolTooSmall {
                needed: 102,
                pool: 64,
            },
        ),
    ];
    for (r, want) in cases {
        let err = e.submit(r).err().expect("refused");
        assert_eq!(err, want);
        assert!(!err.to_string().is_empty());
    }
    let mut bad = request(&ok, 4, greedy_config());
    bad.params.sampler.top_p = 2.0;
    assert!(matches!(e.submit(bad), Err(EngineError::Sampler(_))));
    // The engine still serves after refusals.
    assert_eq!(
        run_all(&e, &[request(&ok, 4, greedy_config())])[0].0.len(),
        4
    );
}

#[test]
fn a_client_that_goes_away_gives_its_blocks_back() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    // Room for one long request at a time.
    let e = engine(&model, 128, 4, 2048);
    let p = prompts(&model)[0].clone();
    let mut long = request(&p, 120, greedy_config());
    long.params.ignore_eos = true;
    let mut h = e.submit(long.clone()).unwrap();
    for _ in 0..3 {
        assert!(matches!(h.next(), Some(Event::Token(_))));
    }
    drop(h);
    // Needs the whole pool: it completes only if the dropped request's blocks came back.
    let got = run_all(&e, &[long]);
    assert_eq!(got[0].0.len(), 120);
    assert_eq!(got[0].1.preemptions, 0);
}

#[test]
fn stats_show_running_sequences_and_their_blocks_then_free_ones() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let e = engine(&model, 256, 4, 2048);
    assert_eq!(e.stats().num_blocks, 16);
    assert_eq!(e.stats().blocks_used, 0);
    let p = prompts(&model)[0].clone();
    let mut long = request(&p, 100, greedy_config());
    long.params.ignore_eos = true;
    let mut h = e.submit(long).unwrap();
    for _ in 0..3 {
        assert!(matches!(h.next(), Some(Event::Token(_))));
    }
    let s = e.stats();
    assert_eq!((s.running, s.waiting), (1, 0));
    assert!(s.blocks_used >= p.len().div_ceil(16), "{s:?}");
    drop(h);
    // The cancel reaches the engine thread, which publishes before it sleeps.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while e.stats().blocks_used > 0 || e.stats().running > 0 {
        assert!(std::time::Instant::now() < deadline, "{:?}", e.stats());
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(e.stats().waiting, 0);
}

/// Constrained sequences batched with plain ones: greedy, sampled, and sampled here from
/// logits (log-probabilities asked), each ends by the grammar (a bounded schema) with JSON
/// that matches it, while the plain sequences give the tokens they give alone.
#[test]
fn constrained_sequences_match_their_schema_beside_plain_ones() {
    use memra_engine::constraint::Grammar;
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let e = engine(&model, 4096, 8, 64);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": false,
    });
    let ps = prompts(&model);
    let mut reqs = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        let mut r = request(p, 60, greedy_config());
        if i % 2 == 0 {
            r.params.constraint = Some(
                e.compile_grammar(&Grammar::JsonSchema(schema.clone()))
                    .unwrap(),
            );
            r.params.sampler = SamplerConfig {
                temperature: [0.0, 0.9, 1.5][i / 2 % 3],
                seed: i as u64,
                ..SamplerConfig::default()
            };
            r.params.logprobs = (i == 4).then_some(2);
        }
        reqs.push(r);
    }
    let out = run_all(&e, &reqs);
    for (i, ((ids, usage), p)) in out.iter().zip(&ps).enumerate() {
        if i % 2 == 1 {
            assert_eq!(ids, &alone(&model, p, 60), "plain prompt {i}");
            continue;
        }
        let text = model.tokenizer.decode_lossy(ids, false).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("prompt {i}: {text:?} is not JSON: {e}"));
        let color = v["color"].as_str().unwrap_or_default();
        assert!(
            ["red", "green", "blue"].contains(&color),
            "prompt {i}: {text}"
        );
        assert!(
            v["n"].as_u64().is_some_and(|n| n <= 9),
            "prompt {i}: {text}"
        );
        assert!(v["ok"].is_boolean(), "prompt {i}: {text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "prompt {i}: {text}");
        assert!(
            usage.completion_tokens < 60,
            "prompt {i}: ended by the grammar"
        );
    }
    // The finish reason of a completed grammar is the end of generation.
    let mut r = request(&ps[0], 60, greedy_config());
    r.params.constraint = Some(e.compile_grammar(&Grammar::JsonSchema(schema)).unwrap());
    let last = e.submit(r).unwrap().last().unwrap();
    assert!(
        matches!(
            last,
            Event::Finished {
                reason: FinishReason::EndOfGeneration,
                ..
            }
        ),
        "{last:?}"
    );
}

/// The shared prompts and one that repeats itself, where prompt lookup finds drafts.
fn lookup_prompts(model: &Model) -> Vec<Vec<u32>> {
    let mut ps = prompts(model);
    let repeating = "one two three four one two three four one two three";
    ps.push(model.tokenizer.encode(repeating, true, true).unwrap());
    ps
}

/// Prompt lookup by the length rule, so that every step drafts what it finds (the cost
/// rule stops drafting that loses, as it may on the CPU, leaving nothing to verify).
fn spec_engine(model: &Arc<Model>, budget: usize, kv_tokens: usize) -> Engine {
    spec_engine_by(model, budget, kv_tokens, DraftPolicy::Length)
}

fn spec_engine_by(
    model: &Arc<Model>,
    budget: usize,
    kv_tokens: usize,
    policy: DraftPolicy,
) -> Engine {
    let spec = SpecConfig {
        ngram: 3,
        draft_max: 6,
        draft_min: 1,
        max_batch: 8,
        policy,
    };
    engine_with(model, kv_tokens, 8, budget, Some(spec), None)
}

/// Speculative decoding with prompt lookup at temperature 0: every sequence gets exactly
/// the tokens of plain decoding, with whole verify steps, verify steps chunked by a small
/// budget, and in a pool small enough to preempt sequences holding drafts; and the drafts
/// are accepted often enough to matter (the prompts repeat themselves).
#[test]
fn speculative_greedy_decoding_gives_plain_decodings_tokens() {
    for name in MODELS {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let n = 24;
        let ps = lookup_prompts(&model);
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&model, p, n)).collect();
        let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
        let longest = ps.iter().map(|p| p.len()).max().unwrap() + n;
        let configs = [
            (2048, N_CTX * 8, "whole"),
            (5, N_CTX * 8, "budget 5"),
            (2048, longest.div_ceil(16) * 16 + 16, "small pool"),
        ];
        // The real model (slow on the CPU) in one configuration; the tiny ones in all.
        let configs = if name.starts_with("tiny") {
            &configs[..]
        } else {
            &configs[..1]
        };
        for &(budget, kv, label) in configs {
            let got = run_all(&spec_engine(&model, budget, kv), &reqs);
            let (mut drafted, mut accepted) = (0, 0);
            for (i, ((ids, usage), w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(ids, w, "{name} {label}: prompt {i}");
                assert!(usage.accepted_tokens <= usage.draft_tokens);
                drafted += usage.draft_tokens;
                accepted += usage.accepted_tokens;
            }
            eprintln!("{name} {label}: {accepted} of {drafted} drafts accepted");
            assert!(accepted > 0, "{name} {label}: no draft accepted");
        }
    }
}

/// Speculative decoding at temperature 0.9: the joint distribution of the second and third
/// generated tokens (the first a verify step decides) is the same with and without
/// speculation, by a two-sample chi-square test over 2,000 seeds each. A logit bias keeps
/// the draws to three tokens of the prompt (in the model's own proportions), so that
/// prompt lookup finds a draft after each.
#[test]
fn speculative_sampling_keeps_the_distribution() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let prompt = model
        .tokenizer
        .encode(
            "the cat sat on the mat and the dog sat on the log and the bird sat on the cat",
            true,
            true,
        )
        .unwrap();
    let n = 2000;
    let mut three: Vec<u32> = prompt.clone();
    three.sort();
    three.dedup();
    let bias: std::collections::HashMap<u32, f32> = three[three.len() - 3..]
        .iter()
        .map(|&t| (t, 100.0))
        .collect();
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            request(
                &prompt,
                3,
                SamplerConfig {
                    temperature: 0.9,
                    top_k: 3,
                    top_p: 1.0,
                    min_p: 0.0,
                    logit_bias: bias.clone(),
                    seed: 1000 + i as u64,
                    ..SamplerConfig::default()
                },
            )
        })
        .collect();
    let plain = run_all(&engine(&model, N_CTX * 8, 8, 2048), &reqs);
    let spec = run_all(&spec_engine(&model, 2048, N_CTX * 8), &reqs);
    let drafted = spec.iter().filter(|(_, u)| u.draft_tokens > 0).count();
    assert!(drafted > n / 5, "only {drafted} of {n} sequences drafted");
    homogeneous(&plain, &spec, |ids| (ids[1], ids[2]));
}

fn draft_engine(target: &Arc<Model>, draft: &Arc<Model>, budget: usize, kv: usize) -> Engine {
    draft_engine_by(target, draft, budget, kv, DraftPolicy::Length)
}

fn draft_engine_by(
    target: &Arc<Model>,
    draft: &Arc<Model>,
    budget: usize,
    kv: usize,
    policy: DraftPolicy,
) -> Engine {
    check_vocab(target, draft).unwrap();
    let d = DraftModel::new(
        draft.clone(),
        Box::new(CpuBatchRunner::new(draft.clone(), N_CTX * 8, 16)),
    );
    let spec = SpecConfig {
        ngram: 1,
        draft_max: 5,
        draft_min: 1,
        max_batch: 8,
        policy,
    };
    engine_with(target, kv, 8, budget, Some(spec), Some(d))
}

/// The cost rule (draft lengths from measured step times, so they differ from run to run,
/// and drafting may stop where it loses): still plain decoding's tokens, with prompt
/// lookup and with a draft model, whole and chunked by a small budget.
#[test]
fn speculation_by_cost_gives_plain_decodings_tokens() {
    let t = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let d = Arc::new(Model::load(&model_path("tiny-qwen2")).unwrap());
    let n = 24;
    let ps = lookup_prompts(&t);
    let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&t, p, n)).collect();
    let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
    for budget in [2048, 5] {
        let lookup = spec_engine_by(&t, budget, N_CTX * 8, DraftPolicy::Cost);
        let drafted = draft_engine_by(&t, &d, budget, N_CTX * 8, DraftPolicy::Cost);
        for (engine, label) in [(lookup, "lookup"), (drafted, "draft model")] {
            let got = run_all(&engine, &reqs);
            for (i, ((ids, usage), w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(ids, w, "{label}, budget {budget}: prompt {i}");
                assert!(usage.accepted_tokens <= usage.draft_tokens);
            }
        }
    }
}

/// A draft model at temperature 0: every sequence gets plain decoding's tokens, with
/// another model drafting (tiny-qwen2 for tiny-llama: same vocabulary, other weights) and
/// a model drafting for itself (every draft accepted), whole, chunked by a small budget,
/// and in a pool that preempts.
#[test]
fn draft_model_greedy_decoding_gives_plain_decodings_tokens() {
    for (target, draft) in [("tiny-llama", "tiny-qwen2"), ("tiny-qwen3", "tiny-qwen3")] {
        let t = Arc::new(Model::load(&model_path(target)).unwrap());
        let d = Arc::new(Model::load(&model_path(draft)).unwrap());
        let n = 20;
        let ps = prompts(&t);
        let want: Vec<Vec<u32>> = ps.iter().map(|p| alone(&t, p, n)).collect();
        let reqs: Vec<Request> = ps.iter().map(|p| request(p, n, greedy_config())).collect();
        let longest = ps.iter().map(|p| p.len()).max().unwrap() + n;
        for (budget, kv, label) in [
            (2048, N_CTX * 8, "whole"),
            (5, N_CTX * 8, "budget 5"),
            (2048, longest.div_ceil(16) * 16 + 16, "small pool"),
        ] {
            let got = run_all(&draft_engine(&t, &d, budget, kv), &reqs);
            let (mut drafted, mut accepted) = (0, 0);
            for (i, ((ids, usage), w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(ids, w, "{target} drafted by {draft}, {label}: prompt {i}");
                drafted += usage.draft_tokens;
                accepted += usage.accepted_tokens;
            }
            eprintln!("{target} drafted by {draft}, {label}: {accepted} of {drafted} accepted");
            assert!(drafted > 0);
            if target == draft && label != "budget 5" {
                assert_eq!(accepted, drafted, "a model drafting for itself");
            }
        }
    }
}

/// A draft model at temperature 1 over the whole vocabulary (a different model, so the
/// draft's distribution differs from the target's: drafts are accepted and rejected): the
/// joint distribution of the second and third tokens, in 4 x 4 classes of ids, is the same
/// as without speculation (two-sample chi-square over 2,000 seeds).
#[test]
fn draft_model_sampling_keeps_the_distribution() {
    let t = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let d = Arc::new(Model::load(&model_path("tiny-qwen2")).unwrap());
    let prompt = t
        .tokenizer
        .encode("the cat sat on the mat", true, true)
        .unwrap();
    let n = 2000;
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            request(
                &prompt,
                3,
                SamplerConfig {
                    temperature: 1.0,
                    top_k: 0,
                    top_p: 1.0,
                    min_p: 0.0,
                    seed: 5000 + i as u64,
                    ..SamplerConfig::default()
                },
            )
        })
        .collect();
    let plain = run_all(&engine(&t, N_CTX * 8, 8, 2048), &reqs);
    let spec = run_all(&draft_engine(&t, &d, 2048, N_CTX * 8), &reqs);
    let (drafted, accepted): (usize, usize) = spec.iter().fold((0, 0), |(a, b), (_, u)| {
        (a + u.draft_tokens, b + u.accepted_tokens)
    });
    eprintln!("{accepted} of {drafted} drafts accepted");
    assert!(
        drafted > n * 9 / 10 && accepted > n / 10 && accepted < drafted,
        "{accepted} of {drafted}"
    );
    // A run that ended early (an end-of-generation token) is a class of its own.
    let class = |ids: &[u32], i: usize| ids.get(i).map_or(4, |t| t % 4);
    homogeneous(&plain, &spec, |ids| (class(ids, 1), class(ids, 2)));
}

/// Two-sample chi-square of homogeneity over a class of each run's tokens, at the 0.1%
/// level; classes with fewer than 20 draws in all pooled.
fn homogeneous(
    a: &[(Vec<u32>, Usage)],
    b: &[(Vec<u32>, Usage)],
    class: impl Fn(&[u32]) -> (u32, u32),
) {
    let hist = |runs: &[(Vec<u32>, Usage)]| {
        let mut h = std::collections::HashMap::new();
        for (ids, _) in runs {
            *h.entry(class(ids)).or_insert(0usize) += 1;
        }
        h
    };
    let (a, b) = (hist(a), hist(b));
    let mut keys: Vec<_> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let (mut chi, mut dof, mut rest) = (0.0f64, 0usize, (0usize, 0usize));
    let mut add = |x: usize, y: usize| {
        let e = (x + y) as f64 / 2.0;
        chi += (x as f64 - e).powi(2) / e + (y as f64 - e).powi(2) / e;
        dof += 1;
    };
    for k in keys {
        let (x, y) = (
            a.get(&k).copied().unwrap_or(0),
            b.get(&k).copied().unwrap_or(0),
        );
        if x + y < 20 {
            rest = (rest.0 + x, rest.1 + y);
        } else {
            add(x, y);
        }
    }
    if rest.0 + rest.1 > 0 {
        add(rest.0, rest.1);
    }
    // 0.1% critical values of chi-square for 1..20 degrees of freedom (classes - 1).
    let critical = [
        10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
        36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31,
    ][dof - 2];
    eprintln!("chi-square {chi:.2} over {dof} classes");
    assert!(chi < critical, "chi-square {chi:.2} >= {critical}");
}

#[test]
fn a_draft_with_another_vocabulary_is_refused() {
    let t = Model::load(&model_path("qwen2.5-coder-0.5b-instruct-q4_k_m")).unwrap();
    let d = Model::load(&model_path("tiny-llama")).unwrap();
    let e = check_vocab(&t, &d).unwrap_err();
    assert!(e.contains("vocabulary") && e.contains("267"), "{e}");
    check_vocab(&d, &d).unwrap();
}

#[test]
fn tensor_parallel_ranks_batched_give_each_sequence_its_tokens_alone() {
    // tiny-qwen3 is the tiny model that splits over 2 ranks (docs/parallel.md); budget 17
    // chunks the prompts, so prompt chunks and decodes share steps.
    let model = Arc::new(Model::load(&model_path("tiny-qwen3")).unwrap());
    let runner = CpuBatchRunner::tensor_parallel(model.clone(), 2, 6 * N_CTX, 16).unwrap();
    let e = Engine::start(
        model.clone(),
        Box::new(runner),
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: 6,
                token_budget: 17,
                prompt_chunk: 17,
            },
            n_ctx: N_CTX,
            spec: None,
        },
    );
    assert!(e.info().pool.contains("split over 2 tensor-parallel ranks"));
    let prompts = prompts(&model);
    let reqs: Vec<_> = prompts
        .iter()
        .map(|p| request(p, 12, greedy_config()))
        .collect();
    for (p, (ids, _)) in prompts.iter().zip(run_all(&e, &reqs)) {
        assert_eq!(ids, alone(&model, p, 12));
    }
}

/// A request's own bounds on its drafts: none with a most of 0, at most 2 a step with 2,
/// and the tokens of plain decoding whatever the bounds.
#[test]
fn a_request_bounds_its_own_drafts() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let p = model
        .tokenizer
        .encode("one two three four one two three four one two", true, true)
        .unwrap();
    let n = 24;
    let want = alone(&model, &p, n);
    let with = |max: Option<usize>| {
        let mut r = request(&p, n, greedy_config());
        r.params.draft_max = max;
        run_all(&spec_engine(&model, 2048, N_CTX * 8), &[r]).remove(0)
    };
    let (ids, none) = with(Some(0));
    assert_eq!((ids, none.draft_tokens), (want.clone(), 0));
    let (ids, two) = with(Some(2));
    assert_eq!(ids, want);
    // Each verify step drafted at most 2 and gave at least one token.
    assert!(two.draft_tokens > 0 && two.draft_tokens <= 2 * n, "{two:?}");
    let (ids, free) = with(None);
    assert_eq!(ids, want);
    assert!(
        free.accepted_tokens >= two.accepted_tokens,
        "{free:?} vs {two:?}"
    );
}
