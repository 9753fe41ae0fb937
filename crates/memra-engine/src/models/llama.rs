//! Llama 2/3 and Mistral (`llama`): GQA, rotary embedding on adjacent pairs, optional
//! `rope_freqs` (Llama 3.1 scaling) and linear rope scaling, tied or separate output.

use std::sync::Arc;

use memra_gguf::GgufFile;

use super::layers::{Activation, Decoder, Hyper, Layer, LayerOptions};
use super::rope::{Rope, RopeLayout};
use super::weights::TensorSource;
use super::{embeddings, ModelError};

pub fn load(file: &Arc<GgufFile>, hp: &Hyper) -> Result<Decoder, ModelError> {
    load_with(file, hp, "llama", RopeLayout::Interleaved, false, None)
}

/// The llama-shaped decoders: `llama` itself, `qwen2` (biases, NeoX rope), `qwen3`
/// (QK-norm) and `qwen3moe` (QK-norm and experts) differ only in these options.
pub(super) fn load_with(
    file: &Arc<GgufFile>,
    hp: &Hyper,
    arch: &str,
    layout: RopeLayout,
    qk_norm: bool,
    experts: Option<(usize, usize, usize, bool)>,
) -> Result<Decoder, ModelError> {
    let m = &file.metadata;
    let src = TensorSource { file };
    let rope_dims = m
        .get_u32(&format!("{arch}.rope.dimension_count"))?
        .map_or(hp.head_dim_k, |d| d as usize);
    let base = m
        .get_f32(&format!("{arch}.rope.freq_base"))?
        .unwrap_or(10_000.0);
    let freq_scale = rope_freq_scale(m, arch)?;
    let freq_factors = src.optional_vector("rope_freqs.weight", (rope_dims / 2) as u64)?;
    let options = LayerOptions {
        qkv_bias: arch == "qwen2",
        qk_norm,
        post_norms: false,
        experts,
    };
    let layers = (0..hp.n_layer)
        .map(|i| {
            let rope = Rope {
                layout,
                n_dims: rope_dims,
                base,
                freq_scale,
                freq_factors: freq_factors.clone(),
            };
            Layer::load(&src, hp, i, &options, rope, None)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let (token_embd, output_norm, output) = embeddings(&src, hp)?;
    Ok(Decoder {
        hp: hp.clone(),
        token_embd,
        embd_scale: None,
        layers,
        output_norm,
        output,
        activation: Activation::Silu,
        attn_scale: 1.0 / (hp.head_dim_k as f32).sqrt(),
        final_logit_softcap: None,
        exact_activations: super::exact_activations_from_env(),
    })
}

/// Linear rope scaling (`{arch}.rope.scaling.type = linear`): positions times 1/factor.
pub(super) fn rope_freq_scale(m: &memra_gguf::Metadata, arch: &str) -> Result<f32, ModelError> {
    let kind = m.get_str(&format!("{arch}.rope.scaling.type"))?;
    let factor = m.get_f32(&format!("{arch}.rope.scaling.factor"))?;
    match (kind, factor) {
        (Some("linear"), Some(f)) | (None, Some(f)) if f > 0.0 => Ok(1.0 / f),
        (Some("none") | None, _) => Ok(1.0),
        (Some(other), _) => Err(ModelError::Invalid(format!(
            "rope scaling type {other:?} is not supported"
        ))),
    }
}
