//! The `memra` command: subcommands only; the work lives in the library crates.

mod inspect;
mod synth;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Inspect { model, all } => inspect::run(&model, all),
        Command::Synth {
            shape,
            quant,
            output,
            seed,
        } => synth::run(&shape, &quant, &output, seed),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
