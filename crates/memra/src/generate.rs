//! `memra run`, `memra chat` and `memra perplexity`: generation and scoring on a model.

use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use memra_engine::backend::cuda::decoder::{F16Weights, GpuDecoder, GpuOptions, PoolSize};
use memra_engine::constraint::{Constraint, Grammar};
use memra_engine::engine::{
    BatchRunner, CpuBatchRunner, Engine, EngineConfig, Event, FinishReason, GenerationParams,
    GpuBatchRunner, Request, Usage,
};
use memra_engine::generate::{
    perplexity_chunks, CpuRunner, GenerateConfig, GenerateStats, NllSum, Runner, StopReason,
};
use memra_engine::kv::DEFAULT_BLOCK_SIZE;
use memra_engine::models::Model;
use memra_engine::sampler::SamplerConfig;
use memra_engine::scheduler::SchedulerConfig;
use memra_engine::spec::draft::{check_vocab, DraftModel};
use memra_engine::spec::{DraftPolicy, SpecConfig};
use memra_engine::tokenizer::template::{ChatInput, ChatTemplate};
use memra_gguf::GgufFile;

use crate::inspect::human_bytes;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

/// Options every model command takes.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// The GGUF model file.
    #[arg(short, long)]
    pub model: PathBuf,
    /// Where to run (default: cuda when this build has kernels and a GPU fits them, else
    /// cpu).
    #[arg(long, value_enum)]
    pub device: Option<Device>,
    /// CPU threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Context size in tokens (default: 4096, or the model's training context if smaller).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx: Option<usize>,
    /// Positions of KV cache in the pool (default: the context times the sequences that
    /// run at once).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// GPU: the fraction of the memory left after weights and buffers the KV pool takes
    /// (default 0.9 when serving or batching; one context's worth for run, chat and
    /// perplexity).
    #[arg(long)]
    pub kv_memory: Option<f64>,
    /// Tokens computed per engine step at most: decodes first, then prompt chunks.
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048)]
    pub batch_size: usize,
    /// Prompt tokens computed per engine step at most while other sequences decode
    /// (chunked prefill: the decodes' steps stay short, and waiting prompts get their first
    /// token sooner than in a few large steps).
    #[arg(long, default_value_t = 512)]
    pub prompt_chunk: usize,
    /// GPU: keep f16 copies of the weights for the GEMMs of prompts and many decodes (2
    /// bytes a weight besides the quantized file's: 14 GiB for an 8B). auto: when they take
    /// at most a quarter of the memory left free.
    #[arg(long, value_enum, default_value_t = F16Arg::Auto)]
    pub f16_weights: F16Arg,
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Split the model over N ranks (`-tp N`): attention heads, FFN columns and the
    /// vocabulary, Megatron-style. On the CPU the ranks are threads of this process (a
    /// correctness path, not a faster one); on GPUs it needs N of them (not built yet:
    /// docs/parallel.md).
    #[arg(long = "tensor-parallel", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// Split the layers over 2 GPUs in two stages (not built yet: docs/parallel.md).
    #[arg(long = "pipeline-parallel", default_value_t = 1)]
    pub pipeline_parallel: usize,
}

/// Speculative decoding: drafts of the next tokens verified in one forward pass.
#[derive(Args, Debug, Clone)]
pub struct SpecArgs {
    /// Prompt lookup: draft the tokens that followed the sequence's last N tokens earlier in
    /// its prompt and output (N down to 1). Off by default.
    #[arg(long, value_name = "N")]
    pub spec_ngram: Option<usize>,
    /// A draft model (a smaller one with the same vocabulary) drafts instead.
    #[arg(long, value_name = "FILE")]
    pub model_draft: Option<PathBuf>,
    /// Drafted tokens per step at most (the length adapts to recent acceptance). 7 keeps a
    /// GPU verify step of one sequence on the decode kernels (8 rows), so its tokens are
    /// exactly plain decoding's.
    #[arg(long, default_value_t = 7)]
    pub draft_max: usize,
    /// Drafted tokens per step at least: fewer found, no speculation that step.
    #[arg(long, default_value_t = 1)]
    pub draft_min: usize,
    /// Speculate while at most this many sequences run (a large batch gains nothing).
    #[arg(long, default_value_t = 8)]
    pub spec_max_batch: usize,
    /// How many tokens to draft: `cost` weighs the measured cost of a draft against the
    /// sequence's acceptance and drafts only what pays (none where drafting loses, tried
    /// again every 16 steps); `length` drafts twice the recent accepted count plus one.
    #[arg(long, value_enum, default_value_t = DraftPolicyArg::Cost)]
    pub draft_policy: DraftPolicyArg,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftPolicyArg {
    Cost,
    Length,
}

impl SpecArgs {
    pub fn config(&self) -> Result<Option<SpecConfig>> {
        if self.spec_ngram.is_none() && self.model_draft.is_none() {
            return Ok(None);
        }
        let ngram = self.spec_ngram.unwrap_or(1);
        let c = SpecConfig {
            ngram,
            draft_max: self.draft_max,
            draft_min: self.draft_min,
            max_batch: self.spec_max_batch,
            policy: match self.draft_policy {
                DraftPolicyArg::Cost => DraftPolicy::Cost,
                DraftPolicyArg::Length => DraftPolicy::Length,
            },
        };
        c.validate().map_err(anyhow::Error::msg)?;
        Ok(Some(c))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum F16Arg {
    Auto,
    On,
    Off,
}

impl ModelArgs {
    /// The GPU decoder's options, with a KV pool of `pool`.
    fn gpu_options(&self, pool: PoolSize) -> GpuOptions {
        let f16_weights = match self.f16_weights {
            F16Arg::Auto => F16Weights::Auto,
            F16Arg::On => F16Weights::On,
            F16Arg::Off => F16Weights::Off,
        };
        GpuOptions { pool, f16_weights }
    }
}

impl ModelArgs {
    /// Refuses what `--tensor-parallel` and `--pipeline-parallel` cannot do here, before
    /// the model loads: zero ranks, both at once, more GPUs than the machine has, and the
    /// GPU paths that are not built yet.
    fn check_parallel(&self) -> Result<()> {
        let (tp, pp) = (self.tensor_parallel, self.pipeline_parallel);
        if tp == 0 {
            bail!("--tensor-parallel must be at least 1");
        }
        if !(1..=2).contains(&pp) {
            bail!("--pipeline-parallel takes 1 or 2 (a two-stage pipeline), not {pp}");
        }
        if tp > 1 && pp > 1 {
            bail!("--tensor-parallel and --pipeline-parallel cannot be combined yet");
        }
        let device = self.device();
        if pp > 1 && device == Device::Cpu {
            bail!(
                "--pipeline-parallel splits the layers over GPUs; on the CPU it would only add \
                 a hand-off (use --device cuda on a machine with 2 GPUs)"
            );
        }
        if device == Device::Cuda && tp.max(pp) > 1 {
            let (what, n) = if tp > 1 {
                ("--tensor-parallel", tp)
            } else {
                ("--pipeline-parallel", pp)
            };
            let gpus = memra_engine::backend::cuda::gpu_count()?;
            if gpus < n {
                bail!("{what} {n} needs {n} GPUs; this machine has {gpus}");
            }
            bail!(
                "{what} {n} on GPUs is not built yet (the CPU runs -tp as a correctness path, \
                 --device cpu; docs/parallel.md says what is left)"
            );
        }
        Ok(())
    }

    /// The device asked for, or the default: the GPU when one is usable.
    pub fn device(&self) -> Device {
        self.device.unwrap_or_else(|| {
            if memra_engine::backend::cuda::usable_gpu() {
                Device::Cuda
            } else {
                Device::Cpu
            }
        })
    }
}

/// Sampling options of `run` and `chat`.
#[derive(Args, Debug)]
pub struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Seed of the sampler (default: random).
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Stop before this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
}

impl SamplingArgs {
    fn config(&self) -> SamplerConfig {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        SamplerConfig {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed,
            ..SamplerConfig::default()
        }
    }
}

const DEFAULT_CTX: usize = 4096;
const PROMPT_BATCH: usize = 512;

/// Loads a model on the chosen device with a progress bar, reading the whole file once so
/// the first tokens do not wait on page faults.
pub fn load(args: &ModelArgs) -> Result<(Model, usize)> {
    args.check_parallel()?;
    if args.device() == Device::Cuda && memra_engine::backend::cuda::built_arch().is_none() {
        bail!("{}", memra_engine::backend::cuda::CudaError::NoKernels);
    }
    if let Some(t) = args.threads {
        if t == 0 {
            bail!("--threads must be at least 1");
        }
        rayon::ThreadPoolBuilder::new()
            .num_threads(t)
            .build_global()
            .context("cannot set the thread count")?;
    }
    let start = Instant::now();
    let model = load_file(&args.model)?;
    let n_ctx = args
        .ctx
        .unwrap_or_else(|| DEFAULT_CTX.min(model.decoder.hp.n_ctx_train.max(1)));
    if n_ctx == 0 {
        bail!("the context size must be at least 1");
    }
    eprintln!(
        "model: {} ({}, {:.2} B parameters, {}) loaded in {:.2} s; context {n_ctx}, {} threads",
        model.name,
        model.arch,
        model.n_params as f64 / 1e9,
        human_bytes(model.file.file_size()),
        start.elapsed().as_secs_f64(),
        rayon::current_num_threads()
    );
    Ok((model, n_ctx))
}

/// A model file, read with a progress bar (its pages touched once, so that the first
/// forward does not wait on the disk).
fn load_file(path: &std::path::Path) -> Result<Model> {
    let file = Arc::new(GgufFile::open(path)?);
    let bar = ProgressBar::new(file.file_size()).with_style(
        ProgressStyle::with_template("loading [{bar:40}] {bytes}/{total_bytes}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    const PAGE: usize = 4096;
    let mut touched = 0u8;
    for (i, chunk) in file.bytes().chunks(64 << 20).enumerate() {
        touched ^= chunk.iter().step_by(PAGE).fold(0, |a, &b| a ^ b);
        bar.set_position(((i + 1) * (64 << 20)).min(file.bytes().len()) as u64);
    }
    std::hint::black_box(touched);
    bar.finish_and_clear();
    Model::from_file(file).with_context(|| format!("cannot load {}", path.display()))
}

/// The model on the chosen device, with a context of `n_ctx` positions.
pub fn runner<'m>(
    args: &ModelArgs,
    model: &'m Model,
    n_ctx: usize,
) -> Result<Box<dyn Runner + 'm>> {
    if args.tensor_parallel > 1 {
        bail!("this command runs one context without the engine: --tensor-parallel is not built for it (memra bench --batched takes it)");
    }
    if args.spec.spec_ngram.is_some() || args.spec.model_draft.is_some() {
        bail!("this command runs one context without the engine: speculative decoding is not built for it (memra run, chat, serve, bench --batched and bench --spec-prompts take it)");
    }
    Ok(match args.device() {
        Device::Cpu => Box::new(CpuRunner::new(&model.decoder, n_ctx, PROMPT_BATCH)),
        Device::Cuda => {
            let opts = args.gpu_options(PoolSize::Tokens(n_ctx));
            let gpu = GpuDecoder::with_options(0, &model.decoder, n_ctx, opts)?;
            eprintln!(
                "{} (file {:.0} MiB; prompt batches add their buffers at the first batch)",
                gpu.memory_report(),
                model.file.file_size() as f64 / (1 << 20) as f64
            );
            Box::new(gpu)
        }
    })
}

fn report(stats: &GenerateStats, usage: Option<&Usage>) {
    let rate = |n: usize, d: std::time::Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let cached = match usage.map(|u| u.cached_tokens) {
        Some(c) if c > 0 => format!(" ({c} from the prefix cache)"),
        _ => String::new(),
    };
    let drafts = match usage {
        Some(u) if u.draft_tokens > 0 => format!(
            "; drafts: {} of {} accepted ({:.0}%)",
            u.accepted_tokens,
            u.draft_tokens,
            100.0 * u.accepted_tokens as f64 / u.draft_tokens as f64
        ),
        _ => String::new(),
    };
    eprintln!(
        "\nprompt: {} tokens{cached} in {:.2} s ({:.1} t/s); generated: {} tokens in {:.2} s ({:.1} t/s); stop: {:?}{drafts}",
        stats.prompt_tokens,
        stats.prompt_time.as_secs_f64(),
        rate(stats.prompt_tokens, stats.prompt_time),
        stats.generated.len(),
        stats.generate_time.as_secs_f64(),
        rate(stats.generated.len(), stats.generate_time),
        stats.stop
    );
}

fn print_flush(text: &str) {
    let mut out = std::io::stdout().lock();
    // A closed stdout (a pipe to `head`) ends the output, not the program with a panic.
    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
}

/// Ends the output with a newline on a terminal only: piped, stdout is exactly the text.
fn end_output() {
    if std::io::stdout().is_terminal() {
        print_flush("\n");
    }
}

/// How large a KV pool an engine takes when neither --kv-tokens nor --kv-memory says.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DefaultPool {
    /// Room for every sequence's whole context (`memra run`, `chat`, `perplexity`).
    Contexts,
    /// On a GPU, this fraction of the memory left after weights and buffers (serving and
    /// `bench --batched`, as vLLM does); on the CPU, every sequence's context.
    GpuFraction(f64),
}

/// The serving engine on the chosen device for `parallel` sequences of up to `n_ctx`
/// positions; says on stderr what its KV pool holds.
pub fn start_engine(
    args: &ModelArgs,
    model: Arc<Model>,
    n_ctx: usize,
    parallel: usize,
    pool: DefaultPool,
) -> Result<Engine> {
    if parallel == 0 {
        bail!("at least one sequence must run at a time");
    }
    if args.batch_size == 0 {
        bail!("--batch-size must be at least 1");
    }
    if args.prompt_chunk == 0 {
        bail!("--prompt-chunk must be at least 1");
    }
    let contexts = n_ctx * parallel;
    let spec = args.spec.config()?;
    // The draft first: on a GPU the target's pool takes a share of what is left.
    let draft = match &args.spec.model_draft {
        Some(path) => Some(load_draft(args, path, &model, n_ctx, contexts)?),
        None => None,
    };
    let runner: Box<dyn BatchRunner> = match args.device() {
        Device::Cpu if args.tensor_parallel > 1 => {
            let kv_tokens = args.kv_tokens.unwrap_or(contexts);
            Box::new(CpuBatchRunner::tensor_parallel(
                model.clone(),
                args.tensor_parallel,
                kv_tokens,
                DEFAULT_BLOCK_SIZE,
            )?)
        }
        Device::Cpu => {
            let kv_tokens = args.kv_tokens.unwrap_or(contexts);
            Box::new(CpuBatchRunner::new(
                model.clone(),
                kv_tokens,
                DEFAULT_BLOCK_SIZE,
            ))
        }
        Device::Cuda => {
            let size = match (args.kv_tokens, args.kv_memory, pool) {
                (Some(t), _, _) => PoolSize::Tokens(t),
                (None, Some(f), _) => PoolSize::MemoryFraction(f),
                (None, None, DefaultPool::GpuFraction(f)) => PoolSize::MemoryFraction(f),
                (None, None, DefaultPool::Contexts) => PoolSize::Tokens(contexts),
            };
            if let PoolSize::MemoryFraction(f) = size {
                if !(f > 0.0 && f <= 1.0) {
                    bail!("--kv-memory must be a fraction in (0, 1]");
                }
            }
            let gpu = GpuDecoder::with_options(0, &model.decoder, n_ctx, args.gpu_options(size))?;
            Box::new(GpuBatchRunner::new(gpu))
        }
    };
    let engine = Engine::start_with_draft(
        model,
        runner,
        EngineConfig {
            scheduler: SchedulerConfig {
                max_running: parallel,
                token_budget: args.batch_size,
                prompt_chunk: args.prompt_chunk,
            },
            n_ctx,
            spec,
        },
        draft,
    );
    eprintln!("{}", engine.info().pool);
    Ok(engine)
}

/// The draft model of `--model-draft`, refused unless it shares the target's vocabulary,
/// on the target's device with room for `contexts` positions.
fn load_draft(
    args: &ModelArgs,
    path: &std::path::Path,
    target: &Model,
    n_ctx: usize,
    contexts: usize,
) -> Result<DraftModel> {
    let draft = Arc::new(load_file(path)?);
    check_vocab(target, &draft)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("cannot draft with {}", path.display()))?;
    let runner: Box<dyn BatchRunner> = match args.device() {
        Device::Cpu => Box::new(CpuBatchRunner::new(
            draft.clone(),
            contexts,
            DEFAULT_BLOCK_SIZE,
        )),
        Device::Cuda => {
            let opts = args.gpu_options(PoolSize::Tokens(contexts));
            Box::new(GpuBatchRunner::new(GpuDecoder::with_options(
                0,
                &draft.decoder,
                n_ctx,
                opts,
            )?))
        }
    };
    let d = DraftModel::new(draft, runner);
    eprintln!("{}", d.describe());
    Ok(d)
}

/// Generates through the engine, giving each piece of text to `on_text` as it comes;
/// returns the statistics and the request's usage (prefix-cache hits, drafts).
pub(crate) fn engine_generate(
    engine: &Engine,
    prompt: Vec<u32>,
    config: &GenerateConfig,
    constraint: Option<Constraint>,
    mut on_text: impl FnMut(&str),
) -> Result<(GenerateStats, Usage)> {
    let prompt_tokens = prompt.len();
    let start = Instant::now();
    let mut handle = engine.submit(Request {
        prompt,
        params: GenerationParams {
            max_tokens: config.n_predict,
            sampler: config.sampler.clone(),
            stop: config.stop.clone(),
            constraint,
            ..GenerationParams::default()
        },
    })?;
    let mut prompt_time = None;
    let mut generated = Vec::new();
    loop {
        match handle.next() {
            Some(Event::Token(t)) => {
                let now = start.elapsed();
                prompt_time.get_or_insert(now);
                generated.push(t.id);
                on_text(&t.text);
            }
            Some(Event::Finished {
                reason,
                text,
                usage,
                ..
            }) => {
                on_text(&text);
                let total = start.elapsed();
                let prompt_time = prompt_time.unwrap_or(total);
                let stop = match reason {
                    FinishReason::Length => StopReason::Length,
                    FinishReason::EndOfGeneration => StopReason::EndOfGeneration,
                    FinishReason::StopString => StopReason::StopString,
                };
                let stats = GenerateStats {
                    prompt_tokens,
                    prompt_time,
                    generated,
                    generate_time: total - prompt_time,
                    stop,
                };
                return Ok((stats, usage));
            }
            Some(Event::Error(e)) => bail!("{e}"),
            Some(Event::PromptScores(_) | Event::Embedding(_)) => {}
            None => bail!("the engine has stopped"),
        }
    }
}

/// The prompt of `run`: `-p TEXT`, or `-f FILE` (`-f -`: standard input), verbatim.
pub fn read_prompt(prompt: Option<&str>, file: Option<&Path>) -> Result<String> {
    match (prompt, file) {
        (Some(p), None) => Ok(p.to_string()),
        (None, Some(f)) if f == Path::new("-") => {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .context("cannot read the prompt from standard input")?;
            Ok(text)
        }
        (None, Some(f)) => {
            let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
            String::from_utf8(bytes).with_context(|| format!("{} is not valid UTF-8", f.display()))
        }
        (Some(_), Some(_)) => bail!("give the prompt with -p or -f, not both"),
        (None, None) => bail!("no prompt: give -p TEXT or -f FILE (-f - reads standard input)"),
    }
}

/// The grammar of `run --json-schema FILE` or `--grammar FILE` (GBNF when it defines
/// rules with `::=`, else Lark).
pub fn read_grammar(json_schema: Option<&Path>, grammar: Option<&Path>) -> Result<Option<Grammar>> {
    let read = |f: &Path| {
        std::fs::read_to_string(f).with_context(|| format!("cannot read {}", f.display()))
    };
    Ok(match (json_schema, grammar) {
        (Some(f), _) => {
            let v: serde_json::Value = serde_json::from_str(&read(f)?)
                .with_context(|| format!("{} is not JSON", f.display()))?;
            Some(Grammar::JsonSchema(v))
        }
        (None, Some(f)) => {
            let text = read(f)?;
            Some(match text.contains("::=") {
                true => Grammar::Gbnf(text),
                false => Grammar::Lark(text),
            })
        }
        (None, None) => None,
    })
}

pub fn run(
    args: &ModelArgs,
    sampling: &SamplingArgs,
    prompt: &str,
    n_predict: usize,
    grammar: Option<Grammar>,
) -> Result<()> {
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if n_predict == 0 {
        bail!("-n must be at least 1");
    }
    let (model, n_ctx) = load(args)?;
    let ids = model.tokenizer.encode(prompt, true, true)?;
    if ids.len() >= n_ctx {
        bail!(
            "the prompt has {} tokens; the context holds {n_ctx} (raise -c)",
            ids.len()
        );
    }
    let config = GenerateConfig {
        // The context bounds the generation (as in llama.cpp): stop when it is full.
        n_predict: n_predict.min(n_ctx - ids.len()),
        stop: sampling.stop.clone(),
        sampler: sampling.config(),
    };
    config.sampler.validate()?;
    let engine = start_engine(args, Arc::new(model), n_ctx, 1, DefaultPool::Contexts)?;
    let constraint = grammar
        .map(|g| engine.compile_grammar(&g))
        .transpose()
        .context("cannot use the grammar")?;
    let (stats, usage) = engine_generate(&engine, ids, &config, constraint, print_flush)?;
    end_output();
    let mut stats = stats;
    if stats.stop == StopReason::Length && stats.generated.len() < n_predict {
        stats.stop = StopReason::ContextFull;
    }
    report(&stats, Some(&usage));
    Ok(())
}

pub fn chat(
    args: &ModelArgs,
    sampling: &SamplingArgs,
    template: Option<&str>,
    system: Option<&str>,
    n_predict: usize,
) -> Result<()> {
    let (model, n_ctx) = load(args)?;
    let template = ChatTemplate::select(&model.file.metadata, template)?;
    let model = Arc::new(model);
    let t = &model.tokenizer;
    let token = |id: Option<u32>| id.and_then(|i| t.token_text(i)).unwrap_or("").to_string();
    let (bos, eos) = (token(t.bos), token(t.eos));
    let mut messages: Vec<serde_json::Value> = Vec::new();
    if let Some(s) = system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    let engine = start_engine(args, model.clone(), n_ctx, 1, DefaultPool::Contexts)?;
    let stdin = std::io::stdin();
    eprintln!("chat with {} (type /exit to quit)", model.name);
    loop {
        eprint!("> ");
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim() == "/exit" {
            break;
        }
        if line.trim().is_empty() {
            continue;
        }
        messages.push(serde_json::json!({"role": "user", "content": line}));
        let prompt = template.render(&ChatInput {
            messages: &serde_json::Value::Array(messages.clone()),
            tools: None,
            add_generation_prompt: true,
            bos_token: &bos,
            eos_token: &eos,
        })?;
        // A template that writes the BOS text itself (Llama 3, Gemma) must not get a second
        // BOS from the tokenizer.
        let add_bos = bos.is_empty() || !prompt.starts_with(&bos);
        // The whole conversation each turn: the blocks of earlier turns come from the
        // prefix cache.
        let ids = t.encode(&prompt, add_bos, true)?;
        if ids.len() + 1 >= n_ctx {
            eprintln!("error: the conversation no longer fits the {n_ctx}-token context; start a new chat");
            messages.pop();
            continue;
        }
        let config = GenerateConfig {
            n_predict: n_predict.min(n_ctx - ids.len()),
            stop: sampling.stop.clone(),
            sampler: sampling.config(),
        };
        let mut reply = String::new();
        let (stats, usage) = engine_generate(&engine, ids, &config, None, |s| {
            reply.push_str(s);
            print_flush(s);
        })?;
        print_flush("\n");
        report(&stats, Some(&usage));
        messages.push(serde_json::json!({"role": "assistant", "content": reply}));
    }
    Ok(())
}

pub fn run_perplexity(args: &ModelArgs, file: &Path, chunks: Option<usize>) -> Result<()> {
    let text = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let mut text = String::from_utf8(text)
        .with_context(|| format!("{} is not valid UTF-8", file.display()))?;
    // llama.cpp drops one trailing newline.
    if text.ends_with('\n') {
        text.pop();
    }
    let n_ctx = args.ctx.unwrap_or(512);
    let (model, _) = load(args)?;
    let start = Instant::now();
    let progress = |c: usize, n: usize, ppl: f64| {
        eprintln!(
            "[{c}/{n}] {ppl:.4} ({:.1} s, {:.1} t/s)",
            start.elapsed().as_secs_f64(),
            (c * n_ctx) as f64 / start.elapsed().as_secs_f64()
        );
    };
    let model = Arc::new(model);
    let chunks = perplexity_chunks(&model, &text, n_ctx, chunks)?;
    let engine = start_engine(args, model, n_ctx, 1, DefaultPool::Contexts)?;
    // Every chunk queued at once; each scores its second half.
    let handles = chunks
        .into_iter()
        .map(|chunk| {
            engine.submit(Request {
                prompt: chunk,
                params: GenerationParams {
                    max_tokens: 0,
                    score_from: Some(n_ctx / 2),
                    ..GenerationParams::default()
                },
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let n = handles.len();
    let mut sum = NllSum::default();
    for (c, handle) in handles.into_iter().enumerate() {
        for event in handle {
            match event {
                Event::PromptScores(lp) => lp.iter().for_each(|s| sum.add(-f64::from(s.logprob))),
                Event::Error(e) => bail!("{e}"),
                _ => {}
            }
        }
        progress(c + 1, n, sum.ppl());
    }
    let result = sum.result(n);
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        result.ppl, result.stderr
    );
    Ok(())
}
