//! The GPU decoder's tests against the CPU engine (they need an NVIDIA GPU: run with
//! `--ignored` on the device, `scripts/device-engine.sh`).

use super::*;
use crate::batch::{RowOut, RowPick};
use crate::generate::{perplexity, CpuRunner, Runner};
use crate::models::Model;

fn rms(v: impl Iterator<Item = f64>) -> f64 {
    let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + x * x, n + 1));
    (s / n.max(1) as f64).sqrt()
}

/// Models for the GPU model tests: `MEMRA_GPU_TEST_MODELS` (comma-separated paths;
/// scripts/device-check.sh passes the tiny models and synthetic ones).
fn test_models() -> Vec<String> {
    std::env::var("MEMRA_GPU_TEST_MODELS")
        .expect("MEMRA_GPU_TEST_MODELS")
        .split(',')
        .map(str::to_string)
        .collect()
}

/// Compares rows of logits; a best token may differ only where the CPU's margin
/// between its two best is within `4 x` the rows' RMS difference (a near tie).
/// Returns (worst relative RMS difference, rows whose best token agrees, failures).
fn compare_rows(what: &str, cpu: &[f32], gpu: &[f32], n_vocab: usize) -> (f64, usize, Vec<String>) {
    let (mut worst, mut agree, mut failures) = (0f64, 0, Vec::new());
    assert_eq!(cpu.len(), gpu.len(), "{what}: logit counts");
    for (r, (c, g)) in cpu.chunks(n_vocab).zip(gpu.chunks(n_vocab)).enumerate() {
        let diff = rms(c.iter().zip(g).map(|(a, b)| f64::from(a - b)));
        worst = worst.max(diff / rms(c.iter().map(|&a| f64::from(a))));
        let best = |v: &[f32]| crate::sampler::argmax(v) as usize;
        if best(c) == best(g) {
            agree += 1;
            continue;
        }
        let mut rest = c.to_vec();
        rest[best(c)] = f32::NEG_INFINITY;
        let margin = f64::from(c[best(c)] - rest[best(&rest)]);
        if margin > 4.0 * diff {
            failures.push(format!(
                "{what}: row {r}: best tokens differ at a margin of {margin:.4} (RMS difference {diff:.4})"
            ));
        }
    }
    (worst, agree, failures)
}

const TEXT: &str = "Hello world, this is a test of the decoder. The quick brown fox jumps \
    over the lazy dog; it was the best of times, it was the worst of times.";

/// The rows' worst relative RMS difference, and those failures where best tokens differ
/// beyond a near tie.
fn check(what: &str, reference: &[f32], got: &[f32], nv: usize, failures: &mut Vec<String>) -> f64 {
    let (worst, _, mut f) = compare_rows(what, reference, got, nv);
    failures.append(&mut f);
    worst
}

/// GPU logits against the CPU engine's: the tokens as one prompt batch with every row's
/// logits (the GEMM and flash attention path), and one token at a time (the decode
/// graph). The reference is the CPU engine with exact activations (f32, no rounding);
/// the GPU rounds activations (f16 for prompts, int8 per 32 for decode, an f16 cache),
/// as llama.cpp's CPU engine does (Q8_0 / Q8_K), and the GPU must stay at least as
/// close to the reference as that rounding does (10% headroom), or within 5%. Some models amplify
/// rounding a lot (tiny-gemma3's post-norms: docs/cuda.md); the bound follows them.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_decoder_matches_cpu_logits() {
    let mut failures = Vec::new();
    for path in test_models() {
        let mut model = Model::load(std::path::Path::new(&path)).unwrap();
        let tokens = model.tokenizer.encode(TEXT, true, true).unwrap();
        let nv = model.decoder.hp.n_vocab;
        let mut cpu_rows = |exact: bool| {
            model.decoder.exact_activations = exact;
            let mut cache = model.decoder.new_cache(256);
            let rows = model
                .decoder
                .forward(&mut cache, &tokens, LogitRows::From(0));
            rows.unwrap()
        };
        let exact = cpu_rows(true);
        let rounded = cpu_rows(false);
        let d = &model.decoder;
        let mut gpu = GpuDecoder::new(0, d, 256).unwrap();
        let batch = gpu.forward(&tokens, LogitRows::From(0)).unwrap();
        gpu.reset();
        let mut steps = Vec::new();
        for &t in &tokens {
            steps.extend(gpu.forward(&[t], LogitRows::Last).unwrap());
        }
        // The same tokens as decode steps of `many` sequences at once (12: the int8
        // tensor-core kernels where every matrix has them, else the GEMM path or groups of 8;
        // 40: the GEMM path; device argmax of every row): each sequence's row is the same, and
        // as close to the reference as the other paths.
        let many_decodes = |many: usize| -> Vec<f32> {
            let mut pool = GpuDecoder::with_pool(0, d, 256, PoolSize::Tokens(many * 256)).unwrap();
            let per = 256 / BLOCK_SIZE;
            let tables: Vec<Vec<u32>> = (0..many)
                .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
                .collect();
            let step_of = |i: usize, t: u32| {
                let mut b = ForwardBatch::new(BLOCK_SIZE);
                for tab in &tables {
                    b.push(&[t], i, tab, [0]);
                }
                b
            };
            let mut rows_of = Vec::new();
            for (i, &t) in tokens.iter().enumerate() {
                let mut picks: Vec<RowPick> = (0..many).map(|_| RowPick::Logits).collect();
                let rows = pool.forward_step(&step_of(i, t), &mut picks).unwrap();
                let rows: Vec<Vec<f32>> = rows
                    .into_iter()
                    .map(|r| match r {
                        RowOut::Logits(v) => v,
                        RowOut::Token(_) | RowOut::Hidden(_) => panic!("logits asked"),
                    })
                    .collect();
                assert!(
                    rows.iter().all(|r| r == &rows[0]),
                    "{path}: {many} sequences, step {i}: the sequences' rows differ"
                );
                rows_of.extend_from_slice(&rows[0]);
            }
            let last = tokens.len() - 1;
            let mut picks: Vec<RowPick> = (0..many).map(|_| RowPick::Greedy).collect();
            let picked = pool
                .forward_step(&step_of(last, tokens[last]), &mut picks)
                .unwrap();
            let want = crate::sampler::argmax(&rows_of[last * nv..]);
            for p in picked {
                assert!(
                    matches!(p, RowOut::Token(id) if id == want),
                    "{path}: {many} sequences' greedy picks"
                );
            }
            rows_of
        };
        let few = many_decodes(12);
        let many = many_decodes(40);
        let f = &mut failures;
        let cpu_q8 = check(
            &format!("{path} cpu q8"),
            &exact,
            &rounded,
            nv,
            &mut Vec::new(),
        );
        let worst_b = check(&format!("{path} batch"), &exact, &batch, nv, f);
        let worst_s = check(&format!("{path} steps"), &exact, &steps, nv, f);
        let worst_f = check(&format!("{path} 12 decodes"), &exact, &few, nv, f);
        let worst_m = check(&format!("{path} 40 decodes"), &exact, &many, nv, f);
        // The greedy pick on the device equals the host's argmax of the same logits.
        gpu.reset();
        gpu.forward(&tokens[..tokens.len() - 1], LogitRows::Last)
            .unwrap();
        let best = gpu.forward_greedy(tokens[tokens.len() - 1]).unwrap();
        let last = &steps[(tokens.len() - 1) * nv..];
        assert_eq!(best, crate::sampler::argmax(last), "{path}: greedy pick");
        eprintln!(
            "{path}: {} tokens; RMS logit difference to exact arithmetic: GPU prompt batch \
             {:.2}%, GPU decode steps {:.2}%, 12 and 40 sequences' decode steps {:.2}% and \
             {:.2}%, CPU with llama.cpp's Q8 rounding {:.2}%",
            tokens.len(),
            100.0 * worst_b,
            100.0 * worst_s,
            100.0 * worst_f,
            100.0 * worst_m,
            100.0 * cpu_q8
        );
        // 10% headroom: on models where rounding decorrelates the logits entirely
        // (synthetic q4_k_m: ~200% both ways) the two differences are equal but for noise.
        let bound = (1.1 * cpu_q8).max(0.05);
        for (what, worst) in [
            ("batch", worst_b),
            ("steps", worst_s),
            ("12 decodes", worst_f),
            ("40 decodes", worst_m),
        ] {
            if worst > bound {
                failures.push(format!(
                    "{path} {what}: logits differ by {:.2}% RMS (bound {:.2}%)",
                    100.0 * worst,
                    100.0 * bound
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// `memra perplexity --device cuda` against the CPU engine (exact activations, as
/// above) within 0.5%, and 16 greedy tokens: identical to the CPU's, or, where the
/// CPU's own two roundings part earlier, agreeing at least as long as they do.
/// Perplexity is skipped on synthetic models (random weights make it astronomical).
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_perplexity_and_greedy_match_the_cpu() {
    let text = match std::env::var("MEMRA_GPU_TEST_TEXT") {
        Ok(p) => std::fs::read_to_string(p).unwrap(),
        Err(_) => TEXT.repeat(40),
    };
    let mut failures = Vec::new();
    for path in test_models() {
        let mut model = Model::load(std::path::Path::new(&path)).unwrap();
        let ctx = 128;
        let prompt = model
            .tokenizer
            .encode("Once upon a time", true, true)
            .unwrap();
        let greedy = |r: &mut dyn Runner| {
            r.reset();
            let mut next = crate::sampler::argmax(&r.feed(&prompt).unwrap());
            let mut out = Vec::new();
            for _ in 0..16 {
                out.push(next);
                next = r.feed_greedy(next).unwrap();
            }
            out
        };
        let mut cpu_runs = Vec::new();
        for exact in [false, true] {
            model.decoder.exact_activations = exact;
            let mut cpu = CpuRunner::new(&model.decoder, ctx, 512);
            let ppl = if model.name.starts_with("synthetic") {
                None
            } else {
                Some(
                    perplexity(&model, &mut cpu, &text, ctx, Some(4), |_, _, _| {})
                        .unwrap()
                        .ppl,
                )
            };
            cpu_runs.push((ppl, greedy(&mut cpu)));
        }
        let [(ppl_q8, ids_q8), (ppl_exact, ids_exact)] = [cpu_runs[0].clone(), cpu_runs[1].clone()];
        let d = &model.decoder;
        let mut gpu = GpuDecoder::new(0, d, ctx).unwrap();
        if let (Some(want), Some(q8)) = (ppl_exact, ppl_q8) {
            let got = perplexity(&model, &mut gpu, &text, ctx, Some(4), |_, _, _| {})
                .unwrap()
                .ppl;
            eprintln!(
                "{path}: perplexity GPU {got:.4}, CPU exact {want:.4} ({:+.3}%), CPU Q8 {q8:.4} ({:+.3}%)",
                100.0 * (got - want) / want,
                100.0 * (got - q8) / q8
            );
            if (got - want).abs() / want > 0.005 {
                failures.push(format!("{path}: perplexity GPU {got:.4} vs CPU {want:.4}"));
            }
        }
        let ids_gpu = greedy(&mut gpu);
        let agree = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
        let (gpu_n, cpu_n) = (agree(&ids_gpu, &ids_exact), agree(&ids_q8, &ids_exact));
        eprintln!(
            "{path}: greedy tokens agreeing with exact CPU arithmetic: GPU {gpu_n}/16, CPU Q8 {cpu_n}/16"
        );
        if gpu_n < 16 && gpu_n < cpu_n {
            failures.push(format!(
                "{path}: greedy tokens part from the CPU's at {gpu_n}: GPU {ids_gpu:?}, CPU {ids_exact:?}"
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Sampling on the device against the host sampler on the same GPU's logits: 32 steps
/// with llama.cpp's default filters, penalties and a bias, the same seed: the same
/// tokens, so the device follows the sampler's rules and its use of random numbers.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_sampled_generation_matches_host_sampling() {
    use crate::sampler::SamplerConfig;
    for path in test_models() {
        let model = Model::load(std::path::Path::new(&path)).unwrap();
        let prompt = model
            .tokenizer
            .encode("Once upon a time", true, true)
            .unwrap();
        let mut config = SamplerConfig {
            repeat_penalty: 1.3,
            frequency_penalty: 0.1,
            seed: 7,
            ..SamplerConfig::default()
        };
        config.logit_bias.insert(prompt[prompt.len() - 1], -1.5);
        let mut gpu = GpuDecoder::new(0, &model.decoder, 128).unwrap();
        let mut runs = Vec::new();
        for on_device in [true, false] {
            gpu.reset();
            let mut sampler = Sampler::new(config.clone()).unwrap();
            prompt.iter().for_each(|&t| sampler.accept(t));
            let logits = gpu.forward(&prompt, LogitRows::Last).unwrap();
            let mut next = sampler.sample(&logits);
            let mut out = Vec::new();
            for _ in 0..32 {
                sampler.accept(next);
                out.push(next);
                next = if on_device {
                    gpu.forward_sample(next, &mut sampler).unwrap()
                } else {
                    let logits = gpu.forward(&[next], LogitRows::Last).unwrap();
                    sampler.sample(&logits)
                };
            }
            runs.push(out);
        }
        assert_eq!(runs[0], runs[1], "{path}: device vs host sampling");
        eprintln!("{path}: 32 sampled tokens, device and host sampling agree");
    }
}

/// A model and context larger than the GPU's free memory is refused before anything is
/// allocated, with the sizes and the way out named; a token outside the vocabulary and
/// a full context are errors, not crashes.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_bad_requests_are_clear_errors() {
    let path = test_models().remove(0);
    let model = Model::load(std::path::Path::new(&path)).unwrap();
    let d = &model.decoder;
    let err = GpuDecoder::new(0, d, 100_000_000)
        .err()
        .expect("too large")
        .to_string();
    assert!(
        err.contains("MiB of GPU memory") && err.contains("-c"),
        "{err}"
    );
    let mut gpu = GpuDecoder::new(0, d, 4).unwrap();
    let err = gpu
        .forward(&[d.hp.n_vocab as u32], LogitRows::Last)
        .unwrap_err();
    assert!(err.to_string().contains("outside the vocabulary"), "{err}");
    gpu.forward(&[1, 2, 3, 4], LogitRows::Last).unwrap();
    let err = gpu.forward(&[1], LogitRows::Last).unwrap_err();
    assert!(err.to_string().contains("context is full"), "{err}");
}

/// Greedy tokens of `prompt` by the one-context API, stopping at end-of-generation.
fn gpu_alone(gpu: &mut GpuDecoder, model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    gpu.reset();
    let mut next = crate::sampler::argmax(&gpu.forward(prompt, LogitRows::Last).unwrap());
    let mut out = Vec::new();
    while out.len() < n && !model.tokenizer.is_end_of_generation(next) {
        out.push(next);
        if out.len() < n {
            next = gpu.forward_greedy(next).unwrap();
        }
    }
    out
}

const PROMPTS: [&str; 6] = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who \
     every morning rowed out before dawn and came back with the tide.",
    "1, 2, 3, 4, 5,",
    "// Binary search in C\nint search(int *a, int n, int x) {",
];

/// The serving engine on the GPU: six different prompts batched give each the greedy
/// tokens it gives alone (the one-context API), with whole prompts in a step, prompts
/// chunked by small budgets, prefix-cache hits, and a pool small enough to force
/// preemption; per-row logits of batched prompt rows and decode rows agree with the
/// single-sequence ones.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_engine_batches_equal_alone() {
    use crate::engine::{Engine, EngineConfig, Event, GenerationParams, GpuBatchRunner, Request};
    use crate::scheduler::SchedulerConfig;
    use std::sync::Arc;
    let mut failures = Vec::new();
    for path in test_models() {
        let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
        let n = 12;
        let ctx = 512;
        let prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| model.tokenizer.encode(p, true, true).unwrap())
            .collect();
        let mut gpu = GpuDecoder::new(0, &model.decoder, ctx).unwrap();
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| gpu_alone(&mut gpu, &model, p, n))
            .collect();
        // Per-row logits: three prompts in one prompt batch, then one decode step of the
        // three, against each alone.
        let nv = model.decoder.hp.n_vocab;
        let mut alone_rows = Vec::new();
        for p in &prompts[..3] {
            gpu.reset();
            let first = gpu.forward(p, LogitRows::Last).unwrap();
            let next = crate::sampler::argmax(&first);
            let second = gpu.forward(&[next], LogitRows::Last).unwrap();
            alone_rows.push((first, next, second));
        }
        let mut pool =
            GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(3 * ctx)).unwrap();
        let per = ctx / BLOCK_SIZE;
        let tables: Vec<Vec<u32>> = (0..3)
            .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
            .collect();
        let mut b = ForwardBatch::new(BLOCK_SIZE);
        for (s, p) in prompts[..3].iter().enumerate() {
            b.push(p, 0, &tables[s], [p.len() - 1]);
        }
        let mut picks: Vec<RowPick> = (0..3).map(|_| RowPick::Logits).collect();
        let firsts = pool.forward_step(&b, &mut picks).unwrap();
        let mut d = ForwardBatch::new(BLOCK_SIZE);
        for (s, p) in prompts[..3].iter().enumerate() {
            d.push(&[alone_rows[s].1], p.len(), &tables[s], [0]);
        }
        let mut picks: Vec<RowPick> = (0..3).map(|_| RowPick::Logits).collect();
        let seconds = pool.forward_step(&d, &mut picks).unwrap();
        for s in 0..3 {
            for (what, got, want) in [
                ("prompt row", &firsts[s], &alone_rows[s].0),
                ("decode row", &seconds[s], &alone_rows[s].2),
            ] {
                let RowOut::Logits(got) = got else {
                    panic!("logits asked")
                };
                let diff = rms(got.iter().zip(want.iter()).map(|(a, b)| f64::from(a - b)));
                let scale = rms(want.iter().map(|&a| f64::from(a)));
                eprintln!("{path}: sequence {s} {what}: batched vs alone RMS difference {:.2e} (logits RMS {scale:.2})", diff);
                if diff > 1e-3 * scale.max(1.0) {
                    failures.push(format!(
                        "{path}: sequence {s} {what}: batched logits differ by {diff:.3e} RMS"
                    ));
                }
                assert_eq!(got.len(), nv);
            }
        }
        drop(pool);
        drop(gpu);
        let run =
            |kv_tokens: usize, budget: usize, label: &str, failures: &mut Vec<String>| -> usize {
                let gpu =
                    GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(kv_tokens))
                        .unwrap();
                let engine = Engine::start(
                    model.clone(),
                    Box::new(GpuBatchRunner::new(gpu)),
                    EngineConfig {
                        scheduler: SchedulerConfig {
                            max_running: 8,
                            token_budget: budget,
                            prompt_chunk: budget,
                        },
                        n_ctx: ctx,
                        spec: None,
                    },
                );
                let handles: Vec<_> = prompts
                    .iter()
                    .map(|p| {
                        let mut params = GenerationParams {
                            max_tokens: n,
                            ..GenerationParams::default()
                        };
                        params.sampler.temperature = 0.0;
                        engine
                            .submit(Request {
                                prompt: p.clone(),
                                params,
                            })
                            .unwrap()
                    })
                    .collect();
                let mut preemptions = 0;
                for (i, h) in handles.into_iter().enumerate() {
                    let mut ids = Vec::new();
                    for ev in h {
                        match ev {
                            Event::Token(t) => ids.push(t.id),
                            Event::Finished { usage, .. } => preemptions += usage.preemptions,
                            Event::Error(e) => panic!("{path}: {e}"),
                            Event::PromptScores(_) | Event::Embedding(_) => {}
                        }
                    }
                    if ids != want[i] {
                        failures.push(format!(
                            "{path} {label}: prompt {i}: batched {ids:?}, alone {:?}",
                            want[i]
                        ));
                    }
                }
                preemptions
            };
        run(8 * ctx, 2048, "budget 2048", &mut failures);
        run(8 * ctx, 5, "budget 5", &mut failures);
        run(8 * ctx, 17, "budget 17", &mut failures);
        // Exactly the prompts' blocks (every prompt admitted in the first step), or the
        // longest request's: sequences growing into a new block find none free.
        let longest = prompts.iter().map(|p| p.len()).max().unwrap() + n;
        let prompt_blocks: usize = prompts.iter().map(|p| p.len().div_ceil(BLOCK_SIZE)).sum();
        let small = prompt_blocks.max(longest.div_ceil(BLOCK_SIZE)) * BLOCK_SIZE;
        let preempted = run(small, 2048, "small pool", &mut failures);
        eprintln!("{path}: batched runs done ({preempted} preemptions in the small pool)");
        if preempted == 0 {
            failures.push(format!("{path}: the small pool forced no preemption"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Decode steps replay graphs captured per row count (and, through the GEMMs, split
/// count): greedy steps of 20 sequences through the GEMMs (then 18, then 20 again, and
/// past a split change), and of 12 (then 10) through the mat-vec kernels, give exactly the
/// ids (and the GEMM steps the logits) that the same steps give launched eagerly; so do
/// steps of 12 (then 10) through the GEMM path's tile copies, and steps of 20 (then 18)
/// through the prompt attention. The first 20-row steps go without the tile copies, so
/// that the f16 copies' GEMM graphs stay covered.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_decode_graphs_equal_eager_steps() {
    let mut failures = Vec::new();
    for path in test_models() {
        let model = Model::load(std::path::Path::new(&path)).unwrap();
        let (most, ctx, steps) = (20usize, 256usize, 70usize);
        let prompts: Vec<Vec<u32>> = (0..most)
            .map(|i| {
                let p = PROMPTS[i % 3];
                let text = format!("{p} {}", "and so on ".repeat(i % 4));
                model.tokenizer.encode(&text, true, true).unwrap()
            })
            .collect();
        let per = ctx / BLOCK_SIZE;
        let tables: Vec<Vec<u32>> = (0..most)
            .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
            .collect();
        // (ids, the last step's logits through the GEMMs, graphs captured).
        let run = |graphs: bool, rows: usize, gemm_rows: usize, tiles: bool, prompt_from| {
            let pool = PoolSize::Tokens(most * ctx);
            let mut gpu = GpuDecoder::with_pool(0, &model.decoder, ctx, pool).unwrap();
            gpu.use_graph = graphs;
            gpu.gemm_decode_rows = gemm_rows;
            gpu.prompt_attention_from = prompt_from;
            if !tiles {
                gpu.tile_rows = 0;
            }
            let mut next = Vec::new();
            for (s, p) in prompts[..rows].iter().enumerate() {
                let mut b = ForwardBatch::new(BLOCK_SIZE);
                b.push(p, 0, &tables[s], [p.len() - 1]);
                match &gpu.forward_step(&b, &mut [RowPick::Greedy]).unwrap()[0] {
                    RowOut::Token(t) => next.push(*t),
                    _ => panic!("a greedy pick"),
                }
            }
            let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
            let mut ids = vec![Vec::new(); rows];
            for step in 0..steps {
                // Two rows fewer for a few steps: another graph, then back to the first.
                let live = if (10..14).contains(&step) {
                    rows - 2
                } else {
                    rows
                };
                let mut b = ForwardBatch::new(BLOCK_SIZE);
                for s in 0..live {
                    b.push(&[next[s]], lens[s], &tables[s], [0]);
                }
                let mut picks: Vec<RowPick> = (0..live).map(|_| RowPick::Greedy).collect();
                let out = gpu.forward_step(&b, &mut picks).unwrap();
                for (s, o) in out.iter().enumerate() {
                    let RowOut::Token(t) = o else {
                        panic!("a greedy pick")
                    };
                    ids[s].push(*t);
                    next[s] = *t;
                    lens[s] += 1;
                }
            }
            let nv = gpu.hp.n_vocab;
            let logits = match gpu.batch.as_ref().and_then(|bb| bb.logits.as_ref()) {
                Some(l) if gemm_rows <= rows => {
                    gpu.dev.stream.clone_dtoh(&l.slice(..rows * nv)).unwrap()
                }
                _ => Vec::new(),
            };
            (ids, logits, gpu.batch_graphs.len() + gpu.graphs.len())
        };
        // Through the GEMMs from 17 rows, on the f16 copies (where the decoder keeps
        // them); through the GEMMs from 9 rows (the tile copies where it keeps them);
        // through the mat-vec kernels always; through the GEMMs and the prompt attention.
        let never = usize::MAX;
        let cases = [
            (most, 17, false, 3, never),
            (12, 9, true, 2, never),
            (12, never, true, 2, never),
            (most, 17, true, 2, 1),
        ];
        for (rows, gemm_rows, tiles, want_graphs, from) in cases {
            let (eager, eager_logits, none) = run(false, rows, gemm_rows, tiles, from);
            let (graphed, graph_logits, captured) = run(true, rows, gemm_rows, tiles, from);
            eprintln!("{path}: {rows} rows: {captured} step graphs captured");
            if none != 0 || captured < want_graphs {
                failures.push(format!(
                    "{path}: {rows} rows: {none} graphs eagerly, {captured} with graphs \
                     (want {want_graphs} or more)"
                ));
            }
            if eager != graphed {
                failures.push(format!(
                    "{path}: {rows} rows: graphed ids differ from eager ones"
                ));
            }
            if eager_logits != graph_logits {
                failures.push(format!(
                    "{path}: {rows} rows: the last step's logits differ"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Constrained decoding on the GPU through the engine: 32 sequences at once (so decode
/// steps take both the mat-vec and the GEMM path), every other one held to a bounded JSON
/// schema, greedy and sampled: each constrained output is JSON matching the schema and
/// ends by the grammar; the plain ones run beside them.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_engine_constrained_sequences_match_their_schema() {
    use crate::constraint::Grammar;
    use crate::engine::{Engine, EngineConfig, Event, GenerationParams, GpuBatchRunner, Request};
    use crate::sampler::SamplerConfig;
    use crate::scheduler::SchedulerConfig;
    use std::sync::Arc;
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 9},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        },
        "required": ["color", "n", "tags"],
        "additionalProperties": false,
    });
    let mut failures = Vec::new();
    for path in test_models() {
        let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
        let ctx = 512;
        let gpu =
            GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(32 * ctx)).unwrap();
        let engine = Engine::start(
            model.clone(),
            Box::new(GpuBatchRunner::new(gpu)),
            EngineConfig {
                scheduler: SchedulerConfig {
                    max_running: 32,
                    token_budget: 2048,
                    prompt_chunk: 2048,
                },
                n_ctx: ctx,
                spec: None,
            },
        );
        let grammar = engine
            .compile_grammar(&Grammar::JsonSchema(schema.clone()))
            .unwrap();
        let handles: Vec<_> = (0..32)
            .map(|i| {
                let prompt = model
                    .tokenizer
                    .encode(PROMPTS[i % PROMPTS.len()], true, true)
                    .unwrap();
                let params = GenerationParams {
                    max_tokens: 60,
                    sampler: SamplerConfig {
                        temperature: [0.0, 0.8, 0.0, 1.5][i % 4],
                        seed: i as u64,
                        ..SamplerConfig::default()
                    },
                    constraint: (i % 2 == 0).then(|| grammar.clone()),
                    ..GenerationParams::default()
                };
                engine.submit(Request { prompt, params }).unwrap()
            })
            .collect();
        for (i, h) in handles.into_iter().enumerate() {
            let mut ids = Vec::new();
            let mut generated = 0;
            for ev in h {
                match ev {
                    Event::Token(t) => ids.push(t.id),
                    Event::Finished { usage, .. } => generated = usage.completion_tokens,
                    Event::Error(e) => panic!("{path}: sequence {i}: {e}"),
                    Event::PromptScores(_) | Event::Embedding(_) => {}
                }
            }
            if i % 2 == 1 {
                continue;
            }
            let text = model.tokenizer.decode_lossy(&ids, false).unwrap();
            let ok = serde_json::from_str::<serde_json::Value>(&text).is_ok_and(|v| {
                ["red", "green", "blue"].contains(&v["color"].as_str().unwrap_or_default())
                    && v["n"].as_u64().is_some_and(|n| n <= 9)
                    && v["tags"].as_array().is_some_and(|t| t.len() <= 2)
                    && v.as_object().is_some_and(|o| o.len() == 3)
            });
            if !ok || generated >= 60 {
                failures.push(format!(
                    "{path}: sequence {i}: {text:?} ({generated} tokens)"
                ));
            }
        }
        eprintln!("{path}: 16 constrained sequences checked");
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Speculative decoding on the GPU (prompt lookup, up to 7 drafts: the verify step's 8
/// rows go through the decode kernels, as plain decoding's one row does): every prompt's
/// greedy tokens equal the one-context API's plain decoding, and drafts are accepted.
#[test]
#[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
fn gpu_speculative_greedy_equals_plain_decoding() {
    use crate::engine::{Engine, EngineConfig, Event, GenerationParams, GpuBatchRunner, Request};
    use crate::scheduler::SchedulerConfig;
    use crate::spec::{DraftPolicy, SpecConfig};
    use std::sync::Arc;
    let mut failures = Vec::new();
    for path in test_models() {
        let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
        let (n, ctx) = (24, 512);
        let mut prompts: Vec<Vec<u32>> = PROMPTS
            .iter()
            .map(|p| model.tokenizer.encode(p, true, true).unwrap())
            .collect();
        prompts.push(
            model
                .tokenizer
                .encode("one two three four one two three four one two", true, true)
                .unwrap(),
        );
        let mut gpu = GpuDecoder::new(0, &model.decoder, ctx).unwrap();
        let want: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| gpu_alone(&mut gpu, &model, p, n))
            .collect();
        drop(gpu);
        let gpu = GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(ctx)).unwrap();
        let engine = Engine::start(
            model.clone(),
            Box::new(GpuBatchRunner::new(gpu)),
            EngineConfig {
                scheduler: SchedulerConfig {
                    max_running: 1,
                    token_budget: 2048,
                    prompt_chunk: 2048,
                },
                n_ctx: ctx,
                spec: Some(SpecConfig {
                    ngram: 3,
                    draft_max: 7,
                    draft_min: 1,
                    max_batch: 1,
                    policy: DraftPolicy::Length,
                }),
            },
        );
        let mut accepted = 0;
        for (i, p) in prompts.iter().enumerate() {
            let mut params = GenerationParams {
                max_tokens: n,
                ..GenerationParams::default()
            };
            params.sampler.temperature = 0.0;
            let h = engine
                .submit(Request {
                    prompt: p.clone(),
                    params,
                })
                .unwrap();
            let mut ids = Vec::new();
            for ev in h {
                match ev {
                    Event::Token(t) => ids.push(t.id),
                    Event::Finished { usage, .. } => accepted += usage.accepted_tokens,
                    Event::Error(e) => panic!("{path}: {e}"),
                    Event::PromptScores(_) | Event::Embedding(_) => {}
                }
            }
            if ids != want[i] {
                failures.push(format!(
                    "{path}: prompt {i}: speculative {ids:?}, plain {:?}",
                    want[i]
                ));
            }
        }
        eprintln!(
            "{path}: speculative = plain on {} prompts, {accepted} drafts accepted",
            prompts.len()
        );
        if accepted == 0 {
            failures.push(format!("{path}: no draft accepted"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
