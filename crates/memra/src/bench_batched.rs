//! `memra bench --batched`: llama.cpp's `llama-batched-bench` method and table, through the
//! serving engine. For each prompt length PP, generation length TG and number of parallel
//! sequences B: B requests of PP prompt tokens (random ids, the first `--shared-prefix` of
//! them the same in every request) go in together; T_PP is the time until every sequence
//! has its first token (the prompts computed), T_TG the time for TG more steps of B tokens
//! each (every sequence feeds TG tokens: N_KV = B x (PP + TG) positions in all). Greedy,
//! end-of-generation tokens ignored.
//!
//! With `--json-schema FILE --constrained-frac F`, the first F x B sequences of each row
//! are constrained to the schema (the grammar masks' cost): they end when their JSON is
//! complete, so S_TG counts the tokens generated rather than B x TG.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use memra_engine::constraint::{Constraint, Grammar};
use memra_engine::engine::{Engine, Event, GenerationParams, Request};
use memra_engine::models::Model;
use memra_engine::sampler::SamplerConfig;

use crate::bench::{tokens, Format};
use crate::generate::{load, start_engine, DefaultPool, Device, ModelArgs};

pub struct BatchedArgs {
    pub npp: Vec<usize>,
    pub ntg: Vec<usize>,
    pub npl: Vec<usize>,
    pub shared_prefix: usize,
    pub format: Format,
    /// A grammar for a fraction of each row's sequences.
    pub constrained: Option<(Grammar, f64)>,
}

struct Row {
    pp: usize,
    tg: usize,
    b: usize,
    t_pp: f64,
    t_tg: f64,
    cached: usize,
    /// Tokens generated after each sequence's first (B x TG unless some ended early).
    generated: usize,
    constrained: usize,
}

impl Row {
    fn n_kv(&self) -> usize {
        self.b * (self.pp + self.tg)
    }
    fn s_pp(&self) -> f64 {
        (self.b * self.pp) as f64 / self.t_pp
    }
    fn s_tg(&self) -> f64 {
        self.generated as f64 / self.t_tg
    }
    fn t(&self) -> f64 {
        self.t_pp + self.t_tg
    }
}

/// One row: B requests (of PP prompt tokens, TG generated) at once; returns the timings.
fn measure(
    engine: &Engine,
    model: &Model,
    (pp, tg, b): (usize, usize, usize),
    shared: usize,
    seed: u64,
    constrained: Option<&(Constraint, f64)>,
) -> Result<Row> {
    let nv = model.decoder.hp.n_vocab;
    let prefix = tokens(shared.min(pp), nv, seed);
    // The constrained sequences' grammars, copied before the clock starts.
    let n_constrained = constrained.map_or(0, |(_, f)| ((b as f64 * f).round() as usize).min(b));
    let mut grammars: Vec<Option<Constraint>> = (0..b)
        .map(|i| {
            constrained
                .filter(|_| i < n_constrained)
                .map(|(c, _)| c.clone())
        })
        .collect();
    let start = Instant::now();
    let handles = (0..b)
        .map(|i| {
            let mut prompt = prefix.clone();
            prompt.extend(tokens(pp - prefix.len(), nv, seed + 1 + i as u64));
            engine.submit(Request {
                prompt,
                params: GenerationParams {
                    // The first token comes from the prompt's logits; TG more are fed.
                    max_tokens: tg + 1,
                    ignore_eos: true,
                    sampler: SamplerConfig {
                        temperature: 0.0,
                        ..SamplerConfig::default()
                    },
                    constraint: grammars[i].take(),
                    ..GenerationParams::default()
                },
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Each request's events in its own thread, so that arrival times are taken as they come.
    let results: Vec<(Duration, Duration, usize, usize)> = std::thread::scope(|scope| {
        let joins: Vec<_> = handles
            .into_iter()
            .map(|h| {
                scope.spawn(move || -> Result<(Duration, Duration, usize, usize)> {
                    let mut first = None;
                    for ev in h {
                        match ev {
                            Event::Token(_) => {
                                first.get_or_insert_with(|| start.elapsed());
                            }
                            Event::Finished { usage, .. } => {
                                let end = start.elapsed();
                                let tg = usage.completion_tokens.saturating_sub(1);
                                return Ok((first.unwrap_or(end), end, usage.cached_tokens, tg));
                            }
                            Event::Error(e) => bail!("{e}"),
                            Event::PromptScores(_) | Event::Embedding(_) => {}
                        }
                    }
                    bail!("the engine stopped")
                })
            })
            .collect();
        joins
            .into_iter()
            .map(|j| j.join().expect("no panic"))
            .collect::<Result<Vec<_>>>()
    })?;
    let t_pp = results.iter().map(|r| r.0).max().unwrap_or_default();
    let t_end = results.iter().map(|r| r.1).max().unwrap_or_default();
    Ok(Row {
        pp,
        tg,
        b,
        t_pp: t_pp.as_secs_f64(),
        t_tg: (t_end - t_pp).as_secs_f64().max(1e-9),
        cached: results.iter().map(|r| r.2).sum(),
        generated: results.iter().map(|r| r.3).sum(),
        constrained: n_constrained,
    })
}

pub fn run(model_args: &ModelArgs, a: &BatchedArgs) -> Result<()> {
    if a.npp.contains(&0) || a.npl.contains(&0) {
        bail!("-npp and -npl must be at least 1");
    }
    let (model, _) = load(model_args)?;
    let model = Arc::new(model);
    let mut rows = Vec::new();
    if a.format == Format::Md {
        println!(
            "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
        );
        println!(
            "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"
        );
    }
    // One engine for every row (a GPU holds the weights once): room for the largest row,
    // every prompt of a row in one step (as llama-batched-bench computes them), also
    // after a shared prefix's first sequence has begun to decode.
    let (max_pp, max_tg, max_b) = (
        a.npp.iter().copied().max().unwrap_or(1),
        a.ntg.iter().copied().max().unwrap_or(0),
        a.npl.iter().copied().max().unwrap_or(1),
    );
    let n_ctx = max_pp + max_tg + 1;
    let mut args = model_args.clone();
    args.batch_size = args.batch_size.max(max_b * max_pp);
    args.prompt_chunk = args.batch_size;
    if args.kv_tokens.is_none() && args.kv_memory.is_none() && args.device() == Device::Cpu {
        args.kv_tokens = Some(max_b * n_ctx);
    }
    let engine = start_engine(
        &args,
        model.clone(),
        n_ctx,
        max_b,
        DefaultPool::GpuFraction(0.9),
    )?;
    let constrained = match &a.constrained {
        Some((g, frac)) if (0.0..=1.0).contains(frac) => Some((
            engine
                .compile_grammar(g)
                .map_err(|e| anyhow::anyhow!("cannot use the JSON schema: {e}"))?,
            *frac,
        )),
        Some(_) => bail!("--constrained-frac must be within [0, 1]"),
        None => None,
    };
    // Warm-up (llama-batched-bench decodes once first): loads pages, kernels, graphs.
    measure(&engine, &model, (max_pp.min(16), 2, 1), 0, 7, None)?;
    for &pp in &a.npp {
        for &tg in &a.ntg {
            for &b in &a.npl {
                let seed = 1000 * (b * 7919 + pp * 31 + tg) as u64;
                let row = measure(
                    &engine,
                    &model,
                    (pp, tg, b),
                    a.shared_prefix,
                    seed,
                    constrained.as_ref(),
                )?;
                eprintln!(
                    "B {b}: {:.3} s prompts, {:.3} s generation, {} prompt tokens from the prefix cache",
                    row.t_pp, row.t_tg, row.cached
                );
                if row.constrained > 0 {
                    eprintln!(
                        "B {b}: {} sequences constrained; {} tokens generated after the first (of {})",
                        row.constrained,
                        row.generated,
                        row.b * row.tg
                    );
                }
                if a.format == Format::Md {
                    println!(
                        "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |",
                        row.pp,
                        row.tg,
                        row.b,
                        row.n_kv(),
                        row.t_pp,
                        row.s_pp(),
                        row.t_tg,
                        row.s_tg(),
                        row.t(),
                        row.n_kv() as f64 / row.t()
                    );
                }
                rows.push(row);
            }
        }
    }
    if a.format == Format::Json {
        for r in &rows {
            println!(
                "{}",
                serde_json::json!({
                    "n_kv_max": engine.info().kv_tokens(), "n_batch": engine.info().token_budget,
                    "is_pp_shared": a.shared_prefix > 0, "shared_prefix": a.shared_prefix,
                    "pp": r.pp, "tg": r.tg, "pl": r.b, "n_kv": r.n_kv(),
                    "t_pp": r.t_pp, "speed_pp": r.s_pp(), "t_tg": r.t_tg, "speed_tg": r.s_tg(),
                    "t": r.t(), "speed": r.n_kv() as f64 / r.t(), "cached_prompt_tokens": r.cached,
                    "constrained": r.constrained, "generated": r.generated,
                })
            );
        }
    }
    Ok(())
}
