//! Embedding requests on the CPU engine: the state returned is the one the output
//! projection turns into the model's logits; mean and first-token pooling equal the last
//! states of the prompt's prefixes (causal attention), batched or alone, however the step
//! budget chunks the prompt, beside generating requests.

use std::sync::Arc;

use memra_engine::backend::cpu::matmul::matmul_with;
use memra_engine::batch::{ForwardBatch, RowOut, RowPick};
use memra_engine::engine::{
    BatchRunner, CpuBatchRunner, Engine, EngineConfig, EngineError, Event, GenerationParams,
    Pooling, Request, Usage,
};
use memra_engine::models::weights::WeightRows;
use memra_engine::models::{LogitRows, Model};
use memra_engine::scheduler::SchedulerConfig;
use memra_engine::spec::{DraftPolicy, SpecConfig};

mod common;
use common::model_path;

const MODELS: [&str; 4] = ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-gemma3"];

fn engine(model: &Arc<Model>, budget: usize, kv_tokens: usize) -> Engine {
    engine_with(model, budget, kv_tokens, None)
}

fn engine_with(
    model: &Arc<Model>,
    budget: usize,
    kv_tokens: usize,
    spec: Option<SpecConfig>,
) -> Engine {
    let runner = CpuBatchRunner::new(model.clone(), kv_tokens, 16);
    start(model, Box::new(runner), budget, spec)
}

/// An engine over `runner`: 8 sequences at once, steps of `budget` tokens.
fn start(
    model: &Arc<Model>,
    runner: Box<dyn BatchRunner>,
    budget: usize,
    spec: Option<SpecConfig>,
) -> Engine {
    Engine::start(
        model.clone(),
        runner,
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: 8,
                token_budget: budget,
                prompt_chunk: budget,
            },
            n_ctx: 256,
            spec,
        },
    )
}

fn embed_request(prompt: &[u32], pooling: Pooling) -> Request {
    Request {
        prompt: prompt.to_vec(),
        params: GenerationParams {
            max_tokens: 0,
            embed: Some(pooling),
            ..GenerationParams::default()
        },
    }
}

/// Each request's embedding, all submitted at once.
fn embed_all(e: &Engine, reqs: &[Request]) -> Vec<Vec<f32>> {
    embed_all_usage(e, reqs)
        .into_iter()
        .map(|(v, _)| v)
        .collect()
}

/// Each request's embedding and usage, all submitted at once.
fn embed_all_usage(e: &Engine, reqs: &[Request]) -> Vec<(Vec<f32>, Usage)> {
    let handles: Vec<_> = reqs.iter().map(|r| e.submit(r.clone()).unwrap()).collect();
    handles
        .into_iter()
        .map(|h| {
            let mut got = None;
            for ev in h {
                match ev {
                    Event::Embedding(v) => got = Some(v),
                    Event::Finished { usage, .. } => {
                        assert_eq!(usage.completion_tokens, 0);
                        return (got.expect("an embedding before the finish"), usage);
                    }
                    Event::Error(e) => panic!("{e}"),
                    other => panic!("an embedding request sent {other:?}"),
                }
            }
            panic!("no finish")
        })
        .collect()
}

fn prompts(model: &Model) -> Vec<Vec<u32>> {
    [
        "Hello",
        "The capital of France is Paris, and the capital of Italy is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    ]
    .iter()
    .map(|p| model.tokenizer.encode(p, true, true).unwrap())
    .collect()
}

fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}: element {i}: {g} against {w} (scale {scale})"
        );
    }
}

#[test]
fn the_last_state_is_what_the_output_projection_reads() {
    for name in MODELS {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let d = &model.decoder;
        let ps = prompts(&model);
        let reqs: Vec<Request> = ps.iter().map(|p| embed_request(p, Pooling::Last)).collect();
        let got = embed_all(&engine(&model, 2048, 4096), &reqs);
        for (p, h) in ps.iter().zip(&got) {
            assert_eq!(h.len(), d.hp.n_embd);
            // The model's own logits of the prompt's last token, by the single-sequence
            // forward; the output projection of the state must give them.
            let mut cache = d.new_cache(p.len());
            let want = d.forward(&mut cache, p, LogitRows::Last).unwrap();
            let mut logits = vec![0f32; d.output.n_out()];
            matmul_with(&d.output, h, None, &mut logits, d.exact_activations);
            if let Some(cap) = d.final_logit_softcap {
                logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
            }
            assert_close(&logits, &want, 1e-5, name);
        }
        eprintln!("{name}: last-token states give the model's logits");
    }
}

#[test]
fn mean_and_first_token_pooling_equal_the_prefixes_last_states() {
    for name in MODELS {
        let model = Arc::new(Model::load(&model_path(name)).unwrap());
        let ps = prompts(&model);
        let e = engine(&model, 2048, 4096);
        for p in &ps {
            // With causal attention a token's state in the prompt is the last state of the
            // prefix that ends with it.
            let prefixes: Vec<Request> = (1..=p.len())
                .map(|i| embed_request(&p[..i], Pooling::Last))
                .collect();
            let lasts = embed_all(&e, &prefixes);
            let n = lasts.len() as f32;
            let mean: Vec<f32> = (0..lasts[0].len())
                .map(|j| lasts.iter().map(|s| s[j]).sum::<f32>() / n)
                .collect();
            // Chunked by budgets of 3 and 7 too, beside other requests.
            for budget in [2048, 3, 7] {
                let e = engine(&model, budget, 4096);
                let got = embed_all(
                    &e,
                    &[
                        embed_request(p, Pooling::Mean),
                        embed_request(p, Pooling::Cls),
                        embed_request(&ps[1], Pooling::Last),
                    ],
                );
                assert_close(
                    &got[0],
                    &mean,
                    1e-4,
                    &format!("{name}: mean, budget {budget}"),
                );
                assert_close(
                    &got[1],
                    &lasts[0],
                    1e-4,
                    &format!("{name}: cls, budget {budget}"),
                );
            }
        }
        eprintln!("{name}: mean and cls pooling equal the prefixes' states at budgets 2048, 3, 7");
    }
}

#[test]
fn embeddings_beside_generation_change_neither() {
    let model = Arc::new(Model::load(&model_path("tiny-qwen2")).unwrap());
    let ps = prompts(&model);
    let generate = |p: &[u32]| Request {
        prompt: p.to_vec(),
        params: GenerationParams {
            max_tokens: 8,
            sampler: memra_engine::sampler::SamplerConfig {
                temperature: 0.0,
                ..Default::default()
            },
            ..GenerationParams::default()
        },
    };
    let tokens = |e: &Engine, r: &Request| -> Vec<u32> {
        e.submit(r.clone())
            .unwrap()
            .filter_map(|ev| match ev {
                Event::Token(t) => Some(t.id),
                _ => None,
            })
            .collect()
    };
    let e = engine(&model, 2048, 4096);
    let want_tokens = tokens(&e, &generate(&ps[2]));
    let want_embed = embed_all(&e, &[embed_request(&ps[3], Pooling::Mean)]);
    // Both at once, in a small budget (the prompt chunks share steps with the decodes).
    let e = engine(&model, 5, 4096);
    let h = e.submit(generate(&ps[2])).unwrap();
    let got_embed = embed_all(&e, &[embed_request(&ps[3], Pooling::Mean)]);
    let got_tokens: Vec<u32> = h
        .filter_map(|ev| match ev {
            Event::Token(t) => Some(t.id),
            _ => None,
        })
        .collect();
    assert_eq!(got_tokens, want_tokens);
    assert_close(&got_embed[0], &want_embed[0], 1e-4, "mean beside a decode");
}

#[test]
fn an_embedding_request_that_asks_for_tokens_is_refused() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let e = engine(&model, 2048, 4096);
    let mut r = embed_request(&[1, 2, 3], Pooling::Mean);
    r.params.max_tokens = 4;
    assert_eq!(e.submit(r).err(), Some(EngineError::BadEmbedding));
    let mut r = embed_request(&[1, 2, 3], Pooling::Mean);
    r.params.score_from = Some(0);
    assert_eq!(e.submit(r).err(), Some(EngineError::BadEmbedding));
    assert_eq!(
        e.submit(embed_request(&[], Pooling::Last)).err(),
        Some(EngineError::EmptyPrompt)
    );
}

#[test]
fn tensor_parallel_ranks_give_the_same_embeddings() {
    let model = Arc::new(Model::load(&model_path("tiny-qwen3")).unwrap());
    let ps = prompts(&model);
    let reqs: Vec<Request> = ps.iter().map(|p| embed_request(p, Pooling::Mean)).collect();
    let want = embed_all(&engine(&model, 2048, 4096), &reqs);
    let runner = CpuBatchRunner::tensor_parallel(model.clone(), 2, 4096, 16).unwrap();
    let e = start(&model, Box::new(runner), 7, None);
    for (i, (g, w)) in embed_all(&e, &reqs).iter().zip(&want).enumerate() {
        assert_close(g, w, 1e-3, &format!("prompt {i} over 2 ranks"));
    }
}

#[test]
fn last_pooling_from_the_prefix_cache_gives_the_same_state() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let p = &prompts(&model)[2];
    let e = engine(&model, 2048, 4096);
    let (first, u1) = embed_all_usage(&e, &[embed_request(p, Pooling::Last)]).remove(0);
    let (again, u2) = embed_all_usage(&e, &[embed_request(p, Pooling::Last)]).remove(0);
    assert_eq!(
        (u1.cached_tokens, u2.cached_tokens > 0),
        (0, true),
        "{u2:?}"
    );
    assert_close(&again, &first, 1e-5, "from the cache");
    // Mean pooling computes every state, whatever the cache holds.
    let (_, u3) = embed_all_usage(&e, &[embed_request(p, Pooling::Mean)]).remove(0);
    assert_eq!(u3.cached_tokens, 0);
}

#[test]
fn a_small_pool_preempts_embeddings_and_loses_nothing() {
    let model = Arc::new(Model::load(&model_path("tiny-qwen2")).unwrap());
    let ps = prompts(&model);
    let reqs: Vec<Request> = ps
        .iter()
        .flat_map(|p| {
            [
                embed_request(p, Pooling::Mean),
                embed_request(p, Pooling::Cls),
            ]
        })
        .collect();
    let want = embed_all(&engine(&model, 2048, 4096), &reqs);
    // A pool of 96 positions for 8 requests of up to ~30 tokens, with a long generation
    // beside them, in chunks of 5: sequences are preempted and recompute their prompts.
    let e = engine(&model, 5, 96);
    let long = e
        .submit(Request {
            prompt: ps[0].clone(),
            params: GenerationParams {
                max_tokens: 80,
                ignore_eos: true,
                ..GenerationParams::default()
            },
        })
        .unwrap();
    let got = embed_all_usage(&e, &reqs);
    let preempted: usize = got.iter().map(|(_, u)| u.preemptions).sum::<usize>()
        + long
            .filter_map(|ev| match ev {
                Event::Finished { usage, .. } => Some(usage.preemptions),
                _ => None,
            })
            .sum::<usize>();
    for (i, ((g, _), w)) in got.iter().zip(&want).enumerate() {
        assert_close(g, w, 1e-4, &format!("request {i}"));
    }
    eprintln!("{preempted} preemptions");
    assert!(
        preempted > 0,
        "the pool never ran out: the test checks nothing"
    );
}

#[test]
fn speculation_leaves_embeddings_alone() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let ps = prompts(&model);
    let reqs: Vec<Request> = ps.iter().map(|p| embed_request(p, Pooling::Mean)).collect();
    let want = embed_all(&engine(&model, 2048, 4096), &reqs);
    let spec = SpecConfig {
        ngram: 3,
        draft_max: 6,
        draft_min: 1,
        max_batch: 8,
        policy: DraftPolicy::Length,
    };
    let got = embed_all_usage(&engine_with(&model, 7, 4096, Some(spec)), &reqs);
    for ((g, u), w) in got.iter().zip(&want) {
        assert_eq!(u.draft_tokens, 0);
        assert_close(g, w, 1e-4, "with speculation on");
    }
}

/// A runner that computes no hidden states (as the GPU's, for now).
struct NoHidden(CpuBatchRunner);

impl BatchRunner for NoHidden {
    fn forward(&mut self, b: &ForwardBatch, p: &mut [RowPick]) -> Result<Vec<RowOut>, String> {
        self.0.forward(b, p)
    }
    fn num_blocks(&self) -> usize {
        self.0.num_blocks()
    }
    fn block_size(&self) -> usize {
        self.0.block_size()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn computes_hidden(&self) -> bool {
        false
    }
}

#[test]
fn a_backend_without_hidden_states_refuses_embeddings_at_submission() {
    let model = Arc::new(Model::load(&model_path("tiny-llama")).unwrap());
    let runner = NoHidden(CpuBatchRunner::new(model.clone(), 1024, 16));
    let e = start(&model, Box::new(runner), 256, None);
    let p = &prompts(&model)[1];
    assert_eq!(
        e.submit(embed_request(p, Pooling::Last)).err(),
        Some(EngineError::NoEmbeddings)
    );
    // Generation on it goes on.
    let mut r = embed_request(p, Pooling::Last);
    (r.params.embed, r.params.max_tokens) = (None, 3);
    let tokens = e
        .submit(r)
        .unwrap()
        .filter(|ev| matches!(ev, Event::Token(_)))
        .count();
    assert!(tokens > 0);
}
