//! Text generation and perplexity on a loaded model: the loops `memra run`, `memra chat`
//! and `memra perplexity` drive.

use std::time::{Duration, Instant};

use crate::backend::cuda::decoder::GpuDecoder;
use crate::backend::cuda::CudaError;
use crate::models::{Decoder, KvCache, LogitRows, Model, ModelError};
use crate::sampler::{Sampler, SamplerConfig, SamplerError};
use crate::tokenizer::IncrementalDecoder;

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
impl Runner for GpuDecoder<'_> {
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

/// Holds back text that may be the start of a stop string.
struct StopFilter<'a> {
    stops: &'a [String],
    held: String,
}

impl StopFilter<'_> {
    /// Adds text; returns what can be shown and whether a stop string was reached.
    fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .map(move |n| (s, n))
            })
            .filter(|(s, n)| s.is_char_boundary(*n) && self.held.ends_with(&s[..*n]))
            .map(|(_, n)| n)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }
}

/// Feeds `prompt` (after what the runner holds) and samples up to `n_predict` tokens,
/// giving each piece of text to `on_text` as soon as it is complete.
pub fn generate(
    model: &Model,
    runner: &mut dyn Runner,
    prompt: &[u32],
    config: &GenerateConfig,
    mut on_text: impl FnMut(&str),
) -> Result<GenerateStats, GenerateError> {
    if prompt.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    if runner.len() + prompt.len() > runner.n_ctx() {
        return Err(GenerateError::PromptTooLong {
            prompt: runner.len() + prompt.len(),
            n_ctx: runner.n_ctx(),
        });
    }
    let mut sampler = Sampler::new(config.sampler.clone())?;
    prompt.iter().for_each(|&t| sampler.accept(t));
    let start = Instant::now();
    let logits = runner.feed(prompt)?;
    let prompt_time = start.elapsed();
    let start = Instant::now();
    let t = &model.tokenizer;
    let mut decoder = IncrementalDecoder::new(t, false);
    let mut filter = StopFilter {
        stops: &config.stop,
        held: String::new(),
    };
    let mut generated = Vec::new();
    let mut stop = StopReason::Length;
    let mut next = None;
    while generated.len() < config.n_predict {
        let id = next.take().unwrap_or_else(|| sampler.sample(&logits));
        if t.is_end_of_generation(id) {
            stop = StopReason::EndOfGeneration;
            break;
        }
        sampler.accept(id);
        generated.push(id);
        let (text, hit) = filter.push(&decoder.push(id)?);
        on_text(&text);
        if hit {
            stop = StopReason::StopString;
            break;
        }
        if generated.len() == config.n_predict {
            break;
        }
        if runner.len() >= runner.n_ctx() {
            stop = StopReason::ContextFull;
            break;
        }
        next = Some(runner.feed_sample(id, &mut sampler)?);
    }
    if stop != StopReason::StopString {
        let (text, _) = filter.push(&decoder.finish());
        on_text(&text);
        on_text(&filter.held);
    }
    Ok(GenerateStats {
        prompt_tokens: prompt.len(),
        prompt_time,
        generated,
        generate_time: start.elapsed(),
        stop,
    })
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

/// llama.cpp's perplexity: tokenize the text whole (BOS first when the model uses one),
/// cut it into chunks of `n_ctx` tokens, put BOS first in each chunk when the model uses
/// one, and score every token of the second half of each chunk from all tokens before it.
/// `progress(chunk, running_ppl)` is called after each chunk.
pub fn perplexity(
    model: &Model,
    runner: &mut dyn Runner,
    text: &str,
    n_ctx: usize,
    max_chunks: Option<usize>,
    mut progress: impl FnMut(usize, usize, f64),
) -> Result<Perplexity, GenerateError> {
    if n_ctx < 8 {
        return Err(GenerateError::Invalid(
            "the context must hold at least 8 tokens".into(),
        ));
    }
    if runner.n_ctx() < n_ctx {
        return Err(GenerateError::Invalid(format!(
            "the runner holds {} positions, fewer than a chunk of {n_ctx}",
            runner.n_ctx()
        )));
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
    let first = n_ctx / 2;
    let n_vocab = t.n_vocab();
    let (mut nll, mut nll2, mut count) = (0f64, 0f64, 0usize);
    for c in 0..n_chunks {
        let mut chunk = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
        if t.add_bos {
            chunk[0] = t.bos.expect("checked at load");
        }
        runner.reset();
        let logits = runner.feed_rows(&chunk, LogitRows::From(first))?;
        for j in first..n_ctx - 1 {
            let row = &logits[(j - first) * n_vocab..(j - first + 1) * n_vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
            let lse = f64::from(max)
                + row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
            let v = lse - f64::from(row[chunk[j + 1] as usize]);
            nll += v;
            nll2 += v * v;
            count += 1;
        }
        progress(c + 1, n_chunks, (nll / count as f64).exp());
    }
    let mean = nll / count as f64;
    let ppl = mean.exp();
    let var = nll2 / count as f64 - mean * mean;
    let stderr = if var > 0.0 && count > 1 {
        (var / (count - 1) as f64).sqrt() * ppl
    } else {
        0.0
    };
    Ok(Perplexity {
        ppl,
        stderr,
        chunks: n_chunks,
        scored_tokens: count,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_possible_stop_prefixes() {
        let stops = vec!["</s>".to_string(), "\n\n".to_string()];
        let mut f = StopFilter {
            stops: &stops,
            held: String::new(),
        };
        assert_eq!(f.push("Hello <"), ("Hello ".to_string(), false));
        assert_eq!(f.push("/"), (String::new(), false));
        assert_eq!(f.push("x>"), ("</x>".to_string(), false));
        assert_eq!(f.push("a\n"), ("a".to_string(), false));
        assert_eq!(f.push("\nmore"), (String::new(), true));
        let mut f = StopFilter {
            stops: &stops,
            held: String::new(),
        };
        assert_eq!(f.push("ab</s>cd"), ("ab".to_string(), true));
    }
}
