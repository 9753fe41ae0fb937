//! The `memra` command: subcommands only; the work lives in the library crates.

mod bench;
mod generate;
mod inspect;
mod probe;
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
    /// Complete a prompt (raw text, no chat template); the text goes to stdout as it comes.
    Run {
        #[command(flatten)]
        model: generate::ModelArgs,
        #[command(flatten)]
        sampling: generate::SamplingArgs,
        /// The prompt.
        #[arg(short, long)]
        prompt: String,
        /// Tokens to generate.
        #[arg(short = 'n', long, default_value_t = 128)]
        n_predict: usize,
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
    /// Measure prompt processing and generation speed (llama-bench's method and table).
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
        /// Shape: llama3-8b, llama3-1b, qwen2.5-7b, llama3-70b, qwen3-30b-a3b.
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

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Probe { gpu } => probe::run(gpu),
        Command::Run {
            model,
            sampling,
            prompt,
            n_predict,
        } => generate::run(&model, &sampling, &prompt, n_predict),
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
        Command::Bench {
            model,
            prompt,
            generate,
            depth,
            repetitions,
            output,
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
