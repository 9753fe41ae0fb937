//! Rotary position embedding parameters of a layer, as the file describes them; each
//! backend applies them (`backend::cpu::ops::rope`, `cu/rope.cu`).

/// How rotary embedding pairs up dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs (2i, 2i+1): Llama (ggml `LLAMA_ROPE_TYPE_NORM`).
    Interleaved,
    /// Halves (i, i + d/2): GPT-NeoX, Qwen, Gemma (ggml `LLAMA_ROPE_TYPE_NEOX`).
    Halves,
}

/// Rotary position embedding parameters of one layer.
#[derive(Clone, Debug)]
pub struct Rope {
    pub layout: RopeLayout,
    /// Rotated dimensions per head (the rest pass through).
    pub n_dims: usize,
    pub base: f32,
    /// Position multiplier (linear scaling: 1 / factor).
    pub freq_scale: f32,
    /// Per-frequency divisors (`rope_freqs.weight`, Llama 3.1 style scaling).
    pub freq_factors: Option<Vec<f32>>,
}
