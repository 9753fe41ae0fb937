//! memra-engine: the model runtime: tokenizers and chat templates, model architectures,
//! the CPU backend, the serving engine (paged KV, scheduler, batches), sampling and constrained decoding, generation
//! and perplexity, and model synthesis for benchmarks.

pub mod backend;
pub mod batch;
pub mod constraint;
pub mod engine;
pub mod generate;
pub mod kv;
pub mod models;
pub mod parallel;
pub mod sampler;
pub mod scheduler;
pub mod spec;
pub mod stop;
pub mod synth;
pub mod tokenizer;
