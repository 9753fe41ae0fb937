//! Qwen3 (`qwen3`): RMS norms on each head's queries and keys, explicit head dimension
//! (`qwen3.attention.key_length`), NeoX rotary layout, no biases.

use std::sync::Arc;

use memra_gguf::GgufFile;

use super::layers::{Decoder, Hyper};
use super::rope::RopeLayout;
use super::ModelError;

pub fn load(file: &Arc<GgufFile>, hp: &Hyper) -> Result<Decoder, ModelError> {
    super::llama::load_with(file, hp, "qwen3", RopeLayout::Halves, true, None)
}
