//! Qwen2 / Qwen2.5 (`qwen2`): the llama decoder with q/k/v biases and NeoX rotary layout.

use std::sync::Arc;

use memra_gguf::GgufFile;

use super::layers::{Decoder, Hyper};
use super::rope::RopeLayout;
use super::ModelError;

pub fn load(file: &Arc<GgufFile>, hp: &Hyper) -> Result<Decoder, ModelError> {
    super::llama::load_with(file, hp, "qwen2", RopeLayout::Halves, false, None)
}
