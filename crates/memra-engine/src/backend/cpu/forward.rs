//! The CPU's operations of the forward pass ([`LayerOps`]), and the decoder's CPU entry
//! points: a KV pool, one forward over a [`ForwardBatch`], and the one-sequence
//! [`KvCache`] case of it.

use rayon::prelude::*;

use super::kv::{KvCache, KvPool};
use super::matmul::{matmul_with, ActFormat, QuantizedActs};
use super::ops::{self, PagedQuery};
use crate::batch::ForwardBatch;
use crate::kv::{BlockId, DEFAULT_BLOCK_SIZE};
use crate::models::forward::{forward, LayerOps};
use crate::models::layers::{Activation, Decoder, Ffn, LogitRows};
use crate::models::weights::{Linear, WeightRows};
use crate::models::ModelError;
use crate::parallel::plan::vocab_share;
use crate::parallel::HostCollective;

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
    /// `batch.logit_rows` (`rows x n_vocab`) followed by the hidden states of
    /// `batch.hidden_rows` after the output norm (`rows x n_embd`). Each token's result does not depend on the
    /// other tokens of the batch, so a sequence gets the same logits batched or alone.
    pub fn forward_batch(
        &self,
        kv: &mut KvPool,
        batch: &ForwardBatch,
    ) -> Result<Vec<f32>, ModelError> {
        self.forward_batch_rank(kv, batch, None)
    }

    /// [`Decoder::forward_batch`] on one rank of a tensor-parallel group, this decoder
    /// being the rank's share (`parallel::plan::shard`) and `kv` its KV heads' pool: the
    /// attention and FFN outputs are all-reduced over `comm`, the logits gathered (every
    /// rank returns all of them). `None`: the whole model on its own.
    pub fn forward_batch_rank(
        &self,
        kv: &mut KvPool,
        batch: &ForwardBatch,
        comm: Option<&HostCollective>,
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
        if batch.n_tokens() == 0 {
            return Ok(Vec::new());
        }
        let mut queries = Vec::with_capacity(batch.n_tokens());
        for s in 0..batch.n_seqs() {
            for i in batch.seq_tokens(s) {
                queries.push(PagedQuery {
                    pos: batch.positions[i] as usize,
                    blocks: batch.block_table(s),
                });
            }
        }
        let mut pass = CpuPass {
            d: self,
            batch,
            kv,
            queries,
            comm,
            x: Vec::new(),
            logits: Vec::new(),
        };
        forward(hp, &mut pass)?;
        Ok(pass.logits)
    }
}

/// One forward pass on the CPU: the residual stream `x` (`tokens x n_embd`, f32).
struct CpuPass<'a> {
    d: &'a Decoder,
    batch: &'a ForwardBatch,
    kv: &'a mut KvPool,
    /// Each token's position and its sequence's blocks.
    queries: Vec<PagedQuery<'a>>,
    /// The tensor-parallel group this pass is one rank of.
    comm: Option<&'a HostCollective>,
    x: Vec<f32>,
    logits: Vec<f32>,
}

impl LayerOps for CpuPass<'_> {
    type Error = ModelError;

    fn embed(&mut self) -> Result<(), ModelError> {
        let e = self.d.hp.n_embd;
        self.x = vec![0f32; self.batch.n_tokens() * e];
        self.x
            .par_chunks_mut(e)
            .zip(&self.batch.tokens)
            .for_each(|(row, &id)| row.copy_from_slice(&self.d.embed(id)));
        Ok(())
    }

    fn attention(&mut self, li: usize) -> Result<(), ModelError> {
        let (d, l) = (self.d, &self.d.layers[li]);
        let hp = &d.hp;
        let e = hp.n_embd;
        let mut h = self.x.clone();
        ops::rms_norm(&mut h, &l.attn_norm, hp.rms_eps);
        let mut acts = ActCache::new(d.exact_activations);
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
        let positions: Vec<usize> = self.queries.iter().map(|q| q.pos).collect();
        ops::rope(&l.rope, &mut q, dk, &positions);
        ops::rope(&l.rope, &mut k, dk, &positions);
        let (k_cache, v_cache) = (&mut self.kv.k[li], &mut self.kv.v[li]);
        let (kr, vr) = (hp.n_head_kv * dk, hp.n_head_kv * dv);
        for (i, &slot) in self.batch.slots.iter().enumerate() {
            let slot = slot as usize;
            k_cache[slot * kr..(slot + 1) * kr].copy_from_slice(&k[i * kr..(i + 1) * kr]);
            v_cache[slot * vr..(slot + 1) * vr].copy_from_slice(&v[i * vr..(i + 1) * vr]);
        }
        let mut attn = vec![0f32; self.queries.len() * hp.n_head * dv];
        ops::attention_paged(
            &d.attention_shape(l),
            &q,
            k_cache,
            v_cache,
            self.kv.block_size,
            &self.queries,
            &mut attn,
        );
        let mut o = vec![0f32; self.queries.len() * e];
        matmul_with(&l.wo, &attn, None, &mut o, d.exact_activations);
        // A rank's heads give a partial sum of the output projection; the post-norm (Gemma)
        // needs the whole sum.
        if let Some(c) = self.comm {
            c.all_reduce_sum(&mut o)?;
        }
        if let Some(w) = &l.post_attn_norm {
            ops::rms_norm(&mut o, w, hp.rms_eps);
        }
        self.x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn ffn(&mut self, li: usize) -> Result<(), ModelError> {
        let (d, l) = (self.d, &self.d.layers[li]);
        let hp = &d.hp;
        let e = hp.n_embd;
        let t = self.x.len() / e;
        let mut h = self.x.clone();
        ops::rms_norm(&mut h, &l.ffn_norm, hp.rms_eps);
        let mut f = match &l.ffn {
            Ffn::Dense { gate, up, down } => {
                let mut acts = ActCache::new(d.exact_activations);
                let g = acts.project(gate, &h, e);
                let u = acts.project(up, &h, e);
                let gated = gated(d.activation, g, &u);
                let mut out = vec![0f32; t * e];
                matmul_with(down, &gated, None, &mut out, d.exact_activations);
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
                matmul_with(router, &h, None, &mut probs, d.exact_activations);
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
                    let mut acts = ActCache::new(d.exact_activations);
                    let g = acts.project(&gate[ex], &xin, e);
                    let u = acts.project(&up[ex], &xin, e);
                    let gated = gated(d.activation, g, &u);
                    let mut y = vec![0f32; toks.len() * e];
                    matmul_with(&down[ex], &gated, None, &mut y, d.exact_activations);
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
        // A rank's FFN columns (of every expert: the routing weights are linear) give a
        // partial sum of the down projection.
        if let Some(c) = self.comm {
            c.all_reduce_sum(&mut f)?;
        }
        if let Some(w) = &l.post_ffn_norm {
            ops::rms_norm(&mut f, w, hp.rms_eps);
        }
        self.x.iter_mut().zip(&f).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn head(&mut self) -> Result<(), ModelError> {
        let d = self.d;
        let e = d.hp.n_embd;
        let (rows, hidden) = (&self.batch.logit_rows, &self.batch.hidden_rows);
        if rows.is_empty() && hidden.is_empty() {
            return Ok(());
        }
        // The logit rows' and the hidden rows' residual streams, normed together; every
        // rank of a tensor-parallel group holds the whole stream.
        let mut h = Vec::with_capacity((rows.len() + hidden.len()) * e);
        for &row in rows.iter().chain(hidden) {
            h.extend_from_slice(&self.x[row as usize * e..(row as usize + 1) * e]);
        }
        ops::rms_norm(&mut h, &d.output_norm, d.hp.rms_eps);
        let states = h.split_off(rows.len() * e);
        if !rows.is_empty() {
            let mut logits = vec![0f32; rows.len() * d.output.n_out()];
            matmul_with(&d.output, &h, None, &mut logits, d.exact_activations);
            self.logits = match self.comm {
                None => logits,
                Some(c) => gather_vocab(c, &logits, rows.len(), d.hp.n_vocab)?,
            };
            if let Some(cap) = d.final_logit_softcap {
                self.logits
                    .iter_mut()
                    .for_each(|v| *v = cap * (*v / cap).tanh());
            }
        }
        self.logits.extend_from_slice(&states);
        Ok(())
    }
}

/// Every rank's logits of its vocabulary rows (`rows x local`) into whole rows
/// (`rows x n_vocab`): each rank sends its rows padded to the equal share all-gather needs.
fn gather_vocab(
    c: &HostCollective,
    local: &[f32],
    rows: usize,
    n_vocab: usize,
) -> Result<Vec<f32>, ModelError> {
    let world = c.world_size();
    let share = vocab_share(n_vocab, world);
    let nl = local.len() / rows.max(1);
    let mut part = vec![0f32; rows * share];
    for (dst, src) in part
        .chunks_exact_mut(share)
        .zip(local.chunks_exact(nl.max(1)))
    {
        dst[..nl].copy_from_slice(src);
    }
    let mut all = vec![0f32; rows * share * world];
    c.all_gather(&part, &mut all)?;
    // `all` is rank-major (`world x rows x share`); the logits are row-major.
    let mut logits = Vec::with_capacity(rows * n_vocab);
    for row in 0..rows {
        for rank in 0..world {
            let n = share.min(n_vocab.saturating_sub(rank * share));
            let at = (rank * rows + row) * share;
            logits.extend_from_slice(&all[at..at + n]);
        }
    }
    Ok(logits)
}

/// `act(gate) * up`, element-wise.
fn gated(activation: Activation, mut g: Vec<f32>, u: &[f32]) -> Vec<f32> {
    let act = match activation {
        Activation::Silu => ops::silu,
        Activation::GeluTanh => ops::gelu_tanh,
    };
    g.par_iter_mut().zip(u).for_each(|(a, &b)| *a = act(*a) * b);
    g
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
