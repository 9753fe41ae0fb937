//! Qwen3 MoE (`qwen3moe`): Qwen3 attention with a mixture-of-experts FFN: softmax over
//! `expert_count` router logits, the top `expert_used_count` experts with their
//! probabilities renormalized to sum to one (llama.cpp `build_moe_ffn`, `norm_w = true`).

use std::sync::Arc;

use memra_gguf::GgufFile;

use super::layers::{Decoder, Hyper};
use super::rope::RopeLayout;
use super::ModelError;

pub fn load(file: &Arc<GgufFile>, hp: &Hyper) -> Result<Decoder, ModelError> {
    let m = &file.metadata;
    let key = |k: &str| format!("qwen3moe.{k}");
    let n_expert = m.require(m.get_u32(&key("expert_count")), &key("expert_count"))? as usize;
    let n_used = m.require(
        m.get_u32(&key("expert_used_count")),
        &key("expert_used_count"),
    )? as usize;
    let n_ff = m.require(
        m.get_u32(&key("expert_feed_forward_length")),
        &key("expert_feed_forward_length"),
    )? as usize;
    if n_used == 0 || n_used > n_expert {
        return Err(ModelError::Invalid(format!(
            "{n_used} of {n_expert} experts used per token"
        )));
    }
    super::llama::load_with(
        file,
        hp,
        "qwen3moe",
        RopeLayout::Halves,
        true,
        Some((n_expert, n_used, n_ff, true)),
    )
}
