//! memra-engine: the model runtime: tokenizers and chat templates, model architectures,
//! the CPU backend, sampling, generation and perplexity, and model synthesis for benchmarks.

pub mod backend;
pub mod generate;
pub mod models;
pub mod sampler;
pub mod synth;
pub mod tokenizer;
