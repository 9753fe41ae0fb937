//! The GPU's operations of a prompt batch ([`LayerOps`]): up to [`MAX_BATCH`] tokens of
//! any number of sequences (prompt chunks, perplexity, and the decodes of a step with
//! `GEMM_DECODE_ROWS` or more), through f16 GEMMs on weights
//! dequantized one matrix (or chunk of rows) at a time into a scratch buffer, and paged
//! flash attention. Mixture-of-experts FFNs run as grouped products over the experts' tile
//! copies (`experts.rs`), or without them through the decode kernels, every token's chosen
//! experts in one launch per projection. The rows that need logits go through the
//! decode kernels (up to [`MAX_MATVEC_ROWS`]) or one output GEMM.

use cudarc::driver::{CudaSlice, CudaView};
use half::f16;

#[cfg(doc)]
use super::buffers::MAX_BATCH;
use super::buffers::{
    gemm_chunk_rows, BatchBuffers, StepBuffers, Widths, GEMM_SCRATCH, MAX_MATVEC_ROWS,
};
use super::decode::{moe_ffn, output_logits, qk_norms, qkv_biases};
use super::experts;
use super::gemm::Gemm;
use super::ops;
use super::qgemm::{self, TileMatrix};
use super::sampling::argmax_rows;
use super::weights::{GpuFfn, GpuLinear, GpuWeights};
use super::{CudaDevice, CudaError};
use crate::models::forward::LayerOps;
use crate::models::layers::Hyper;

/// Most rows a dense product through tile copies takes (the work buffer is sized for
/// it); the decoder's chooser sets how many do (`PromptPass::tile_rows`).
pub(super) const DENSE_TILE_ROWS: usize = 64;

/// A block's output not yet added to the residual stream.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Pending {
    Nothing,
    /// In `bb.o`'s rows; times `bb.row_scale`'s factor of each row where `scaled`.
    Rows {
        scaled: bool,
    },
    /// A tile product's split sums in `bb.tile_work` ([`qgemm::Sums::Parts`]), which the
    /// next norm adds itself (no reduce launch); times the rows' factors where `scaled`.
    Parts {
        parts: usize,
        slots: usize,
        scaled: bool,
    },
}

impl Pending {
    fn of(sums: qgemm::Sums, scaled: bool) -> Self {
        match sums {
            qgemm::Sums::Done => Pending::Rows { scaled },
            qgemm::Sums::Parts { parts, slots } => Pending::Parts {
                parts,
                slots,
                scaled,
            },
        }
    }
}

/// Where the logits of a step's rows are.
pub(super) enum Logits {
    /// Rows of `step.logits` on the device (the decode kernels computed them); `best` when
    /// the first row's argmax is in `step.best` already (the captured graph does it).
    Device { best: bool },
    /// Rows on the host (soft-capped where the model caps them).
    Host(Vec<f32>),
    /// Rows of logits on the device (not soft-capped), in the step's or the batch's
    /// buffers, with each row's argmax.
    Rows { best: Vec<u32>, on: RowsOn },
}

/// Where a [`Logits::Rows`] result lies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum RowsOn {
    /// `step.logits`, argmaxes in `step.best` (a decode step of several rows).
    Step,
    /// The batch buffers' `logits`, argmaxes in their `best` (a prompt batch).
    Batch,
}

/// One prompt batch's launches over the batch buffers (and the step buffers, for the
/// logits of a few rows).
pub(super) struct PromptPass<'a> {
    pub dev: &'a CudaDevice,
    pub hp: &'a Hyper,
    pub w: &'a GpuWeights,
    pub k_cache: &'a mut [CudaSlice<f16>],
    pub v_cache: &'a mut [CudaSlice<f16>],
    pub bb: &'a mut BatchBuffers,
    pub step: &'a mut StepBuffers,
    /// Tokens and sequences in the batch.
    pub n: usize,
    pub n_seqs: usize,
    /// The leading sequences of one token each (decodes) whose attention runs through the
    /// decode kernels in `decode_split` splits (none in steps of many: the decoder's
    /// chooser); the longest of the other sequences' tokens.
    pub decodes: usize,
    pub decode_split: usize,
    pub longest: usize,
    /// Batch rows whose logits the pass returns.
    pub rows: Vec<usize>,
    /// Batches of up to this many rows multiply through the tile copies where there are
    /// some (`DENSE_TILE_ROWS` at most: the work buffer's size).
    pub tile_rows: usize,
    pub pool_slots: usize,
    pub block_size: usize,
    pub embd_scale: f32,
    pub gelu: bool,
    pub softcap: Option<f32>,
    /// Every row's logits go to the host (all that the picks ask for), in one copy.
    pub host_logits: bool,
    /// The rows' argmaxes stay in `bb.best` (the pass is being captured into a graph,
    /// where nothing may copy to the host): the head's result has no ids.
    pub ids_later: bool,
    /// A block's output not yet added to the residual stream.
    pub pending: Pending,
    /// The head's result, and device bytes it allocated (a larger logits buffer).
    pub logits: Option<Logits>,
    pub grown: usize,
}

impl PromptPass<'_> {
    /// `bb.x += ` the pending output, normed by `norm` into `bb.xh` (f16).
    fn add_norm(&mut self, norm: &CudaSlice<f32>) -> Result<(), CudaError> {
        let bb = &mut *self.bb;
        let e = self.hp.n_embd;
        let scale = |scaled: bool| scaled.then_some(&bb.row_scale);
        let o = match self.pending {
            Pending::Nothing => None,
            Pending::Rows { scaled } => Some(ops::Addend {
                scale: scale(scaled),
                ..ops::Addend::rows(&bb.o)
            }),
            Pending::Parts {
                parts,
                slots,
                scaled,
            } => Some(ops::Addend {
                sums: &bb.tile_work,
                parts,
                stride: slots * e,
                scale: scale(scaled),
            }),
        };
        ops::add_norm_f16(
            self.dev,
            &mut bb.x,
            o,
            norm,
            &mut bb.xh,
            self.n,
            self.hp.rms_eps,
        )?;
        self.pending = Pending::Nothing;
        Ok(())
    }

    /// The pending output as rows of `bb.o`, as they are (for a norm of its own, or a
    /// copy into the step buffers).
    fn settle(&mut self) -> Result<(), CudaError> {
        let (dev, bb, n, e) = (self.dev, &mut *self.bb, self.n, self.hp.n_embd);
        let scaled = match self.pending {
            Pending::Nothing => return Ok(()),
            Pending::Rows { scaled } => scaled,
            Pending::Parts {
                parts,
                slots,
                scaled,
            } => {
                let y = &mut bb.o.slice_mut(..);
                qgemm::reduce(dev, &bb.tile_work, None, y, e, n, e, parts, slots)?;
                scaled
            }
        };
        if scaled {
            ops::scale_rows(dev, &mut bb.o, &bb.row_scale, n, e)?;
        }
        self.pending = Pending::Rows { scaled: false };
        Ok(())
    }

    /// A block's output projection `o = xh . w^T`, left pending: a tile product's split
    /// sums stay unreduced for the next norm to add.
    fn output(&mut self, w: &GpuLinear, scaled: bool) -> Result<(), CudaError> {
        let (bb, n) = (&mut *self.bb, self.n);
        let xh = bb.xh.slice(..n * w.n_in);
        let sums = match w.tiles.as_deref().filter(|_| n <= self.tile_rows) {
            Some(t) => {
                let (y, work) = (&mut bb.o.slice_mut(..), &mut bb.tile_work.slice_mut(..));
                qgemm::qgemm_unreduced(self.dev, t, &xh, y, w.n_out, None, work, n)?
            }
            None => {
                self.linear(w, Out::O)?;
                qgemm::Sums::Done
            }
        };
        self.pending = Pending::of(sums, scaled);
        Ok(())
    }

    /// `y = xh[..n x w.n_in] . w^T`.
    fn linear(&mut self, w: &GpuLinear, y: Out) -> Result<(), CudaError> {
        let (bb, n) = (&mut *self.bb, self.n);
        let xh = bb.xh.slice(..n * w.n_in);
        let y = match y {
            Out::Q => &mut bb.q,
            Out::K => &mut bb.k,
            Out::V => &mut bb.v,
            Out::O => &mut bb.o,
            Out::G => &mut bb.g,
            Out::U => &mut bb.u,
            Out::Router => &mut bb.moe.router,
        };
        let mm = MatMul {
            gemm: &bb.gemm,
            scratch: &mut bb.w,
            tile_work: &mut bb.tile_work,
            tile_rows: self.tile_rows,
        };
        linear(self.dev, mm, w, &xh, y, n)
    }
}

/// The batch buffer a [`PromptPass::linear`] writes.
enum Out {
    Q,
    K,
    V,
    O,
    G,
    U,
    Router,
}

impl LayerOps for PromptPass<'_> {
    type Error = CudaError;

    fn embed(&mut self) -> Result<(), CudaError> {
        let (bb, te) = (&mut *self.bb, &self.w.token_embd);
        let ids = bb.meta.ids();
        ops::embed_rows(
            self.dev,
            &te.w,
            te.ty,
            &ids,
            &mut bb.x,
            self.hp.n_embd,
            self.n,
            self.embd_scale,
        )
    }

    fn attention(&mut self, li: usize) -> Result<(), CudaError> {
        let (dev, n, l) = (self.dev, self.n, &self.w.layers[li]);
        self.add_norm(&l.attn_norm)?;
        let (nq, nk, nv) = (l.wq.n_out, l.wk.n_out, l.wv.n_out);
        let mut runs = Vec::new();
        let fused = if !l.qkv_tiles.is_empty() && n <= self.tile_rows {
            // A tile product for each run of q, k and v sharing a layout, each into its
            // columns of the fused rows, biases added by the products; or, where every run
            // splits, left as their sums for the rope to add.
            let bb = &mut *self.bb;
            let xh = bb.xh.slice(..n * l.wq.n_in);
            let y = bb.qkv.as_mut().expect("allocated");
            let bias = l.bqkv.as_ref();
            match qkv_sums(&l.qkv_tiles, n) {
                true => runs = unreduced_products(dev, &l.qkv_tiles, &xh, y, &mut bb.tile_work, n)?,
                false => fused_products(dev, &l.qkv_tiles, bias, &xh, y, &mut bb.tile_work, n)?,
            }
            true
        } else if let Some(h) = l.qkv16.as_ref() {
            // One GEMM for q, k and v.
            let bb = &mut *self.bb;
            let xh = bb.xh.slice(..n * l.wq.n_in);
            let (m, k) = (nq + nk + nv, l.wq.n_in);
            let y = bb.qkv.as_mut().expect("allocated for qkv16");
            bb.gemm.f16_f32(dev, &h.slice(..), &xh, y, 0, m, n, k, m)?;
            if let Some(b) = &l.bqkv {
                ops::add_bias(dev, y, b, n * m)?;
            }
            true
        } else {
            self.linear(&l.wq, Out::Q)?;
            self.linear(&l.wk, Out::K)?;
            self.linear(&l.wv, Out::V)?;
            let bb = &mut *self.bb;
            qkv_biases(dev, l, &mut bb.q, &mut bb.k, &mut bb.v, n)?;
            false
        };
        let bb = &mut *self.bb;
        let (pos, slots) = (bb.meta.pos(), bb.meta.slots());
        let rows = match (fused, runs.is_empty()) {
            (true, false) => ops::QkvRows::Sums {
                sums: &bb.tile_work,
                bias: l.bqkv.as_ref(),
                runs: &runs,
            },
            (true, true) => ops::QkvRows::Fused(bb.qkv.as_ref().expect("allocated")),
            (false, _) => ops::QkvRows::Apart { k: &bb.k, v: &bb.v },
        };
        ops::rope_qk_append(
            dev,
            &mut bb.q,
            rows,
            &mut self.k_cache[li],
            &mut self.v_cache[li],
            &l.attn,
            &l.rope,
            qk_norms(l, self.hp.rms_eps),
            &pos,
            &slots,
            n,
            self.pool_slots,
        )?;
        let (k, v, bs, slots) = (
            &self.k_cache[li],
            &self.v_cache[li],
            self.block_size,
            self.pool_slots,
        );
        if self.decodes > 0 {
            // One query per sequence: split-K over its keys and the query heads of a KV
            // head together, instead of a prompt tile of 32 queries holding one.
            let (d, ns) = (self.decodes, self.decode_split);
            let kv = bb.meta.paged(d, bs, slots);
            let (o, ml) = (&mut bb.part_o, &mut bb.part_ml);
            ops::attention_decode(dev, &l.attn, &bb.q, k, v, o, ml, &kv, ns)?;
            ops::attention_combine_f16(dev, &l.attn, o, ml, &mut bb.xh, ns, d)?;
        }
        if self.n_seqs > self.decodes {
            let first = self.decodes;
            let kv = bb.meta.paged_from(first, self.n_seqs - first, bs, slots);
            let q_start = bb.meta.q_start_from(first);
            let out = &mut bb.xh;
            ops::attention_prefill(
                dev,
                &l.attn,
                &bb.q,
                k,
                v,
                out,
                &q_start,
                &kv,
                n,
                self.longest,
            )?;
        }
        self.output(&l.wo, false)?;
        if let Some(w) = &l.post_attn_norm {
            self.settle()?;
            ops::rms_norm_inplace(dev, &mut self.bb.o, w, n, self.hp.rms_eps)?;
        }
        Ok(())
    }

    fn ffn(&mut self, li: usize) -> Result<(), CudaError> {
        let (dev, n, l) = (self.dev, self.n, &self.w.layers[li]);
        let eps = self.hp.rms_eps;
        self.add_norm(&l.ffn_norm)?;
        match &l.ffn {
            GpuFfn::Dense { gate, up, down } => {
                let f = gate.n_out;
                let ld = if !l.gate_up_tiles.is_empty() && n <= self.tile_rows {
                    // Gate and up side by side in bb.g's rows (2f each: tile steps have at
                    // most DENSE_TILE_ROWS rows, a half of the MAX_BATCH it holds).
                    let bb = &mut *self.bb;
                    let xh = bb.xh.slice(..n * gate.n_in);
                    let tw = &mut bb.tile_work;
                    fused_products(dev, &l.gate_up_tiles, None, &xh, &mut bb.g, tw, n)?;
                    2 * f
                } else {
                    self.linear(gate, Out::G)?;
                    self.linear(up, Out::U)?;
                    f
                };
                let bb = &mut *self.bb;
                let (g, u) = match ld == f {
                    true => (bb.g.slice(..), bb.u.slice(..)),
                    false => (bb.g.slice(..), bb.g.slice(f..)),
                };
                let (xh, rs) = (&mut bb.xh, &mut bb.row_scale);
                ops::gated_f16(dev, &g, &u, ld, xh, rs, n, f, self.gelu)?;
                // Times the rows' factors when the next norm adds it.
                self.output(down, true)?;
            }
            GpuFfn::Experts(xp) => {
                // The router is a GEMM on the f16 rows; the experts are grouped products
                // over their tile copies, or (without them) go through the decode kernels,
                // each token reading its experts' weights.
                self.linear(&xp.router, Out::Router)?;
                let bb = &mut *self.bb;
                if experts::grouped(xp, &bb.moe) {
                    let (xh, g, u, moe, o) =
                        (&mut bb.xh, &mut bb.g, &mut bb.u, &mut bb.moe, &mut bb.o);
                    experts::grouped_ffn(dev, xp, xh, g, u, moe, o, n, self.gelu)?;
                    self.pending = Pending::Rows { scaled: false };
                    if let Some(w) = &l.post_ffn_norm {
                        ops::rms_norm_inplace(dev, &mut self.bb.o, w, n, eps)?;
                    }
                    return Ok(());
                }
                let acts = bb.moe_acts.as_mut().expect("allocated with expert layers");
                // The normed rows again, as int8 (bb.o is free: it takes a copy of x).
                acts.add_norm_quantize(dev, &bb.x, None, &mut bb.o, &l.ffn_norm, n, eps)?;
                moe_ffn(
                    dev,
                    xp,
                    acts,
                    &mut bb.g,
                    &mut bb.u,
                    &mut bb.moe,
                    &mut bb.o,
                    n,
                    self.gelu,
                    false,
                )?;
                self.pending = Pending::Rows { scaled: false };
            }
        }
        if let Some(w) = &l.post_ffn_norm {
            self.settle()?;
            ops::rms_norm_inplace(dev, &mut self.bb.o, w, n, eps)?;
        }
        Ok(())
    }

    fn head(&mut self) -> Result<(), CudaError> {
        let (dev, e, eps) = (self.dev, self.hp.n_embd, self.hp.rms_eps);
        let rows = std::mem::take(&mut self.rows);
        if rows.is_empty() {
            self.logits = Some(Logits::Host(Vec::new()));
            return Ok(());
        }
        let (norm, out) = (&self.w.output_norm, &self.w.output);
        if rows.len() <= MAX_MATVEC_ROWS {
            // Few rows: their residual streams into the step buffers and the decode
            // kernels (no dequantized output matrix).
            self.settle()?;
            let pending = self.pending != Pending::Nothing;
            let (bb, s) = (&*self.bb, &mut *self.step);
            for (i, &r) in rows.iter().enumerate() {
                let (src, dst) = (r * e..(r + 1) * e, i * e..(i + 1) * e);
                dev.stream
                    .memcpy_dtod(&bb.x.slice(src.clone()), &mut s.x[0].slice_mut(dst.clone()))?;
                if pending {
                    dev.stream
                        .memcpy_dtod(&bb.o.slice(src), &mut s.o.slice_mut(dst))?;
                }
            }
            let [xa, xb] = &mut s.x;
            let o = pending.then_some(&s.o);
            output_logits(
                dev,
                norm,
                out,
                xa,
                o,
                xb,
                &mut s.acts,
                &mut s.logits,
                rows.len(),
                eps,
            )?;
            self.logits = Some(Logits::Device { best: false });
            return Ok(());
        }
        self.add_norm(norm)?;
        // The rows' normed activations together, consecutive rows in one copy.
        let bb = &mut *self.bb;
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len() && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            let (src, dst) = (rows[i] * e..(rows[j - 1] + 1) * e, i * e..j * e);
            dev.stream
                .memcpy_dtod(&bb.xh.slice(src), &mut bb.xh_rows.slice_mut(dst))?;
            i = j;
        }
        let (r, nv) = (rows.len(), self.hp.n_vocab);
        if bb.logits.as_ref().is_none_or(|l| l.len() < r * nv) {
            bb.logits = Some(dev.stream.alloc_zeros(r * nv)?);
            self.grown += r * nv * 4;
        }
        let logits = bb.logits.as_mut().expect("allocated above");
        let xh = bb.xh_rows.slice(..r * e);
        let mm = MatMul {
            gemm: &bb.gemm,
            scratch: &mut bb.w,
            tile_work: &mut bb.tile_work,
            tile_rows: self.tile_rows,
        };
        linear(dev, mm, out, &xh, logits, r)?;
        if self.host_logits {
            let mut host = dev.stream.clone_dtoh(&logits.slice(..r * nv))?;
            if let Some(cap) = self.softcap {
                host.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
            }
            self.logits = Some(Logits::Host(host));
            return Ok(());
        }
        // The rows stay on the device; their greedy picks in one launch, only ids back.
        argmax_rows(dev, logits, r, nv, &mut bb.best)?;
        let best = match self.ids_later {
            true => Vec::new(),
            false => dev.stream.clone_dtoh(&bb.best.slice(..r))?,
        };
        self.logits = Some(Logits::Rows {
            best: best.into_iter().map(|b| b as u32).collect(),
            on: RowsOn::Batch,
        });
        Ok(())
    }
}

/// The prompt batches' buffers: the largest dequantized weight chunk sizes the scratch.
pub(super) fn alloc_batch(
    dev: &CudaDevice,
    w: &GpuWeights,
    widths: &Widths,
    max_blocks: usize,
) -> Result<BatchBuffers, CudaError> {
    let matrices = || {
        w.layers
            .iter()
            .flat_map(|l| {
                let mut m = vec![&l.wq, &l.wk, &l.wv, &l.wo];
                match &l.ffn {
                    GpuFfn::Dense { gate, up, down } => m.extend([gate, up, down]),
                    GpuFfn::Experts(x) => m.push(&x.router),
                }
                m
            })
            .chain([&w.output])
    };
    // Matrices are dequantized in chunks of rows that fit GEMM_SCRATCH weights (at least
    // one row); smaller models need less, and matrices with f16 copies none.
    let w_max = matrices()
        .filter(|w| !w.has_f16())
        .map(|w| w.n_in * w.n_out.min(gemm_chunk_rows(GEMM_SCRATCH, w.n_in)))
        .max()
        .unwrap_or(0);
    let fused_tiles = w
        .layers
        .iter()
        .flat_map(|l| l.qkv_tiles.iter().chain(&l.gate_up_tiles));
    // The fused q|k|v runs' sums side by side (`unreduced_products`).
    let qkv_runs = w.layers.iter().map(|l| {
        let lens = l
            .qkv_tiles
            .iter()
            .map(|t| qgemm::work_len(t, DENSE_TILE_ROWS));
        lens.sum::<usize>()
    });
    let tile_work = matrices()
        .filter_map(|w| w.tiles.as_deref())
        .chain(fused_tiles)
        .map(|t| qgemm::work_len(t, DENSE_TILE_ROWS))
        .chain(qkv_runs)
        .max()
        .unwrap_or(0);
    BatchBuffers::new(dev, &w.layers, widths, max_blocks, (w_max, tile_work))
}

/// The tile products of matrices that multiply the same `n` rows `x` (`tiles`: their runs
/// of one layout, [`GpuLayer::qkv_tiles`]), each into its columns of `y`'s rows, which are
/// all the matrices' outputs side by side; `bias` (the rows' width, or None) added.
fn fused_products(
    dev: &CudaDevice,
    tiles: &[TileMatrix],
    bias: Option<&CudaSlice<f32>>,
    x: &CudaView<f16>,
    y: &mut CudaSlice<f32>,
    work: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let ld = tiles.iter().map(|t| t.n_out).sum();
    let mut at = 0;
    for t in tiles {
        let b = bias.map(|b| b.slice(at..at + t.n_out));
        qgemm::qgemm(dev, t, x, &mut y.slice_mut(at..), ld, b.as_ref(), work, n)?;
        at += t.n_out;
    }
    Ok(())
}

/// Whether the fused q|k|v products of `n` rows are left as split sums for the rope to add
/// (a reduce launch a run fewer): where every run splits, into at most
/// [`ops::MAX_SUMS_RUNS`] runs.
fn qkv_sums(tiles: &[TileMatrix], n: usize) -> bool {
    tiles.len() <= ops::MAX_SUMS_RUNS && tiles.iter().all(|t| qgemm::work_len(t, n) > 0)
}

/// [`fused_products`] with every run's split sums left in `work`, one run after another
/// (`y` untouched); the runs for [`ops::QkvRows::Sums`].
fn unreduced_products(
    dev: &CudaDevice,
    tiles: &[TileMatrix],
    x: &CudaView<f16>,
    y: &mut CudaSlice<f32>,
    work: &mut CudaSlice<f32>,
    n: usize,
) -> Result<Vec<ops::SumsRun>, CudaError> {
    let ld = tiles.iter().map(|t| t.n_out).sum();
    let (mut at, mut offset, mut runs) = (0, 0, Vec::new());
    for t in tiles {
        let (y, w) = (&mut y.slice_mut(at..), &mut work.slice_mut(offset..));
        let qgemm::Sums::Parts { parts, slots } =
            qgemm::qgemm_unreduced(dev, t, x, y, ld, None, w, n)?
        else {
            return Err(CudaError::Invalid("a run that does not split".into()));
        };
        runs.push(ops::SumsRun {
            cols: t.n_out,
            parts,
            slots,
            offset,
        });
        at += t.n_out;
        offset += parts * slots * t.n_out;
    }
    Ok(runs)
}

/// What [`linear`] multiplies with besides the weights (borrowed from the batch buffers).
struct MatMul<'a> {
    gemm: &'a Gemm,
    scratch: &'a mut CudaSlice<f16>,
    tile_work: &'a mut CudaSlice<f32>,
    tile_rows: usize,
}

/// `y (n x w.n_out) = x (n x w.n_in, f16) . w^T`: through the tile copy for up to
/// `tile_rows` rows where the decoder keeps one, else through f16 weights: F16 weights as
/// they are, the f16 copy where the decoder keeps one, else the matrix dequantized into
/// the scratch buffer first, in chunks of rows that fit it.
fn linear(
    dev: &CudaDevice,
    mm: MatMul,
    w: &GpuLinear,
    x: &CudaView<f16>,
    y: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let MatMul {
        gemm,
        scratch,
        tile_work,
        tile_rows,
    } = mm;
    let rb = w.row_bytes();
    let (m, k) = (w.n_out, w.n_in);
    if let Some(t) = w.tiles.as_deref().filter(|_| n <= tile_rows) {
        return qgemm::qgemm(dev, t, x, &mut y.slice_mut(..), m, None, tile_work, n);
    }
    if w.in_qkv {
        // No scratch was sized for it: its rows are in the layer's fused copy.
        return Err(CudaError::Invalid(
            "q, k and v of this layer go through their fused f16 copy".into(),
        ));
    }
    if w.ty == memra_gguf::GgmlType::F16 {
        let all = w.w.slice(..m * rb);
        return gemm.f16_f32(dev, &all, x, y, 0, m, n, k, m);
    }
    if let Some(h) = &w.f16 {
        return gemm.f16_f32(dev, &h.slice(..), x, y, 0, m, n, k, m);
    }
    let chunk = gemm_chunk_rows(scratch.len(), w.n_in);
    for r0 in (0..w.n_out).step_by(chunk) {
        let m = chunk.min(w.n_out - r0);
        let rows = w.w.slice(r0 * rb..(r0 + m) * rb);
        let mut dq = scratch.slice_mut(..m * w.n_in);
        ops::dequantize_f16(dev, &rows, w.ty, &mut dq, m, w.n_in)?;
        let dq = scratch.slice(..m * w.n_in);
        gemm.f16_f32(dev, &dq, x, y, r0, m, n, w.n_in, w.n_out)?;
    }
    Ok(())
}
