//! The decoder every supported architecture is an instance of: pre-norm attention and FFN
//! blocks with options (q/k/v biases, QK-norm, post-norms, sliding windows, mixture of
//! experts, GELU or SiLU gates). Architecture files only read their hyperparameters and
//! tensors into a [`Decoder`]; the forward pass is written once, here.

use memra_gguf::{Metadata, MetadataError};
use rayon::prelude::*;

use super::rope::Rope;
use super::weights::{Linear, TensorSource};
use super::ModelError;
use crate::backend::cpu::kv::KvPool;
use crate::backend::cpu::matmul::{matmul_with, ActFormat, QuantizedActs, WeightRows};
use crate::backend::cpu::ops::{self, AttentionShape, PagedQuery};
use crate::batch::ForwardBatch;
use crate::kv::{BlockId, DEFAULT_BLOCK_SIZE};

/// Where a batch's tokens write their keys and values, and where each reads its
/// sequence's.
struct KvLayout<'a> {
    block_size: usize,
    slots: &'a [u32],
    queries: &'a [PagedQuery<'a>],
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

/// Keys and values of one sequence's past positions: a paged pool whose blocks the
/// sequence holds in order, the one-sequence case of [`Decoder::forward_batch`].
pub struct KvCache {
    pool: KvPool,
    blocks: Vec<BlockId>,
    n_ctx: usize,
    len: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Forgets everything from position `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

/// Which positions of a forward pass need logits.
#[derive(Clone, Copy, Debug)]
pub enum LogitRows {
    Last,
    /// Every position from this index of the batch on.
    From(usize),
}

impl Decoder {
    /// A KV pool of `num_blocks` blocks of `block_size` positions, for every layer.
    pub fn new_pool(&self, num_blocks: usize, block_size: usize) -> KvPool {
        let hp = &self.hp;
        KvPool::new(
            hp.n_layer,
            hp.n_head_kv * hp.head_dim_k,
            hp.n_head_kv * hp.head_dim_v,
            num_blocks,
            block_size,
        )
    }

    /// Bytes of KV cache one position takes.
    pub fn kv_bytes_per_token(&self) -> usize {
        let hp = &self.hp;
        KvPool::bytes_per_token(
            hp.n_layer,
            hp.n_head_kv * hp.head_dim_k,
            hp.n_head_kv * hp.head_dim_v,
        )
    }

    pub fn new_cache(&self, n_ctx: usize) -> KvCache {
        let num_blocks = n_ctx.div_ceil(DEFAULT_BLOCK_SIZE).max(1);
        KvCache {
            pool: self.new_pool(num_blocks, DEFAULT_BLOCK_SIZE),
            blocks: (0..num_blocks as BlockId).collect(),
            n_ctx,
            len: 0,
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

    /// Runs `tokens` at the next positions of `cache`; returns logits (`rows x n_vocab`).
    pub fn forward(
        &self,
        cache: &mut KvCache,
        tokens: &[u32],
        rows: LogitRows,
    ) -> Result<Vec<f32>, ModelError> {
        let (t, p0) = (tokens.len(), cache.len);
        if p0 + t > cache.n_ctx {
            return Err(ModelError::ContextFull {
                needed: p0 + t,
                n_ctx: cache.n_ctx,
            });
        }
        if t == 0 {
            return Err(ModelError::Invalid("no tokens".into()));
        }
        let first = match rows {
            LogitRows::Last => t - 1,
            LogitRows::From(i) => i.min(t - 1),
        };
        let mut batch = ForwardBatch::new(cache.pool.block_size);
        batch.push(tokens, p0, &cache.blocks, first..t);
        let logits = self.forward_batch(&mut cache.pool, &batch)?;
        cache.len = p0 + t;
        Ok(logits)
    }

    /// One forward pass over `batch` (any number of sequences, each attending to its own
    /// blocks of `kv`): writes the new keys and values, returns the logits of
    /// `batch.logit_rows` (`rows x n_vocab`). Each token's result does not depend on the
    /// other tokens of the batch, so a sequence gets the same logits batched or alone.
    pub fn forward_batch(
        &self,
        kv: &mut KvPool,
        batch: &ForwardBatch,
    ) -> Result<Vec<f32>, ModelError> {
        let hp = &self.hp;
        batch
            .validate(hp.n_vocab, kv.num_blocks)
            .map_err(ModelError::Invalid)?;
        if batch.block_size != kv.block_size {
            return Err(ModelError::Invalid(format!(
                "a batch of {}-position blocks for a pool of {}",
                batch.block_size, kv.block_size
            )));
        }
        let (t, e) = (batch.n_tokens(), hp.n_embd);
        if t == 0 {
            return Ok(Vec::new());
        }
        let mut x = vec![0f32; t * e];
        x.par_chunks_mut(e)
            .zip(&batch.tokens)
            .for_each(|(row, &id)| row.copy_from_slice(&self.embed(id)));
        let mut queries = Vec::with_capacity(t);
        for s in 0..batch.n_seqs() {
            for i in batch.seq_tokens(s) {
                queries.push(PagedQuery {
                    pos: batch.positions[i] as usize,
                    blocks: batch.block_table(s),
                });
            }
        }
        let kv_at = KvLayout {
            block_size: kv.block_size,
            slots: &batch.slots,
            queries: &queries,
        };
        for (li, layer) in self.layers.iter().enumerate() {
            self.attention_block(layer, &mut x, &kv_at, &mut kv.k[li], &mut kv.v[li]);
            self.ffn_block(layer, &mut x);
        }
        let r = batch.logit_rows.len();
        if r == 0 {
            return Ok(Vec::new());
        }
        let mut h = Vec::with_capacity(r * e);
        for &row in &batch.logit_rows {
            h.extend_from_slice(&x[row as usize * e..(row as usize + 1) * e]);
        }
        ops::rms_norm(&mut h, &self.output_norm, hp.rms_eps);
        let mut logits = vec![0f32; r * hp.n_vocab];
        matmul_with(&self.output, &h, None, &mut logits, self.exact_activations);
        if let Some(cap) = self.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        Ok(logits)
    }

    fn attention_block(
        &self,
        l: &Layer,
        x: &mut [f32],
        at: &KvLayout,
        k_cache: &mut [f32],
        v_cache: &mut [f32],
    ) {
        let hp = &self.hp;
        let e = hp.n_embd;
        let t = at.queries.len();
        let mut h = x.to_vec();
        ops::rms_norm(&mut h, &l.attn_norm, hp.rms_eps);
        let mut acts = ActCache::new(self.exact_activations);
        let (dk, dv) = (hp.head_dim_k, hp.head_dim_v);
        let mut q = acts.project(&l.wq, &h, e);
        let mut k = acts.project(&l.wk, &h, e);
        let mut v = acts.project(&l.wv, &h, e);
        for (y, b) in [(&mut q, &l.bq), (&mut k, &l.bk), (&mut v, &l.bv)] {
            if let Some(b) = b {
                for row in y.chunks_exact_mut(b.len()) {
                    row.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                }
            }
        }
        if let Some(w) = &l.q_norm {
            ops::rms_norm(&mut q, w, hp.rms_eps);
        }
        if let Some(w) = &l.k_norm {
            ops::rms_norm(&mut k, w, hp.rms_eps);
        }
        let positions: Vec<usize> = at.queries.iter().map(|q| q.pos).collect();
        ops::rope(&l.rope, &mut q, dk, &positions);
        ops::rope(&l.rope, &mut k, dk, &positions);
        let (kr, vr) = (hp.n_head_kv * dk, hp.n_head_kv * dv);
        for (i, &slot) in at.slots.iter().enumerate() {
            let slot = slot as usize;
            k_cache[slot * kr..(slot + 1) * kr].copy_from_slice(&k[i * kr..(i + 1) * kr]);
            v_cache[slot * vr..(slot + 1) * vr].copy_from_slice(&v[i * vr..(i + 1) * vr]);
        }
        let shape = AttentionShape {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            head_dim_k: dk,
            head_dim_v: dv,
            scale: self.attn_scale,
            window: l.window,
        };
        let mut attn = vec![0f32; t * hp.n_head * dv];
        ops::attention_paged(
            &shape,
            &q,
            k_cache,
            v_cache,
            at.block_size,
            at.queries,
            &mut attn,
        );
        let mut o = vec![0f32; t * e];
        matmul_with(&l.wo, &attn, None, &mut o, self.exact_activations);
        if let Some(w) = &l.post_attn_norm {
            ops::rms_norm(&mut o, w, hp.rms_eps);
        }
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
    }

    fn ffn_block(&self, l: &Layer, x: &mut [f32]) {
        let hp = &self.hp;
        let e = hp.n_embd;
        let t = x.len() / e;
        let mut h = x.to_vec();
        ops::rms_norm(&mut h, &l.ffn_norm, hp.rms_eps);
        let mut f = match &l.ffn {
            Ffn::Dense { gate, up, down } => {
                let mut acts = ActCache::new(self.exact_activations);
                let g = acts.project(gate, &h, e);
                let u = acts.project(up, &h, e);
                let gated = self.gate(g, &u);
                let mut out = vec![0f32; t * e];
                matmul_with(down, &gated, None, &mut out, self.exact_activations);
                out
            }
            Ffn::Experts {
                router,
                gate,
                up,
                down,
                n_used,
                normalize,
            } => {
                let mut probs = vec![0f32; t * gate.len()];
                matmul_with(router, &h, None, &mut probs, self.exact_activations);
                // Route each token: softmax over experts, top-k, optional renormalization.
                let mut routes: Vec<Vec<(usize, f32)>> = vec![Vec::new(); gate.len()];
                for (tok, p) in probs.chunks_exact_mut(gate.len()).enumerate() {
                    ops::softmax(p);
                    let mut idx: Vec<usize> = (0..p.len()).collect();
                    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
                    let chosen = &idx[..*n_used];
                    let z: f32 = if *normalize {
                        chosen.iter().map(|&i| p[i]).sum()
                    } else {
                        1.0
                    };
                    for &i in chosen {
                        routes[i].push((tok, p[i] / z));
                    }
                }
                let mut out = vec![0f32; t * e];
                for (ex, toks) in routes.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
                    let xin: Vec<f32> = toks
                        .iter()
                        .flat_map(|&(tok, _)| h[tok * e..(tok + 1) * e].iter().copied())
                        .collect();
                    let mut acts = ActCache::new(self.exact_activations);
                    let g = acts.project(&gate[ex], &xin, e);
                    let u = acts.project(&up[ex], &xin, e);
                    let gated = self.gate(g, &u);
                    let mut y = vec![0f32; toks.len() * e];
                    matmul_with(&down[ex], &gated, None, &mut y, self.exact_activations);
                    for (row, &(tok, w)) in y.chunks_exact(e).zip(toks) {
                        out[tok * e..(tok + 1) * e]
                            .iter_mut()
                            .zip(row)
                            .for_each(|(o, v)| *o += w * v);
                    }
                }
                out
            }
        };
        if let Some(w) = &l.post_ffn_norm {
            ops::rms_norm(&mut f, w, hp.rms_eps);
        }
        x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
    }

    /// `act(gate) * up`, element-wise.
    fn gate(&self, mut g: Vec<f32>, u: &[f32]) -> Vec<f32> {
        let act = match self.activation {
            Activation::Silu => ops::silu,
            Activation::GeluTanh => ops::gelu_tanh,
        };
        g.par_iter_mut().zip(u).for_each(|(a, &b)| *a = act(*a) * b);
        g
    }
}

/// Activations quantized once per format and shared by the projections reading them.
struct ActCache {
    block32: Option<QuantizedActs>,
    block256: Option<QuantizedActs>,
    exact: bool,
}

impl ActCache {
    fn new(exact: bool) -> ActCache {
        ActCache {
            block32: None,
            block256: None,
            exact,
        }
    }

    fn project(&mut self, w: &Linear, x: &[f32], k: usize) -> Vec<f32> {
        let t = x.len() / k;
        let mut out = vec![0f32; t * w.n_out()];
        if self.exact {
            matmul_with(w, x, None, &mut out, true);
            return out;
        }
        let acts = match ActFormat::for_weight(w.ty()) {
            ActFormat::F32 => None,
            ActFormat::Block32 => Some(
                &*self
                    .block32
                    .get_or_insert_with(|| QuantizedActs::new(x, k, ActFormat::Block32)),
            ),
            ActFormat::Block256 => Some(
                &*self
                    .block256
                    .get_or_insert_with(|| QuantizedActs::new(x, k, ActFormat::Block256)),
            ),
        };
        matmul_with(w, x, acts, &mut out, false);
        out
    }
}
