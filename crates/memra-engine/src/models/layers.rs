//! The decoder every supported architecture is an instance of: pre-norm attention and FFN
//! blocks with options (q/k/v biases, QK-norm, post-norms, sliding windows, mixture of
//! experts, GELU or SiLU gates). Architecture files only read their hyperparameters and
//! tensors into a [`Decoder`]; the forward pass is written once, over the backends'
//! operations, in `forward.rs`.

use memra_gguf::{Metadata, MetadataError};

use super::rope::Rope;
use super::weights::{Linear, TensorSource};
use super::ModelError;

/// The shape of a layer's attention, as every backend's kernels take it.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub scale: f32,
    /// Keys a query may see, counting itself (sliding-window layers).
    pub window: Option<usize>,
}

/// Hyperparameters common to the decoders, from `{arch}.*` keys.
#[derive(Clone, Debug)]
pub struct Hyper {
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim_k: usize,
    pub head_dim_v: usize,
    pub n_ff: usize,
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub rms_eps: f32,
}

impl Hyper {
    pub fn read(m: &Metadata, arch: &str, n_vocab: usize) -> Result<Hyper, ModelError> {
        let req = |k: &str| -> Result<usize, MetadataError> {
            let key = format!("{arch}.{k}");
            m.require(m.get_u32(&key), &key).map(|v| v as usize)
        };
        let opt = |k: &str| {
            m.get_u32(&format!("{arch}.{k}"))
                .map(|v| v.map(|v| v as usize))
        };
        let n_embd = req("embedding_length")?;
        let n_head = req("attention.head_count")?;
        if n_head == 0 || n_embd == 0 {
            return Err(ModelError::Invalid("zero heads or width".into()));
        }
        let n_head_kv = opt("attention.head_count_kv")?.unwrap_or(n_head);
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::Invalid(format!(
                "{n_head} heads cannot be grouped over {n_head_kv} kv heads"
            )));
        }
        let head_dim_k = opt("attention.key_length")?.unwrap_or(n_embd / n_head);
        let eps_key = format!("{arch}.attention.layer_norm_rms_epsilon");
        Ok(Hyper {
            n_embd,
            n_layer: req("block_count")?,
            n_head,
            n_head_kv,
            head_dim_k,
            head_dim_v: opt("attention.value_length")?.unwrap_or(head_dim_k),
            n_ff: opt("feed_forward_length")?.unwrap_or(0),
            n_vocab,
            n_ctx_train: opt("context_length")?.unwrap_or(4096),
            rms_eps: m.require(m.get_f32(&eps_key), &eps_key)?,
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    Silu,
    GeluTanh,
}

pub enum Ffn {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Top-k softmax routing (probabilities renormalized over the chosen experts when
    /// `normalize`), each expert a gated FFN.
    Experts {
        router: Linear,
        gate: Vec<Linear>,
        up: Vec<Linear>,
        down: Vec<Linear>,
        n_used: usize,
        normalize: bool,
    },
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Linear,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub ffn: Ffn,
    pub post_ffn_norm: Option<Vec<f32>>,
    pub rope: Rope,
    pub window: Option<usize>,
}

/// Per-layer options an architecture chooses.
pub struct LayerOptions {
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub post_norms: bool,
    /// `(n_expert, n_used, n_ff_expert, normalize)` for mixture-of-experts FFNs.
    pub experts: Option<(usize, usize, usize, bool)>,
}

impl Layer {
    /// Loads layer `i`'s tensors by their GGUF names.
    pub fn load(
        src: &TensorSource,
        hp: &Hyper,
        i: usize,
        o: &LayerOptions,
        rope: Rope,
        window: Option<usize>,
    ) -> Result<Layer, ModelError> {
        let n = |t: &str| format!("blk.{i}.{t}");
        let (e, q_out, kv_out) = (
            hp.n_embd as u64,
            (hp.n_head * hp.head_dim_k) as u64,
            (hp.n_head_kv * hp.head_dim_k) as u64,
        );
        let v_out = (hp.n_head_kv * hp.head_dim_v) as u64;
        let o_in = (hp.n_head * hp.head_dim_v) as u64;
        let bias = |t: &str, len| -> Result<Option<Vec<f32>>, ModelError> {
            if o.qkv_bias {
                src.vector(&n(t), len).map(Some)
            } else {
                src.optional_vector(&n(t), len)
            }
        };
        let hd = hp.head_dim_k as u64;
        let ffn = match o.experts {
            None => Ffn::Dense {
                gate: src.linear(&n("ffn_gate.weight"), e, hp.n_ff as u64)?,
                up: src.linear(&n("ffn_up.weight"), e, hp.n_ff as u64)?,
                down: src.linear(&n("ffn_down.weight"), hp.n_ff as u64, e)?,
            },
            Some((n_exp, n_used, n_ff, normalize)) => {
                let (ne, nf) = (n_exp as u64, n_ff as u64);
                Ffn::Experts {
                    router: src.linear(&n("ffn_gate_inp.weight"), e, ne)?,
                    gate: src.experts(&n("ffn_gate_exps.weight"), e, nf, ne)?,
                    up: src.experts(&n("ffn_up_exps.weight"), e, nf, ne)?,
                    down: src.experts(&n("ffn_down_exps.weight"), nf, e, ne)?,
                    n_used,
                    normalize,
                }
            }
        };
        let post = |t: &str| -> Result<Option<Vec<f32>>, ModelError> {
            if o.post_norms {
                src.vector(&n(t), e).map(Some)
            } else {
                Ok(None)
            }
        };
        let qk = |t: &str| -> Result<Option<Vec<f32>>, ModelError> {
            if o.qk_norm {
                src.vector(&n(t), hd).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(Layer {
            attn_norm: src.vector(&n("attn_norm.weight"), e)?,
            wq: src.linear(&n("attn_q.weight"), e, q_out)?,
            wk: src.linear(&n("attn_k.weight"), e, kv_out)?,
            wv: src.linear(&n("attn_v.weight"), e, v_out)?,
            bq: bias("attn_q.bias", q_out)?,
            bk: bias("attn_k.bias", kv_out)?,
            bv: bias("attn_v.bias", v_out)?,
            q_norm: qk("attn_q_norm.weight")?,
            k_norm: qk("attn_k_norm.weight")?,
            wo: src.linear(&n("attn_output.weight"), o_in, e)?,
            post_attn_norm: post("post_attention_norm.weight")?,
            ffn_norm: src.vector(&n("ffn_norm.weight"), e)?,
            ffn,
            post_ffn_norm: post("post_ffw_norm.weight")?,
            rope,
            window,
        })
    }
}

/// A decoder-only transformer, ready to run.
pub struct Decoder {
    pub hp: Hyper,
    pub token_embd: Linear,
    /// Multiplier of the embedding rows (Gemma: sqrt(n_embd)).
    pub embd_scale: Option<f32>,
    pub layers: Vec<Layer>,
    pub output_norm: Vec<f32>,
    /// The output projection (the embedding matrix when tied).
    pub output: Linear,
    pub activation: Activation,
    pub attn_scale: f32,
    pub final_logit_softcap: Option<f32>,
    /// Multiply with unrounded f32 activations instead of llama.cpp's Q8 rounding: the
    /// precise reference the GPU tests compare with (slow; `MEMRA_CPU_F32_ACTIVATIONS=1`
    /// turns it on at load).
    pub exact_activations: bool,
}

/// Which positions of a forward pass need logits.
#[derive(Clone, Copy, Debug)]
pub enum LogitRows {
    Last,
    /// Every position from this index of the batch on.
    From(usize),
}

impl Decoder {
    /// Layer `l`'s attention shape.
    pub fn attention_shape(&self, l: &Layer) -> AttentionShape {
        let hp = &self.hp;
        AttentionShape {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim_k: hp.head_dim_k,
            head_dim_v: hp.head_dim_v,
            scale: self.attn_scale,
            window: l.window,
        }
    }

    /// The input row of a token: its embedding, scaled when the architecture asks.
    pub fn embed(&self, id: u32) -> Vec<f32> {
        let mut row = self.token_embd.row_f32(id as usize);
        if let Some(s) = self.embd_scale {
            row.iter_mut().for_each(|v| *v *= s);
        }
        row
    }
}
