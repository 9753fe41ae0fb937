//! Gemma 3 (`gemma3`): embeddings scaled by sqrt(n_embd), QK-norm, norms after attention
//! and after the FFN, a GELU (tanh) gated FFN, the output tied to the embedding, and
//! sliding-window attention on five of every six layers (window
//! `gemma3.attention.sliding_window`, rope base 10,000) with the sixth global (rope base
//! `gemma3.rope.freq_base`, linear rope scaling when the file says so). llama.cpp
//! `llm_build_gemma3_iswa`.

use std::sync::Arc;

use memra_gguf::GgufFile;

use super::layers::{Activation, Decoder, Hyper, Layer, LayerOptions};
use super::rope::{Rope, RopeLayout};
use super::weights::TensorSource;
use super::{embeddings, ModelError};

/// Every sixth layer attends globally; the others through the sliding window.
const SWA_PATTERN: usize = 6;
/// Rope base of the sliding-window layers (fixed by the architecture, not in the file).
const SWA_ROPE_BASE: f32 = 10_000.0;

pub fn load(file: &Arc<GgufFile>, hp: &Hyper) -> Result<Decoder, ModelError> {
    let m = &file.metadata;
    let src = TensorSource { file };
    let window = m
        .get_u32("gemma3.attention.sliding_window")?
        .map(|w| w as usize);
    let base = m.get_f32("gemma3.rope.freq_base")?.unwrap_or(1_000_000.0);
    let freq_scale = super::llama::rope_freq_scale(m, "gemma3")?;
    let options = LayerOptions {
        qkv_bias: false,
        qk_norm: true,
        post_norms: true,
        experts: None,
    };
    let layers = (0..hp.n_layer)
        .map(|i| {
            let sliding = window.is_some() && i % SWA_PATTERN < SWA_PATTERN - 1;
            let rope = Rope {
                layout: RopeLayout::Halves,
                n_dims: hp.head_dim_k,
                base: if sliding { SWA_ROPE_BASE } else { base },
                freq_scale: if sliding { 1.0 } else { freq_scale },
                freq_factors: None,
            };
            Layer::load(
                &src,
                hp,
                i,
                &options,
                rope,
                if sliding { window } else { None },
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (token_embd, output_norm, output) = embeddings(&src, hp)?;
    Ok(Decoder {
        hp: hp.clone(),
        token_embd,
        embd_scale: Some((hp.n_embd as f32).sqrt()),
        layers,
        output_norm,
        output,
        activation: Activation::GeluTanh,
        // Gemma 3 scales queries by 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim;
        // llama.cpp uses n_embd/n_head only for the 27B model).
        attn_scale: 1.0 / (hp.head_dim_k as f32).sqrt(),
        final_logit_softcap: m.get_f32("gemma3.final_logit_softcapping")?,
        exact_activations: super::exact_activations_from_env(),
    })
}
