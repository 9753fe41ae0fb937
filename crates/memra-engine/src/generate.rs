//! One model with one context: the [`Runner`] API (`memra bench`, the model tests), the
//! statistics of a generation, and llama.cpp's perplexity method (its chunks, its sums,
//! and a runner loop). Generation for users goes through the serving engine (`engine`).

use std::time::Duration;

use crate::backend::cpu::kv::KvCache;
use crate::backend::cuda::decoder::GpuDecoder;
use crate::backend::cuda::CudaError;
use crate::models::{Decoder, LogitRows, Model, ModelError};
use crate::sampler::{Sampler, SamplerConfig, SamplerError};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens; the context holds {n_ctx}")]
    PromptTooLong { prompt: usize, n_ctx: usize },
    #[error("{0}")]
    Invalid(String),
}

/// A model with its context, on some device: what generation drives.
pub trait Runner {
    fn n_ctx(&self) -> usize;
    /// Positions already in the context.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forgets the context.
    fn reset(&mut self);
    /// Feeds tokens at the next positions; returns the logits of `rows` (`rows x n_vocab`).
    fn feed_rows(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, GenerateError>;
    /// Feeds tokens at the next positions; returns the logits of the last one.
    fn feed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, GenerateError> {
        self.feed_rows(tokens, LogitRows::Last)
    }
    /// Feeds one token; returns the most likely next token (a GPU picks it on the device,
    /// sending back one id instead of the logits).
    fn feed_greedy(&mut self, token: u32) -> Result<u32, GenerateError> {
        Ok(crate::sampler::argmax(&self.feed(&[token])?))
    }
    /// Feeds one token; returns the next as `sampler` picks it (a GPU picks it on the
    /// device where it can, sending back one id instead of the logits).
    fn feed_sample(&mut self, token: u32, sampler: &mut Sampler) -> Result<u32, GenerateError> {
        if sampler.is_plain_greedy() {
            return self.feed_greedy(token);
        }
        Ok(sampler.sample(&self.feed(&[token])?))
    }
    /// Device memory, where the runner holds any: a line for the user.
    fn device_memory(&self) -> Option<String> {
        None
    }
}

/// The CPU decoder with its KV cache; prompts go through in batches of `batch` tokens.
pub struct CpuRunner<'m> {
    pub decoder: &'m Decoder,
    pub cache: KvCache,
    pub batch: usize,
}

impl<'m> CpuRunner<'m> {
    pub fn new(decoder: &'m Decoder, n_ctx: usize, batch: usize) -> CpuRunner<'m> {
        CpuRunner {
            decoder,
            cache: decoder.new_cache(n_ctx),
            batch: batch.max(1),
        }
    }
}

impl Runner for CpuRunner<'_> {
    fn n_ctx(&self) -> usize {
        self.cache.n_ctx()
    }
    fn len(&self) -> usize {
        self.cache.len()
    }
    fn reset(&mut self) {
        self.cache.truncate(0);
    }
    fn feed_rows(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, GenerateError> {
        if let LogitRows::From(_) = rows {
            return Ok(self.decoder.forward(&mut self.cache, tokens, rows)?);
        }
        let mut logits = Vec::new();
        for chunk in tokens.chunks(self.batch) {
            // Only the last chunk's logits are used; the others compute one row.
            logits = self
                .decoder
                .forward(&mut self.cache, chunk, LogitRows::Last)?;
        }
        Ok(logits)
    }
}

/// The GPU decoder: prompt batches through GEMMs, single tokens through a CUDA graph.
impl Runner for GpuDecoder {
    fn n_ctx(&self) -> usize {
        GpuDecoder::n_ctx(self)
    }
    fn len(&self) -> usize {
        GpuDecoder::len(self)
    }
    fn reset(&mut self) {
        GpuDecoder::reset(self);
    }
    fn feed_rows(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, GenerateError> {
        Ok(self.forward(tokens, rows)?)
    }
    fn feed_greedy(&mut self, token: u32) -> Result<u32, GenerateError> {
        Ok(self.forward_greedy(token)?)
    }
    fn feed_sample(&mut self, token: u32, sampler: &mut Sampler) -> Result<u32, GenerateError> {
        Ok(self.forward_sample(token, sampler)?)
    }
    fn device_memory(&self) -> Option<String> {
        Some(self.memory_report())
    }
}

#[derive(Clone, Debug)]
pub struct GenerateConfig {
    /// Tokens to generate at most.
    pub n_predict: usize,
    /// Generation stops before any of these strings; they are not printed.
    pub stop: Vec<String>,
    pub sampler: SamplerConfig,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Length,
    EndOfGeneration,
    StopString,
    ContextFull,
}

#[derive(Clone, Debug)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub generated: Vec<u32>,
    pub generate_time: Duration,
    pub stop: StopReason,
}

/// Result of a perplexity run.
#[derive(Clone, Debug)]
pub struct Perplexity {
    pub ppl: f64,
    /// llama.cpp's estimate of the standard error.
    pub stderr: f64,
    pub chunks: usize,
    pub scored_tokens: usize,
}

/// llama.cpp's perplexity chunks: the text tokenized whole (BOS first when the model uses
/// one), cut into chunks of `n_ctx` tokens, BOS first in each chunk when the model uses
/// one. Every token of a chunk's second half is scored from all tokens before it.
pub fn perplexity_chunks(
    model: &Model,
    text: &str,
    n_ctx: usize,
    max_chunks: Option<usize>,
) -> Result<Vec<Vec<u32>>, GenerateError> {
    if n_ctx < 8 {
        return Err(GenerateError::Invalid(
            "the context must hold at least 8 tokens".into(),
        ));
    }
    let t = &model.tokenizer;
    let tokens = t.encode(text, true, false)?;
    let available = tokens.len() / n_ctx;
    let n_chunks = max_chunks.map_or(available, |c| c.min(available));
    if n_chunks == 0 {
        return Err(GenerateError::Invalid(format!(
            "the text has {} tokens, fewer than one chunk of {n_ctx}",
            tokens.len()
        )));
    }
    Ok((0..n_chunks)
        .map(|c| {
            let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
            if t.add_bos {
                chunk[0] = t.bos.expect("checked at load");
            }
            chunk
        })
        .collect())
}

/// Running sums of negative log-likelihoods: the perplexity and llama.cpp's estimate of
/// its standard error.
#[derive(Clone, Debug, Default)]
pub struct NllSum {
    nll: f64,
    nll2: f64,
    count: usize,
}

impl NllSum {
    pub fn add(&mut self, nll: f64) {
        self.nll += nll;
        self.nll2 += nll * nll;
        self.count += 1;
    }

    pub fn ppl(&self) -> f64 {
        (self.nll / self.count.max(1) as f64).exp()
    }

    pub fn result(&self, chunks: usize) -> Perplexity {
        let mean = self.nll / self.count.max(1) as f64;
        let ppl = mean.exp();
        let var = self.nll2 / self.count.max(1) as f64 - mean * mean;
        let stderr = if var > 0.0 && self.count > 1 {
            (var / (self.count - 1) as f64).sqrt() * ppl
        } else {
            0.0
        };
        Perplexity {
            ppl,
            stderr,
            chunks,
            scored_tokens: self.count,
        }
    }
}

/// llama.cpp's perplexity ([`perplexity_chunks`]) on a runner, one chunk at a time.
/// `progress(chunk, chunks, running_ppl)` is called after each chunk.
pub fn perplexity(
    model: &Model,
    runner: &mut dyn Runner,
    text: &str,
    n_ctx: usize,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, GenerateError> {
    if runner.n_ctx() < n_ctx {
        return Err(GenerateError::Invalid(format!(
            "the runner holds {} positions, fewer than a chunk of {n_ctx}",
            runner.n_ctx()
        )));
    }
    let chunks = perplexity_chunks(model, text, n_ctx, max_chunks)?;
    let first = n_ctx / 2;
    let n_vocab = model.tokenizer.n_vocab();
    let mut sum = NllSum::default();
    for (c, chunk) in chunks.iter().enumerate() {
        runner.reset();
        let logits = runner.feed_rows(chunk, LogitRows::From(first))?;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * n_vocab..(j - first + 1) * n_vocab];
            sum.add(-crate::sampler::log_prob(row, chunk[j + 1]));
        }
        progress(c + 1, chunks.len(), sum.ppl());
    }
    Ok(sum.result(chunks.len()))
}
