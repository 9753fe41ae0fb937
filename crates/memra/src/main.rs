//! The `memra` command: subcommands only; the work lives in the library crates.

mod bench;
mod bench_batched;
mod bench_serve;
mod bench_spec;
mod embed;
mod generate;
mod inspect;
mod probe;
mod serve;
mod synth;
mod tokenize;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "memra",
    version,
    about = "Fast GGUF LLM inference on NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Complete a prompt (raw text, no chat template); the text goes to stdout as it comes
    /// (exactly the generated text when stdout is not a terminal).
    Run {
        #[command(flatten)]
        model: generate::ModelArgs,
        #[command(flatten)]
        sampling: generate::SamplingArgs,
        /// The prompt.
        #[arg(short, long)]
        prompt: Option<String>,
        /// Read the prompt from a file, verbatim (`-` reads standard input).
        #[arg(short, long)]
        file: Option<PathBuf>,
        /// Tokens to generate.
        #[arg(short = 'n', long, default_value_t = 128)]
        n_predict: usize,
        /// The output is JSON matching the JSON schema in FILE (it ends when complete).
        #[arg(long, value_name = "FILE", conflicts_with = "grammar")]
        json_schema: Option<PathBuf>,
        /// The output matches the grammar in FILE: GBNF (llama.cpp's, rules with `::=`)
        /// or llguidance's Lark.
        #[arg(long, value_name = "FILE")]
        grammar: Option<PathBuf>,
    },
    /// Chat interactively with the model's chat template; /exit quits.
    Chat {
        #[command(flatten)]
        model: generate::ModelArgs,
        #[command(flatten)]
        sampling: generate::SamplingArgs,
        /// A built-in template (chatml, llama3, gemma) or a template file.
        #[arg(long)]
        template: Option<String>,
        /// A system message.
        #[arg(long)]
        system: Option<String>,
        /// Tokens per reply at most.
        #[arg(short = 'n', long, default_value_t = 1024)]
        n_predict: usize,
    },
    /// Embeddings of texts (the last hidden states, pooled and normalized as the server's
    /// /v1/embeddings computes them): one line of numbers per text; the CPU only for now.
    Embed {
        #[command(flatten)]
        model: generate::ModelArgs,
        /// A text to embed (repeat for several).
        #[arg(short, long)]
        prompt: Vec<String>,
        /// Texts to embed, one a line (`-` reads standard input).
        #[arg(short, long)]
        file: Option<PathBuf>,
        /// mean, cls or last (default: what the file says, else last).
        #[arg(long, value_parser = ["mean", "cls", "last"])]
        pooling: Option<String>,
        /// -1 none, 0 to int16's range, 1 taxicab, 2 Euclidean, p > 2 a p-norm (llama.cpp's).
        #[arg(long, default_value_t = 2, allow_hyphen_values = true)]
        embd_normalize: i64,
        /// Print OpenAI's JSON (`{"object": "list", "data": [...]}`) instead.
        #[arg(long)]
        json: bool,
    },
    /// Perplexity of a text file, by llama.cpp's method.
    Perplexity {
        #[command(flatten)]
        model: generate::ModelArgs,
        /// The text file.
        #[arg(short, long)]
        file: PathBuf,
        /// Chunks to score at most (default: all).
        #[arg(long)]
        chunks: Option<usize>,
    },
    /// Measure prompt processing and generation speed (llama-bench's method and table);
    /// `memra bench serve --help`: load on a running server instead.
    Bench {
        #[command(flatten)]
        model: generate::ModelArgs,
        /// Prompt lengths to test (comma-separated).
        #[arg(
            short = 'p',
            long = "n-prompt",
            value_delimiter = ',',
            default_value = "512"
        )]
        prompt: Vec<usize>,
        /// Generation lengths to test (comma-separated).
        #[arg(
            short = 'n',
            long = "n-gen",
            value_delimiter = ',',
            default_value = "128"
        )]
        generate: Vec<usize>,
        /// Context depths to test at (comma-separated).
        #[arg(
            short = 'd',
            long = "n-depth",
            value_delimiter = ',',
            default_value = "0"
        )]
        depth: Vec<usize>,
        /// Repetitions of each test.
        #[arg(short = 'r', long, default_value_t = 5)]
        repetitions: usize,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = bench::Format::Md)]
        output: bench::Format,
        /// Batched decoding through the serving engine, llama-batched-bench's method and
        /// table (with -npp, -ntg, -npl, --shared-prefix).
        #[arg(long)]
        batched: bool,
        /// --batched: prompt tokens of each sequence (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "128")]
        npp: Vec<usize>,
        /// --batched: tokens generated by each sequence (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "128")]
        ntg: Vec<usize>,
        /// --batched: sequences decoding in parallel (comma-separated).
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        npl: Vec<usize>,
        /// --batched: prompt tokens every sequence shares (taken from the prefix cache
        /// after the first computes them).
        #[arg(long, default_value_t = 0)]
        shared_prefix: usize,
        /// --batched: constrain sequences to the JSON schema in FILE (the cost of the
        /// masks; with --constrained-frac).
        #[arg(long, value_name = "FILE")]
        json_schema: Option<PathBuf>,
        /// --batched: the fraction of each row's sequences --json-schema constrains.
        #[arg(long, default_value_t = 0.5, requires = "json_schema")]
        constrained_frac: f64,
        /// Speculative decoding's speedup: each prompt of FILE (JSON lines: a string, or an
        /// object with "prompt") generated greedily (-n tokens) without and with the drafts
        /// of --spec-ngram / --model-draft; the outputs must be the same.
        #[arg(long, value_name = "FILE", conflicts_with = "batched")]
        spec_prompts: Option<PathBuf>,
    },
    /// Load on a running OpenAI-compatible server (`memra serve`, vLLM, llama-server),
    /// reported as vLLM's serving benchmark reports it (throughput, TTFT, TPOT, ITL). Spelled
    /// `memra bench serve` (the model is the server's, so `bench`'s options do not apply).
    #[command(name = "bench serve", hide = true)]
    BenchServe(bench_serve::ServeBenchArgs),
    /// Serve the model over HTTP with OpenAI's API (chat and text completions, streaming),
    /// batching requests on the engine.
    Serve {
        #[command(flatten)]
        model: generate::ModelArgs,
        #[command(flatten)]
        serve: serve::ServeArgs,
    },
    /// Show the GPU, the architecture the kernels were built for, and measured bandwidth.
    Probe {
        /// GPU ordinal.
        #[arg(long, default_value_t = 0)]
        gpu: usize,
    },
    /// Show what a GGUF file holds: architecture, hyperparameters, tokenizer, tensor types.
    Inspect {
        /// The GGUF file.
        model: PathBuf,
        /// List every metadata key and every tensor.
        #[arg(long)]
        all: bool,
    },
    /// Write a random-weight model of a benchmark shape (for speed measurements).
    Synth {
        /// Shape: llama3-8b, llama3-1b, qwen2.5-7b, qwen2.5-0.5b, llama3-70b, qwen3-30b-a3b.
        #[arg(long)]
        shape: String,
        /// Quant mix: q4_k_m, q8_0, q4_0.
        #[arg(long)]
        quant: String,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        /// Seed for the random weights.
        #[arg(long, default_value_t = 0)]
        seed: u64,
    },
    /// Turn text into token ids with the model's tokenizer (as llama-tokenize does).
    Tokenize {
        /// The GGUF file.
        #[arg(short, long)]
        model: PathBuf,
        /// The text.
        #[arg(short, long)]
        prompt: Option<String>,
        /// Read the text from a file, verbatim.
        #[arg(short, long)]
        file: Option<PathBuf>,
        /// Read the text from standard input.
        #[arg(long)]
        stdin: bool,
        /// Do not add BOS/EOS even if the model asks for them.
        #[arg(long)]
        no_bos: bool,
        /// Treat special-token text in the input as plain text.
        #[arg(long)]
        no_parse_special: bool,
        /// Print only the ids, as one `[id, id, ...]` line.
        #[arg(long)]
        ids: bool,
        /// Measure encoding speed instead of printing tokens.
        #[arg(long)]
        bench: bool,
    },
    /// Render a conversation with the model's chat template.
    Template {
        /// The GGUF file.
        #[arg(short, long)]
        model: PathBuf,
        /// JSON array of messages (`[{"role": "user", "content": "Hi"}]`).
        #[arg(long)]
        messages: PathBuf,
        /// JSON array of tool definitions.
        #[arg(long)]
        tools: Option<PathBuf>,
        /// Leave out the prompt that starts the assistant's turn.
        #[arg(long)]
        no_generation_prompt: bool,
        /// A built-in template (chatml, llama3, gemma) or a template file, instead of the model's.
        #[arg(long)]
        template: Option<String>,
    },
}

/// llama-batched-bench spells its options with one dash (`-npp 128`), llama-server
/// `-np 4`, vLLM `-tp 2`; clap would read that as `-n -p -p`, so they become `--npp`,
/// `--parallel`, `--tensor-parallel` first.
/// `memra bench serve` takes no model (the server has it), so it is a command of its own
/// that `bench serve` is rewritten to.
fn args() -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = std::env::args_os()
        .map(|a| match a.to_str() {
            Some("-npp" | "-ntg" | "-npl") => format!("-{}", a.to_str().unwrap_or("")).into(),
            Some("-np") => "--parallel".into(),
            Some("-tp") => "--tensor-parallel".into(),
            _ => a,
        })
        .collect();
    if args.len() > 2 && args[1] == "bench" && args[2] == "serve" {
        args.splice(1..3, ["bench serve".into()]);
    }
    args
}

fn main() -> ExitCode {
    let cli = Cli::parse_from(args());
    let result = match cli.command {
        Command::Probe { gpu } => probe::run(gpu),
        Command::Serve { model, serve } => serve::run(model, serve),
        Command::Run {
            model,
            sampling,
            prompt,
            file,
            n_predict,
            json_schema,
            grammar,
        } => generate::read_prompt(prompt.as_deref(), file.as_deref()).and_then(|p| {
            let g = generate::read_grammar(json_schema.as_deref(), grammar.as_deref())?;
            generate::run(&model, &sampling, &p, n_predict, g)
        }),
        Command::Chat {
            model,
            sampling,
            template,
            system,
            n_predict,
        } => generate::chat(
            &model,
            &sampling,
            template.as_deref(),
            system.as_deref(),
            n_predict,
        ),
        Command::BenchServe(a) => bench_serve::run(&a),
        Command::Bench {
            model,
            output,
            batched: true,
            npp,
            ntg,
            npl,
            shared_prefix,
            json_schema,
            constrained_frac,
            ..
        } => generate::read_grammar(json_schema.as_deref(), None).and_then(|g| {
            bench_batched::run(
                &model,
                &bench_batched::BatchedArgs {
                    npp,
                    ntg,
                    npl,
                    shared_prefix,
                    format: output,
                    constrained: g.map(|g| (g, constrained_frac)),
                },
            )
        }),
        Command::Bench {
            model,
            generate,
            output,
            spec_prompts: Some(file),
            ..
        } => bench_spec::run(
            &model,
            &file,
            generate.first().copied().unwrap_or(128),
            output,
        ),
        Command::Bench {
            model,
            prompt,
            generate,
            depth,
            repetitions,
            output,
            ..
        } => bench::run(
            &model,
            &bench::BenchArgs {
                prompt,
                generate,
                depth,
                repetitions,
                format: output,
            },
        ),
        Command::Perplexity {
            model,
            file,
            chunks,
        } => generate::run_perplexity(&model, &file, chunks),
        Command::Embed {
            model,
            prompt,
            file,
            pooling,
            embd_normalize,
            json,
        } => embed::run(
            &model,
            &embed::EmbedArgs {
                prompts: &prompt,
                file: file.as_deref(),
                pooling: pooling
                    .as_deref()
                    .and_then(memra_engine::engine::Pooling::parse),
                normalize: embd_normalize,
                json,
            },
        ),
        Command::Inspect { model, all } => inspect::run(&model, all),
        Command::Synth {
            shape,
            quant,
            output,
            seed,
        } => synth::run(&shape, &quant, &output, seed),
        Command::Tokenize {
            model,
            prompt,
            file,
            stdin,
            no_bos,
            no_parse_special,
            ids,
            bench,
        } => tokenize::tokenize(tokenize::TokenizeArgs {
            model: &model,
            prompt: prompt.as_deref(),
            file: file.as_deref(),
            stdin,
            no_bos,
            no_parse_special,
            ids,
            bench,
        }),
        Command::Template {
            model,
            messages,
            tools,
            no_generation_prompt,
            template,
        } => tokenize::template(
            &model,
            &messages,
            tools.as_deref(),
            no_generation_prompt,
            template.as_deref(),
        ),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
