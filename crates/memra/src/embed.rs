//! `memra embed`: texts to embeddings through the engine, as the server's `/v1/embeddings`
//! computes them (llama.cpp's `llama-embedding`): one line of numbers per text, or
//! OpenAI's JSON; for several texts, their cosine similarities on stderr.

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memra_engine::engine::{normalize, Event, GenerationParams, Pooling, Request};
use serde_json::json;

use crate::generate::{self, DefaultPool, Device, ModelArgs};

pub struct EmbedArgs<'a> {
    pub prompts: &'a [String],
    /// One text a line (`-`: standard input).
    pub file: Option<&'a Path>,
    pub pooling: Option<Pooling>,
    /// llama.cpp's `--embd-normalize`.
    pub normalize: i64,
    pub json: bool,
}

pub fn run(model: &ModelArgs, args: &EmbedArgs) -> Result<()> {
    let mut model = model.clone();
    match model.device {
        // The GPU's prompt path does not return hidden states yet (docs/server.md).
        Some(Device::Cuda) => bail!("embeddings run on the CPU only for now: --device cpu"),
        None => model.device = Some(Device::Cpu),
        Some(Device::Cpu) => {}
    }
    if !(-1..=64).contains(&args.normalize) {
        bail!("--embd-normalize must be -1 (none), 0, 1, 2 (Euclidean) or a p-norm up to 64");
    }
    let mut texts: Vec<String> = args.prompts.to_vec();
    if let Some(f) = args.file {
        let text = read_text(f)?;
        texts.extend(text.lines().filter(|l| !l.is_empty()).map(str::to_string));
    }
    if texts.is_empty() {
        bail!("nothing to embed: give --prompt TEXT or --file FILE");
    }
    let (m, n_ctx) = generate::load(&model)?;
    let m = Arc::new(m);
    let pooling = Pooling::for_model(&m, args.pooling).map_err(anyhow::Error::msg)?;
    eprintln!("{} pooling", pooling.name());
    let requests = texts
        .iter()
        .map(|t| {
            let prompt = m.tokenizer.encode(t, true, true)?;
            Ok(Request {
                prompt,
                params: GenerationParams {
                    max_tokens: 0,
                    embed: Some(pooling),
                    ..GenerationParams::default()
                },
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let engine = generate::start_engine(&model, m.clone(), n_ctx, 4, DefaultPool::Contexts)?;
    // Every text queued at once: the engine batches them.
    let handles = requests
        .into_iter()
        .enumerate()
        .map(|(i, r)| {
            engine
                .submit(r)
                .with_context(|| format!("text {} cannot be embedded", i + 1))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut vectors = Vec::with_capacity(handles.len());
    for h in handles {
        let mut got = None;
        for event in h {
            match event {
                Event::Embedding(v) => got = Some(v),
                Event::Error(e) => bail!("{e}"),
                _ => {}
            }
        }
        let mut v = got.context("the engine stopped")?;
        normalize(&mut v, args.normalize);
        vectors.push(v);
    }
    if args.json {
        let data: Vec<_> = vectors
            .iter()
            .enumerate()
            .map(|(i, v)| json!({"object": "embedding", "index": i, "embedding": v}))
            .collect();
        println!("{}", json!({"object": "list", "data": data}));
    } else {
        for v in &vectors {
            let line: Vec<String> = v.iter().map(|x| x.to_string()).collect();
            println!("{}", line.join(" "));
        }
    }
    if vectors.len() > 1 {
        eprintln!("cosine similarity:");
        for a in &vectors {
            let row: Vec<String> = vectors
                .iter()
                .map(|b| format!("{:6.3}", cosine(a, b)))
                .collect();
            eprintln!("{}", row.join(" "));
        }
    }
    Ok(())
}

fn read_text(f: &Path) -> Result<String> {
    if f == Path::new("-") {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s)?;
        return Ok(s);
    }
    std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot = |x: &[f32], y: &[f32]| -> f64 {
        x.iter()
            .zip(y)
            .map(|(&p, &q)| f64::from(p) * f64::from(q))
            .sum()
    };
    let d = (dot(a, a) * dot(b, b)).sqrt();
    if d > 0.0 {
        dot(a, b) / d
    } else {
        0.0
    }
}
