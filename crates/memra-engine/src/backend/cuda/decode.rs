//! The GPU's operations of a decode step ([`LayerOps`]): up to [`MAX_DECODE_ROWS`]
//! sequences of one token each, with int8 activations through the `mmvq` mat-vec kernels
//! and split-K paged attention. Every launch reads the step's batch arrays from
//! `StepMeta` on the device, so the one-sequence step can be captured once as a CUDA
//! graph and replayed (`graph.rs`). The residual add is fused into the next block's norm
//! and quantization, the residual stream taking turns between two buffers.
//!
//! [`MAX_DECODE_ROWS`]: super::buffers::MAX_DECODE_ROWS

use cudarc::driver::CudaSlice;
use half::f16;

use super::buffers::{MoeBuffers, StepBuffers};
use super::matvec::{
    mmvq, mmvq_moe, mmvq_qkv_pair, mmvq_set, moe_down, moe_fused_supported, moe_gate_up,
    moe_router_route, DeviceActs,
};
use super::ops;
use super::sampling::{argmax, argmax_rows};
use super::weights::{GpuExperts, GpuFfn, GpuLayer, GpuLinear, GpuWeights};
use super::{CudaDevice, CudaError};
use crate::models::forward::LayerOps;
use crate::models::layers::Hyper;

/// One decode step's launches over the step buffers.
pub(super) struct DecodePass<'a> {
    pub dev: &'a CudaDevice,
    pub hp: &'a Hyper,
    pub w: &'a GpuWeights,
    pub k_cache: &'a mut [CudaSlice<f16>],
    pub v_cache: &'a mut [CudaSlice<f16>],
    pub s: &'a mut StepBuffers,
    pub rows: usize,
    pub n_split: usize,
    /// Positions in the pool (blocks x block size).
    pub pool_slots: usize,
    pub block_size: usize,
    pub embd_scale: f32,
    pub gelu: bool,
    /// Which of `s.x` holds the residual stream.
    pub cur: usize,
    /// `s.o` holds a block's output not yet added to the residual stream.
    pub pending: bool,
}

impl DecodePass<'_> {
    /// `x + o` (the pending output) into the other residual buffer, normed by `norm` and
    /// quantized into `s.acts` for the next products.
    fn add_norm(&mut self, norm: &CudaSlice<f32>) -> Result<(), CudaError> {
        let s = &mut *self.s;
        let [a, b] = &mut s.x;
        let (x, x_next) = if self.cur == 0 { (&*a, b) } else { (&*b, a) };
        let o = self.pending.then_some(&s.o);
        s.acts
            .add_norm_quantize(self.dev, x, o, x_next, norm, self.rows, self.hp.rms_eps)?;
        self.cur ^= 1;
        Ok(())
    }
}

impl LayerOps for DecodePass<'_> {
    type Error = CudaError;

    fn embed(&mut self) -> Result<(), CudaError> {
        let (s, te) = (&mut *self.s, &self.w.token_embd);
        let x = &mut s.x[self.cur];
        let ids = s.meta.ids();
        ops::embed_rows(
            self.dev,
            &te.w,
            te.ty,
            &ids,
            x,
            self.hp.n_embd,
            self.rows,
            self.embd_scale,
        )
    }

    fn attention(&mut self, li: usize) -> Result<(), CudaError> {
        let (dev, rows, l) = (self.dev, self.rows, &self.w.layers[li]);
        self.add_norm(&l.attn_norm)?;
        let s = &mut *self.s;
        let e = self.hp.n_embd;
        // Biases are added by the products themselves.
        qkv_products(
            dev,
            &s.acts,
            e,
            rows,
            [
                (&l.wq, &mut s.q, l.bq.as_ref()),
                (&l.wk, &mut s.k, l.bk.as_ref()),
                (&l.wv, &mut s.v, l.bv.as_ref()),
            ],
        )?;
        let (pos, slots) = (s.meta.pos(), s.meta.slots());
        ops::rope_qk_append(
            dev,
            &mut s.q,
            ops::QkvRows::Apart { k: &s.k, v: &s.v },
            &mut self.k_cache[li],
            &mut self.v_cache[li],
            &l.attn,
            &l.rope,
            qk_norms(l, self.hp.rms_eps),
            &pos,
            &slots,
            rows,
            self.pool_slots,
        )?;
        let kv = s.meta.paged(rows, self.block_size, self.pool_slots);
        ops::attention_decode(
            dev,
            &l.attn,
            &s.q,
            &self.k_cache[li],
            &self.v_cache[li],
            &mut s.part_o,
            &mut s.part_ml,
            &kv,
            self.n_split,
        )?;
        ops::attention_combine(
            dev,
            &l.attn,
            &s.part_o,
            &s.part_ml,
            &mut s.acts,
            self.n_split,
            rows,
        )?;
        let wo = &l.wo;
        mmvq(
            dev, wo.ty, &wo.w, &s.acts, &mut s.o, wo.n_in, wo.n_out, rows,
        )?;
        if let Some(w) = &l.post_attn_norm {
            ops::rms_norm_inplace(dev, &mut s.o, w, rows, self.hp.rms_eps)?;
        }
        self.pending = true;
        Ok(())
    }

    fn ffn(&mut self, li: usize) -> Result<(), CudaError> {
        let (dev, rows, l) = (self.dev, self.rows, &self.w.layers[li]);
        self.add_norm(&l.ffn_norm)?;
        let s = &mut *self.s;
        match &l.ffn {
            GpuFfn::Dense { gate, up, down } => {
                let e = self.hp.n_embd;
                matvecs(
                    dev,
                    &s.acts,
                    e,
                    rows,
                    [(gate, &mut s.g, None), (up, &mut s.u, None)],
                )?;
                s.acts
                    .gated_quantize(dev, &s.g, &s.u, rows * gate.n_out, self.gelu)?;
                mmvq(
                    dev, down.ty, &down.w, &s.acts, &mut s.o, down.n_in, down.n_out, rows,
                )?;
            }
            GpuFfn::Experts(xp) => {
                let (r, m) = (&xp.router, &mut s.moe);
                // One token's router routes in its own launch where it can.
                let routed = rows == 1
                    && moe_router_route(
                        dev,
                        &r.w,
                        r.ty,
                        (r.n_in, r.n_out),
                        &s.acts,
                        &mut m.router,
                        &mut m.route_counter,
                        (&mut m.ids, &mut m.weights),
                        xp.n_used,
                        xp.normalize,
                    )?;
                if !routed {
                    mmvq(
                        dev,
                        r.ty,
                        &r.w,
                        &s.acts,
                        &mut m.router,
                        r.n_in,
                        r.n_out,
                        rows,
                    )?;
                }
                moe_ffn(
                    dev,
                    xp,
                    &mut s.acts,
                    &mut s.g,
                    &mut s.u,
                    &mut s.moe,
                    &mut s.o,
                    rows,
                    self.gelu,
                    routed,
                )?;
            }
        }
        if let Some(w) = &l.post_ffn_norm {
            ops::rms_norm_inplace(dev, &mut s.o, w, rows, self.hp.rms_eps)?;
        }
        self.pending = true;
        Ok(())
    }

    /// The logits of every row into `s.logits` and each row's argmax into `s.best` (so
    /// that a replayed graph returns one id, and a step of many rows only ids).
    fn head(&mut self) -> Result<(), CudaError> {
        let (dev, rows) = (self.dev, self.rows);
        let s = &mut *self.s;
        let [a, b] = &mut s.x;
        let (x, x_next) = if self.cur == 0 { (&*a, b) } else { (&*b, a) };
        let o = self.pending.then_some(&s.o);
        let (norm, out) = (&self.w.output_norm, &self.w.output);
        output_logits(
            dev,
            norm,
            out,
            x,
            o,
            x_next,
            &mut s.acts,
            &mut s.logits,
            rows,
            self.hp.rms_eps,
        )?;
        if rows == 1 {
            argmax(
                dev,
                &s.logits,
                self.hp.n_vocab,
                &mut s.best_parts,
                &mut s.best,
            )?;
        } else {
            argmax_rows(dev, &s.logits, rows, self.hp.n_vocab, &mut s.best)?;
        }
        Ok(())
    }
}

/// The biases of `n` tokens' q, k, v, where the architecture has them.
pub(super) fn qkv_biases(
    dev: &CudaDevice,
    l: &GpuLayer,
    q: &mut CudaSlice<f32>,
    k: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    for (b, y) in [(&l.bq, &mut *q), (&l.bk, &mut *k), (&l.bv, &mut *v)] {
        if let Some(b) = b {
            ops::add_bias(dev, y, b, n * b.len())?;
        }
    }
    Ok(())
}

/// A layer's QK-norms, for rope_qk_append.
pub(super) fn qk_norms(l: &GpuLayer, eps: f32) -> ops::QkNorms<'_> {
    ops::QkNorms {
        q: l.q_norm.as_ref(),
        k: l.k_norm.as_ref(),
        eps,
    }
}

/// The output head of `rows` tokens: `x + o` (o when given) into `x_out`, the final norm,
/// and the logits by the decode matvec.
#[allow(clippy::too_many_arguments)]
pub(super) fn output_logits(
    dev: &CudaDevice,
    norm: &CudaSlice<f32>,
    out: &GpuLinear,
    x: &CudaSlice<f32>,
    o: Option<&CudaSlice<f32>>,
    x_out: &mut CudaSlice<f32>,
    acts: &mut DeviceActs,
    logits: &mut CudaSlice<f32>,
    rows: usize,
    eps: f32,
) -> Result<(), CudaError> {
    acts.add_norm_quantize(dev, x, o, x_out, norm, rows, eps)?;
    mmvq(dev, out.ty, &out.w, acts, logits, out.n_in, out.n_out, rows)
}

/// A mixture-of-experts FFN for `n` tokens whose router logits are in `moe.router` (and
/// their routing in `moe.ids` and `moe.weights` when `routed`) and whose normed input is
/// quantized in `acts`: route (unless `routed`), the chosen experts' gate and up, the gated
/// activation, their down projections, and the weighted sum into `o`: two fused launches
/// where the formats have them, else five (`acts` reused for the gated activations).
#[allow(clippy::too_many_arguments)]
pub(super) fn moe_ffn(
    dev: &CudaDevice,
    x: &GpuExperts,
    acts: &mut DeviceActs,
    g: &mut CudaSlice<f32>,
    u: &mut CudaSlice<f32>,
    moe: &mut MoeBuffers,
    o: &mut CudaSlice<f32>,
    n: usize,
    gelu: bool,
    routed: bool,
) -> Result<(), CudaError> {
    let (n_exp, k) = (x.gate.n_expert, x.n_used);
    if !routed {
        ops::moe_route(
            dev,
            &moe.router,
            &mut moe.ids,
            &mut moe.weights,
            n,
            n_exp,
            k,
            x.normalize,
        )?;
    }
    let (gate, up, down) = (x.gate.view(), x.up.view(), x.down.view());
    if moe_fused_supported(&gate, &up, &down) {
        moe_gate_up(dev, &gate, &up, &moe.ids, k, acts, &mut moe.gated, n, gelu)?;
        return moe_down(dev, &down, &moe.ids, &moe.weights, k, &moe.gated, o, n);
    }
    mmvq_moe(dev, &gate, &moe.ids, k, acts, g, n, false)?;
    mmvq_moe(dev, &up, &moe.ids, k, acts, u, n, false)?;
    acts.gated_quantize(dev, g, u, n * k * x.gate.n_out, gelu)?;
    mmvq_moe(dev, &down, &moe.ids, k, acts, &mut moe.y, n, true)?;
    ops::moe_combine(dev, &moe.y, &moe.weights, o, n, k, x.down.n_out)
}

/// A layer's matrix, its output, and its bias if any.
type LayerProduct<'a> = (
    &'a GpuLinear,
    &'a mut CudaSlice<f32>,
    Option<&'a CudaSlice<f32>>,
);

/// A layer's q, k and v products: for one token in one launch where q and k share a type
/// and a pair kernel takes v's other one ([`mmvq_qkv_pair`]), else by type.
fn qkv_products(
    dev: &CudaDevice,
    acts: &DeviceActs,
    ncols: usize,
    rows: usize,
    [(wq, q, bq), (wk, k, bk), (wv, v, bv)]: [LayerProduct; 3],
) -> Result<(), CudaError> {
    if rows == 1 && wq.ty == wk.ty && wq.ty != wv.ty {
        let mut set = [
            (&wq.w, &mut *q, wq.n_out, bq),
            (&wk.w, &mut *k, wk.n_out, bk),
            (&wv.w, &mut *v, wv.n_out, bv),
        ];
        if mmvq_qkv_pair(dev, (wq.ty, wv.ty), &mut set, acts, ncols)? {
            return Ok(());
        }
    }
    matvecs(
        dev,
        acts,
        ncols,
        rows,
        [(wq, q, bq), (wk, k, bk), (wv, v, bv)],
    )
}

/// Decode products of `N` matrices with the same input (`rows` tokens), each with its
/// bias if any: those of one weight type share a launch (q, k and v; gate and up), so
/// small matrices do not leave the GPU idle.
fn matvecs<const N: usize>(
    dev: &CudaDevice,
    acts: &DeviceActs,
    ncols: usize,
    rows: usize,
    mats: [LayerProduct; N],
) -> Result<(), CudaError> {
    let mut pending: Vec<_> = mats.into_iter().collect();
    while let Some(ty) = pending.first().map(|(w, _, _)| w.ty) {
        let (same, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(w, _, _)| w.ty == ty);
        let mut set: Vec<_> = same
            .into_iter()
            .map(|(w, y, b)| (&w.w, y, w.n_out, b))
            .collect();
        mmvq_set(dev, ty, &mut set, acts, ncols, rows)?;
        pending = rest;
    }
    Ok(())
}
