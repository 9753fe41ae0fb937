//! `memra bench`: prompt processing and generation speed, by llama-bench's method: a
//! warm-up run, then `-r` timed repetitions of each test on a fresh context (after `-d`
//! tokens of depth), reported as mean ± standard deviation of tokens per second. `pp`
//! feeds the prompt as one batch (its last row's logits come back); `tg` feeds one token
//! per step and takes back the greedy pick (on the GPU, the id alone crosses to the host).

use std::time::Instant;

use crate::generate::{load, runner, Device, ModelArgs};
use crate::inspect::human_bytes;
use anyhow::{bail, Result};
use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    Md,
    Json,
}

pub struct BenchArgs {
    pub prompt: Vec<usize>,
    pub generate: Vec<usize>,
    pub depth: Vec<usize>,
    pub repetitions: usize,
    pub format: Format,
}

/// Token ids spread over the vocabulary (llama-bench uses random tokens too).
pub fn tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % n_vocab as u64) as u32
        })
        .collect()
}

struct Row {
    test: String,
    mean: f64,
    std: f64,
    samples: Vec<f64>,
}

pub fn run(model_args: &ModelArgs, a: &BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    let (model, _) = load(model_args)?;
    let n_vocab = model.tokenizer.n_vocab();
    let mut rows = Vec::new();
    for &d in &a.depth {
        for (kind, sizes) in [("pp", &a.prompt), ("tg", &a.generate)] {
            for &n in sizes.iter().filter(|&&n| n > 0) {
                let n_ctx = d + n + 1;
                let depth_tokens = tokens(d, n_vocab, 1);
                let test_tokens = tokens(n, n_vocab, 2);
                // One context per test, allocated once (a GPU context holds the weights).
                let mut r = runner(model_args, &model, n_ctx)?;
                let mut once = || -> Result<f64> {
                    r.reset();
                    if !depth_tokens.is_empty() {
                        r.feed(&depth_tokens)?;
                    }
                    let start = Instant::now();
                    if kind == "pp" {
                        r.feed(&test_tokens)?;
                    } else {
                        // Each step hands back the next token's id, picked where the
                        // logits are (on the GPU: one id crosses to the host, not the
                        // logits), as greedy generation runs.
                        for &t in &test_tokens {
                            r.feed_greedy(t)?;
                        }
                    }
                    Ok(n as f64 / start.elapsed().as_secs_f64())
                };
                once()?; // warm-up
                let samples = (0..a.repetitions)
                    .map(|_| once())
                    .collect::<Result<Vec<_>>>()?;
                let mean = samples.iter().sum::<f64>() / samples.len() as f64;
                let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>()
                    / (samples.len().max(2) - 1) as f64;
                let test = if d > 0 {
                    format!("{kind}{n} @ d{d}")
                } else {
                    format!("{kind}{n}")
                };
                eprintln!("{test}: {mean:.2} t/s");
                if let Some(line) = r.device_memory() {
                    eprintln!("{line}");
                }
                rows.push(Row {
                    test,
                    mean,
                    std: var.sqrt(),
                    samples,
                });
            }
        }
    }
    let backend = match model_args.device() {
        Device::Cpu => "CPU",
        Device::Cuda => "CUDA",
    };
    let size = human_bytes(model.file.file_size());
    let params = format!("{:.2} B", model.n_params as f64 / 1e9);
    let threads = rayon::current_num_threads();
    match a.format {
        Format::Md => {
            println!("| model | size | params | backend | threads | test | t/s |");
            println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
            for r in &rows {
                println!(
                    "| {} | {size} | {params} | {backend} | {threads} | {} | {:.2} ± {:.2} |",
                    model.name, r.test, r.mean, r.std
                );
            }
        }
        Format::Json => {
            let list: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "model": model.name, "file_size": model.file.file_size(),
                        "n_params": model.n_params, "backend": backend, "threads": threads,
                        "test": r.test, "avg_ts": r.mean, "stddev_ts": r.std, "samples_ts": r.samples,
                    })
                })
                .collect();
            println!("{}", serde_json::to_string_pretty(&list)?);
        }
    }
    Ok(())
}
