//! memra-engine: the model runtime. For now it holds model synthesis (`memra synth`);
//! architectures, tokenizers, backends and the scheduler grow here.

pub mod synth;
