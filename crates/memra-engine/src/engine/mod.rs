//! The serving engine: many requests share one model through continuous batching over a
//! paged KV cache.
//!
//! The engine runs on a thread of its own that owns the backend (a [`BatchRunner`]) and
//! the [`Scheduler`]. Requests come in through a channel; each step the scheduler picks
//! tokens of running and waiting sequences, the runner computes them in one
//! [`ForwardBatch`], and each sequence whose last token was computed samples its next with
//! its own parameters. Every request gets its events (text pieces, log-probabilities, the
//! finish) through its own sink. `memra run`, `chat`, `perplexity`, `bench --batched` and
//! the server are clients of it.

mod cpu;
mod embed;
mod gpu;
mod speculate;
mod worker;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;

pub use cpu::CpuBatchRunner;
pub use embed::{normalize, Pooling};
pub use gpu::GpuBatchRunner;

use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::constraint::{Constraint, Grammar, GrammarError, Grammars};
use crate::models::Model;
use crate::sampler::{SamplerConfig, SamplerError};
use crate::scheduler::{SchedulerConfig, SeqId};
use crate::spec::draft::DraftModel;
use crate::spec::SpecConfig;

/// A backend that runs forward passes over a paged KV pool it owns.
pub trait BatchRunner: Send {
    /// Runs one step; returns, for each row of `batch.logit_rows`, what its pick asks: the
    /// next token (sampled where the logits are: on a GPU, only the id crosses to the host)
    /// or the logits; then each of `batch.hidden_rows`' states ([`RowOut::Hidden`]).
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        picks: &mut [RowPick],
    ) -> Result<Vec<RowOut>, String>;
    fn num_blocks(&self) -> usize;
    fn block_size(&self) -> usize;
    /// A line for the user: where the pool is and what it holds.
    fn describe(&self) -> String;
    /// Whether it returns hidden states ([`ForwardBatch::hidden_rows`]): embeddings.
    fn computes_hidden(&self) -> bool {
        true
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens and asks for up to {max_tokens} more; the context holds {n_ctx} (a shorter prompt or fewer tokens, or a larger context, -c)")]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        n_ctx: usize,
    },
    #[error("the request needs {needed} positions of KV cache; the pool holds {pool} (a larger pool, --kv-tokens)")]
    PoolTooSmall { needed: usize, pool: usize },
    #[error("token id {0} outside the vocabulary")]
    BadToken(u32),
    #[error("max_tokens must be at least 1")]
    NoTokens,
    #[error("an embedding request generates nothing: no max_tokens, scoring or grammar")]
    BadEmbedding,
    #[error("this engine's backend does not compute embeddings (the CPU does: --device cpu)")]
    NoEmbeddings,
    #[error("prompt scoring starts at position {from}, past the prompt of {prompt}")]
    BadScoring { from: usize, prompt: usize },
    #[error(transparent)]
    Sampler(#[from] SamplerError),
    #[error("the engine has stopped")]
    Stopped,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub scheduler: SchedulerConfig,
    /// Positions one sequence may hold (prompt and generated tokens).
    pub n_ctx: usize,
    /// Speculative decoding (prompt lookup) for the sequences that can take it: no
    /// grammar, no log-probabilities, no prompt scoring.
    pub spec: Option<SpecConfig>,
}

#[derive(Clone, Debug)]
pub struct GenerationParams {
    /// Tokens to generate at most (0 only when scoring the prompt).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    /// Generation stops before any of these strings; they are not part of the text.
    pub stop: Vec<String>,
    /// Generate past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Log-probabilities of each generated token and of this many best alternatives.
    pub logprobs: Option<usize>,
    /// Score the prompt: the log-probability of each prompt token after position `from`
    /// given those before it (perplexity, completions' `echo` with `logprobs`), with
    /// `logprobs` alternatives each. Such a request does not use the prefix cache.
    pub score_from: Option<usize>,
    /// The output must match this grammar ([`Engine::compile_grammar`]); it ends when the
    /// grammar is complete.
    pub constraint: Option<Constraint>,
    /// Speculative decoding for this request, where the engine speculates: at most and at
    /// least this many drafts a step (`None`: the engine's bounds; a most of 0: none).
    pub draft_max: Option<usize>,
    pub draft_min: Option<usize>,
    /// Embed the prompt instead of generating (`max_tokens` 0): the request's events are
    /// one [`Event::Embedding`] and `Finished` (`Length`, no tokens). Only `Last` pooling
    /// uses the prefix cache.
    pub embed: Option<Pooling>,
}

impl Default for GenerationParams {
    fn default() -> GenerationParams {
        GenerationParams {
            max_tokens: 128,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            score_from: None,
            constraint: None,
            draft_max: None,
            draft_min: None,
            embed: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: GenerationParams,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TokenEvent {
    pub id: u32,
    /// Text that became complete and is not held back for a stop string (may be empty).
    pub text: String,
    /// The token's log-probability under the model (before sampling adjustments), when
    /// asked for.
    pub logprob: Option<f32>,
    /// The best alternatives, best first, when asked for.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A prompt token scored ([`GenerationParams::score_from`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptScore {
    /// Its log-probability given the tokens before it.
    pub logprob: f32,
    /// The best tokens at its position, best first, when the request asks for
    /// log-probabilities (`logprobs`: that many).
    pub top_logprobs: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// `max_tokens` generated.
    Length,
    /// The model produced an end-of-generation token (not part of the output).
    EndOfGeneration,
    /// A stop string was reached.
    StopString,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of computed.
    pub cached_tokens: usize,
    /// Times the sequence was preempted and recomputed.
    pub preemptions: usize,
    /// Speculative decoding: tokens drafted, and how many of them the model accepted.
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    /// Prompt tokens `from + 1..prompt_len` scored, each given those before it; sent once,
    /// when the prompt has been computed (before the first token).
    PromptScores(Vec<PromptScore>),
    /// The end: text that was held back, why (and the stop string, for `StopString`), and
    /// counts.
    Finished {
        reason: FinishReason,
        text: String,
        usage: Usage,
        stop: Option<String>,
    },
    /// An embedding request's pooled hidden state (`n_embd`, not normalized); sent once,
    /// before `Finished`.
    Embedding(Vec<f32>),
    /// The step failed (a backend error); the request is over.
    Error(String),
}

/// Where a request's events go; returns false when nobody listens any more (the request
/// is then cancelled).
pub type EventSink = Box<dyn FnMut(Event) -> bool + Send>;

enum Command {
    Add {
        id: SeqId,
        request: Box<Request>,
        sink: EventSink,
    },
    Cancel(SeqId),
    Shutdown,
}

/// What the engine holds right now (metrics): sequences and KV blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Sequences the scheduler runs (holding blocks).
    pub running: usize,
    /// Sequences waiting to be admitted (or re-admitted after a preemption).
    pub waiting: usize,
    /// Blocks held by sequences (not free, not merely cached).
    pub blocks_used: usize,
    pub num_blocks: usize,
}

/// Where the engine thread publishes its [`EngineStats`], once per loop (before it
/// sleeps on the channel, so a finished or cancelled request's blocks show as free).
#[derive(Debug, Default)]
struct StatsCell {
    running: AtomicUsize,
    waiting: AtomicUsize,
    blocks_used: AtomicUsize,
}

impl StatsCell {
    fn publish(&self, running: usize, waiting: usize, blocks_used: usize) {
        self.running.store(running, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        self.blocks_used.store(blocks_used, Ordering::Relaxed);
    }
}

/// What the engine was started with.
#[derive(Clone, Debug)]
pub struct EngineInfo {
    pub n_ctx: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub max_running: usize,
    pub token_budget: usize,
    pub pool: String,
    /// The runner returns hidden states (embedding requests are accepted).
    pub embeddings: bool,
}

impl EngineInfo {
    /// Positions the KV pool holds.
    pub fn kv_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

pub struct Engine {
    model: Arc<Model>,
    tx: Sender<Command>,
    worker: Option<JoinHandle<()>>,
    next_id: AtomicU64,
    info: EngineInfo,
    stats: Arc<StatsCell>,
    /// The grammar compiler, built at the first constrained request.
    grammars: OnceLock<Result<Grammars, GrammarError>>,
}

impl Engine {
    /// Starts the engine thread over `runner`.
    pub fn start(model: Arc<Model>, runner: Box<dyn BatchRunner>, config: EngineConfig) -> Engine {
        Engine::start_with_draft(model, runner, config, None)
    }

    /// [`Engine::start`], with a draft model for speculative decoding (used when
    /// `config.spec` is set; its vocabulary checked by `spec::draft::check_vocab`).
    pub fn start_with_draft(
        model: Arc<Model>,
        runner: Box<dyn BatchRunner>,
        config: EngineConfig,
        draft: Option<DraftModel>,
    ) -> Engine {
        let info = EngineInfo {
            n_ctx: config.n_ctx,
            block_size: runner.block_size(),
            num_blocks: runner.num_blocks(),
            max_running: config.scheduler.max_running,
            token_budget: config.scheduler.token_budget,
            pool: runner.describe(),
            embeddings: runner.computes_hidden(),
        };
        let (tx, rx) = mpsc::channel();
        let m = model.clone();
        let stats = Arc::new(StatsCell::default());
        let s = stats.clone();
        let worker = std::thread::Builder::new()
            .name("memra-engine".into())
            .spawn(move || worker::run(m, runner, config.scheduler, config.spec, draft, rx, &s))
            .expect("spawn the engine thread");
        Engine {
            model,
            tx,
            worker: Some(worker),
            next_id: AtomicU64::new(1),
            info,
            stats,
            grammars: OnceLock::new(),
        }
    }

    /// Compiles a grammar for a request's `constraint`; the first call builds the
    /// vocabulary's trie (a few hundred milliseconds: call it off latency-sensitive
    /// threads).
    pub fn compile_grammar(&self, g: &Grammar) -> Result<Constraint, GrammarError> {
        match self
            .grammars
            .get_or_init(|| Grammars::new(&self.model.tokenizer))
        {
            Ok(grammars) => grammars.compile(g),
            Err(e) => Err(GrammarError::Invalid(e.to_string())),
        }
    }

    /// Sequences and blocks as of the engine thread's last loop (at most one step old).
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self.stats.running.load(Ordering::Relaxed),
            waiting: self.stats.waiting.load(Ordering::Relaxed),
            blocks_used: self.stats.blocks_used.load(Ordering::Relaxed),
            num_blocks: self.info.num_blocks,
        }
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// Checks a request before it starts: everything that would make it fail later.
    pub fn validate(&self, r: &Request) -> Result<(), EngineError> {
        let p = &r.params;
        if r.prompt.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        let n_vocab = self.model.decoder.hp.n_vocab;
        if let Some(&bad) = r.prompt.iter().find(|&&t| t as usize >= n_vocab) {
            return Err(EngineError::BadToken(bad));
        }
        if p.embed.is_some()
            && (p.max_tokens > 0 || p.score_from.is_some() || p.constraint.is_some())
        {
            return Err(EngineError::BadEmbedding);
        }
        if p.embed.is_some() && !self.info.embeddings {
            return Err(EngineError::NoEmbeddings);
        }
        match p.score_from {
            None if p.max_tokens == 0 && p.embed.is_none() => return Err(EngineError::NoTokens),
            Some(from) if from >= r.prompt.len() => {
                return Err(EngineError::BadScoring {
                    from,
                    prompt: r.prompt.len(),
                })
            }
            _ => {}
        }
        p.sampler.validate()?;
        let total = r.prompt.len().saturating_add(p.max_tokens);
        if total > self.info.n_ctx {
            return Err(EngineError::TooLong {
                prompt: r.prompt.len(),
                max_tokens: p.max_tokens,
                n_ctx: self.info.n_ctx,
            });
        }
        // The sequence's last sampled token is never fed, so it needs no position.
        let needed = total.saturating_sub(1).max(r.prompt.len());
        let bs = self.info.block_size;
        if needed.div_ceil(bs) > self.info.num_blocks {
            return Err(EngineError::PoolTooSmall {
                needed,
                pool: self.info.kv_tokens(),
            });
        }
        Ok(())
    }

    /// Queues a request whose events go to `sink`; returns its id (to cancel it).
    pub fn submit_with(&self, request: Request, sink: EventSink) -> Result<SeqId, EngineError> {
        self.validate(&request)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.tx
            .send(Command::Add {
                id,
                request: Box::new(request),
                sink,
            })
            .map_err(|_| EngineError::Stopped)?;
        Ok(id)
    }

    /// Queues a request; its events arrive on the handle, which cancels the request when
    /// dropped before the end.
    pub fn submit(&self, request: Request) -> Result<RequestHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let id = self.submit_with(request, Box::new(move |e| tx.send(e).is_ok()))?;
        Ok(RequestHandle {
            id,
            events: rx,
            cancel: self.tx.clone(),
            done: false,
        })
    }

    /// Cancels a request: its blocks go back to the pool at the next step.
    pub fn cancel(&self, id: SeqId) {
        let _ = self.tx.send(Command::Cancel(id));
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

/// A submitted request's events.
pub struct RequestHandle {
    pub id: SeqId,
    events: Receiver<Event>,
    cancel: Sender<Command>,
    done: bool,
}

impl Iterator for RequestHandle {
    type Item = Event;

    /// The next event; `None` after the last (a finish or an error).
    fn next(&mut self) -> Option<Event> {
        if self.done {
            return None;
        }
        match self.events.recv() {
            Ok(e) => {
                self.done = matches!(e, Event::Finished { .. } | Event::Error(_));
                Some(e)
            }
            Err(_) => {
                self.done = true;
                Some(Event::Error("the engine has stopped".into()))
            }
        }
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.cancel.send(Command::Cancel(self.id));
        }
    }
}
