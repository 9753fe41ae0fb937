//! memra-engine: the model runtime. Today: tokenizers and chat templates (`tokenizer`),
//! and model synthesis (`synth`); architectures, backends and the scheduler grow here.

pub mod synth;
pub mod tokenizer;
