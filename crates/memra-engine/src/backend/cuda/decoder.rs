//! The decoder on the GPU: the same [`Decoder`] the CPU engine runs (every architecture,
//! mixture-of-experts layers included), with its weights uploaded in their quantized form
//! (`weights.rs`) and a paged f16 KV pool: blocks of [`BLOCK_SIZE`] positions that the
//! sequences of a [`ForwardBatch`] hold through their block tables.
//!
//! A step's sequences take one of two paths by what they compute, so a sequence's numbers
//! do not depend on what else is in the batch:
//! - one token (decode): int8 activations and the `mmvq` kernels for up to
//!   [`MAX_DECODE_ROWS`] sequences at once, split-K paged attention; for one sequence the
//!   whole step is a CUDA graph captured once and replayed (`graph.rs`), so only the batch
//!   arrays go in and one id (or the logits, when the host samples) comes out;
//! - several tokens (prompt chunks, perplexity): batches of up to [`MAX_BATCH`] tokens
//!   through f16 GEMMs (`gemm.rs`) on weights dequantized one matrix at a time into a
//!   scratch buffer, and paged flash attention; the rows that need logits go through the
//!   decode kernels (up to [`MAX_DECODE_ROWS`]) or one output GEMM.
//!
//! The one-context API (`forward`, `forward_greedy`, `forward_sample`: the [`Runner`] of
//! `memra bench`, the GPU tests) is a sequence that holds blocks 0, 1, 2, ... in order.
//!
//! [`Runner`]: crate::generate::Runner

use cudarc::driver::{CudaSlice, CudaView};
use half::f16;

use super::buffers::{
    gemm_chunk_rows, BatchBuffers, MoeBuffers, StepBuffers, Widths, GEMM_SCRATCH,
};
pub use super::buffers::{MAX_BATCH, MAX_DECODE_ROWS};
use super::gemm::Gemm;
use super::graph::DecodeGraph;
use super::matvec::{mmvq, mmvq_moe, mmvq_set, DeviceActs};
use super::ops;
use super::sampling::{argmax, DevicePick, MAX_CANDIDATES};
use super::weights::{matrix_bytes, GpuExperts, GpuFfn, GpuLayer, GpuLinear, GpuWeights};
use super::{CudaDevice, CudaError};
use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::models::layers::{Activation, Decoder, Hyper};
use crate::models::LogitRows;
use crate::sampler::Sampler;

/// Positions per KV block on the GPU (a power of two: the kernels shift and mask).
pub const BLOCK_SIZE: usize = crate::kv::DEFAULT_BLOCK_SIZE;

/// How large the KV pool is.
#[derive(Clone, Copy, Debug)]
pub enum PoolSize {
    /// At least this many positions.
    Tokens(usize),
    /// This fraction of the GPU memory free after the weights and buffers.
    MemoryFraction(f64),
}

/// Where the logits of a step's rows are.
enum Logits {
    /// Rows of `step.logits` on the device (the decode kernels computed them); `best` when
    /// the first row's argmax is in `step.best` already (the captured graph does it).
    Device { best: bool },
    /// Rows on the host.
    Host(Vec<f32>),
}

pub struct GpuDecoder {
    hp: Hyper,
    embd_scale: f32,
    gelu: bool,
    softcap: Option<f32>,
    w: GpuWeights,
    /// Per layer, `num_blocks x BLOCK_SIZE` rows of n_head_kv x head_dim halves.
    k_cache: Vec<CudaSlice<f16>>,
    v_cache: Vec<CudaSlice<f16>>,
    num_blocks: usize,
    /// Blocks one sequence may hold (its `n_ctx` positions).
    max_blocks: usize,
    widths: Widths,
    step: StepBuffers,
    batch: Option<BatchBuffers>,
    graph: Option<DecodeGraph>,
    /// Replay a captured graph per token (off: launch every kernel; `MEMRA_CUDA_GRAPH=0`).
    use_graph: bool,
    /// One-sequence decode steps run eagerly so far (the graph is captured after the first).
    eager_steps: usize,
    /// The one-context API's sequence: positions it holds (in blocks 0, 1, ...).
    own_len: usize,
    n_ctx: usize,
    /// Device bytes: weights, KV pool, buffers (the batch buffers once allocated).
    pub weight_bytes: usize,
    pub cache_bytes: usize,
    pub buffer_bytes: usize,
    /// Last: fields drop in order, and the device trims the memory pool when it goes.
    dev: CudaDevice,
}

impl GpuDecoder {
    /// Uploads `model` to GPU `ordinal` with room for one sequence of `n_ctx` positions.
    pub fn new(ordinal: usize, model: &Decoder, n_ctx: usize) -> Result<GpuDecoder, CudaError> {
        GpuDecoder::with_pool(ordinal, model, n_ctx, PoolSize::Tokens(n_ctx))
    }

    /// Uploads `model` to GPU `ordinal`, for sequences of up to `n_ctx` positions sharing a
    /// KV pool of `pool`.
    pub fn with_pool(
        ordinal: usize,
        model: &Decoder,
        n_ctx: usize,
        pool: PoolSize,
    ) -> Result<GpuDecoder, CudaError> {
        let dev = CudaDevice::new(ordinal)?;
        let hp = &model.hp;
        if hp.head_dim_k != hp.head_dim_v {
            return Err(CudaError::Invalid(format!(
                "key and value heads of different widths ({} and {})",
                hp.head_dim_k, hp.head_dim_v
            )));
        }
        if n_ctx == 0 {
            return Err(CudaError::Invalid("a context of 0 positions".into()));
        }
        let hd = hp.head_dim_k;
        let kv_row = hp.n_head_kv * hd;
        // Keys and values, f16, every layer.
        let token_bytes = 2 * 2 * kv_row * hp.n_layer;
        let matrices = matrix_bytes(model);
        let (free, _) = dev.ctx.mem_get_info()?;
        let asked = match pool {
            PoolSize::Tokens(t) => t * token_bytes,
            PoolSize::MemoryFraction(_) => 0,
        };
        if matrices + asked > free {
            return Err(CudaError::Invalid(format!(
                "the model needs at least {} MiB of GPU memory ({} MiB weights, {} MiB KV cache \
                 for {} positions); {} MiB are free (a smaller context, -c, needs less)",
                (matrices + asked) >> 20,
                matrices >> 20,
                asked >> 20,
                asked / token_bytes,
                free >> 20
            )));
        }
        let w = GpuWeights::upload(&dev, model)?;
        let widths = Widths {
            n_embd: hp.n_embd,
            q_len: hp.n_head * hd,
            kv_len: kv_row,
            ffn: w.layers.iter().map(|l| l.ffn.width()).max().unwrap_or(0),
            n_head: hp.n_head,
            n_vocab: hp.n_vocab,
        };
        let max_blocks = n_ctx.div_ceil(BLOCK_SIZE);
        let step = StepBuffers::new(&dev, &w.layers, &widths, max_blocks)?;
        let mut buffer_bytes = w.small_bytes + step.bytes();
        let mut batch = None;
        let num_blocks = match pool {
            PoolSize::Tokens(t) => t.div_ceil(BLOCK_SIZE).max(1),
            PoolSize::MemoryFraction(f) => {
                // The prompt buffers first, so that the pool takes what is left.
                let b = alloc_batch(&dev, &w, &widths, max_blocks)?;
                buffer_bytes += b.bytes();
                batch = Some(b);
                let (free, _) = dev.ctx.mem_get_info()?;
                let blocks =
                    (free as f64 * f.clamp(0.0, 1.0)) as usize / (token_bytes * BLOCK_SIZE);
                if blocks == 0 {
                    return Err(CudaError::Invalid(format!(
                        "no GPU memory left for the KV cache ({} MiB free after the weights)",
                        free >> 20
                    )));
                }
                blocks
            }
        };
        let slots = num_blocks * BLOCK_SIZE;
        let mut k_cache = Vec::with_capacity(hp.n_layer);
        let mut v_cache = Vec::with_capacity(hp.n_layer);
        for _ in 0..hp.n_layer {
            k_cache.push(dev.stream.alloc_zeros(slots * kv_row)?);
            v_cache.push(dev.stream.alloc_zeros(slots * kv_row)?);
        }
        let use_graph = std::env::var("MEMRA_CUDA_GRAPH").map_or(true, |v| v != "0");
        Ok(GpuDecoder {
            hp: hp.clone(),
            embd_scale: model.embd_scale.unwrap_or(1.0),
            gelu: model.activation == Activation::GeluTanh,
            softcap: model.final_logit_softcap,
            weight_bytes: w.matrix_bytes,
            cache_bytes: slots * token_bytes,
            w,
            k_cache,
            v_cache,
            num_blocks,
            max_blocks,
            widths,
            step,
            batch,
            graph: None,
            use_graph,
            eager_steps: 0,
            own_len: 0,
            n_ctx,
            buffer_bytes,
            dev,
        })
    }

    /// Positions the one-context API's sequence holds.
    pub fn len(&self) -> usize {
        self.own_len
    }

    pub fn is_empty(&self) -> bool {
        self.own_len == 0
    }

    /// Positions one sequence may hold.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        BLOCK_SIZE
    }

    /// Forgets the one-context API's sequence (its blocks are overwritten from position 0).
    pub fn reset(&mut self) {
        self.own_len = 0;
    }

    /// Makes this thread use the decoder's GPU context (a decoder moved to another thread,
    /// the engine's, calls it before its first step).
    pub fn bind_to_thread(&self) -> Result<(), CudaError> {
        Ok(self.dev.ctx.bind_to_thread()?)
    }

    /// What this decoder holds on the device, and what the driver counts in use on the
    /// GPU (that adds the CUDA context and cuBLAS's workspace, and other processes' use).
    pub fn memory_report(&self) -> String {
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        let held = self.weight_bytes + self.cache_bytes + self.buffer_bytes;
        let driver = match self.dev.ctx.mem_get_info() {
            Ok((free, total)) => format!("; the driver counts {:.0} MiB in use", mib(total - free)),
            Err(_) => String::new(),
        };
        format!(
            "gpu memory: {:.0} MiB held: weights {:.0} MiB, KV cache {:.0} MiB (f16, {} positions \
             in blocks of {BLOCK_SIZE}), buffers {:.0} MiB{driver}",
            mib(held),
            mib(self.weight_bytes),
            mib(self.cache_bytes),
            self.num_blocks * BLOCK_SIZE,
            mib(self.buffer_bytes),
        )
    }

    /// The one-context API's sequence, with `tokens` next: checks and its batch.
    fn own_batch(
        &self,
        tokens: &[u32],
        rows: std::ops::Range<usize>,
    ) -> Result<ForwardBatch, CudaError> {
        let room = self.n_ctx.min(self.num_blocks * BLOCK_SIZE);
        if tokens.is_empty() {
            return Err(CudaError::Invalid("no tokens".into()));
        }
        if self.own_len + tokens.len() > room {
            return Err(CudaError::Invalid(format!(
                "the context is full ({room} positions)"
            )));
        }
        let end = self.own_len + tokens.len();
        let blocks: Vec<u32> = (0..end.div_ceil(BLOCK_SIZE) as u32).collect();
        let mut b = ForwardBatch::new(BLOCK_SIZE);
        b.push(tokens, self.own_len, &blocks, rows);
        Ok(b)
    }

    /// Runs `tokens` at the next positions of the one-context sequence; returns the logits
    /// of `rows` (`rows x n_vocab`).
    pub fn forward(&mut self, tokens: &[u32], rows: LogitRows) -> Result<Vec<f32>, CudaError> {
        let t = tokens.len();
        let first = match rows {
            LogitRows::Last => t.saturating_sub(1),
            LogitRows::From(k) => k.min(t),
        };
        let b = self.own_batch(tokens, first..t)?;
        let mut picks: Vec<RowPick> = (first..t).map(|_| RowPick::Logits).collect();
        let out = self.forward_step(&b, &mut picks)?;
        self.own_len += t;
        Ok(out.into_iter().flat_map(RowOut::into_logits).collect())
    }

    /// One token: returns the best token id of the next position (computed on the device).
    pub fn forward_greedy(&mut self, token: u32) -> Result<u32, CudaError> {
        self.forward_pick(token, RowPick::Greedy)
    }

    /// One token: returns the next token as `sampler` picks it, on the device where it can
    /// (only the id comes back), else on the host from the logits.
    pub fn forward_sample(&mut self, token: u32, sampler: &mut Sampler) -> Result<u32, CudaError> {
        self.forward_pick(token, RowPick::Sample(sampler))
    }

    fn forward_pick(&mut self, token: u32, pick: RowPick) -> Result<u32, CudaError> {
        let b = self.own_batch(&[token], 0..1)?;
        let out = self.forward_step(&b, &mut [pick])?;
        self.own_len += 1;
        match out.into_iter().next() {
            Some(RowOut::Token(id)) => Ok(id),
            _ => Err(CudaError::Invalid("no token picked".into())),
        }
    }

    /// One step over `batch`: every sequence's new keys and values into its blocks, and
    /// each logit row's result as `picks` (one per row of `batch.logit_rows`) asks.
    pub fn forward_step(
        &mut self,
        batch: &ForwardBatch,
        picks: &mut [RowPick],
    ) -> Result<Vec<RowOut>, CudaError> {
        batch
            .validate(self.hp.n_vocab, self.num_blocks)
            .map_err(CudaError::Invalid)?;
        if batch.block_size != BLOCK_SIZE || picks.len() != batch.logit_rows.len() {
            return Err(CudaError::Invalid(format!(
                "a batch of {}-position blocks and {} picks for {} rows",
                batch.block_size,
                picks.len(),
                batch.logit_rows.len()
            )));
        }
        let mut row_of = vec![usize::MAX; batch.n_tokens()];
        for (r, &t) in batch.logit_rows.iter().enumerate() {
            row_of[t as usize] = r;
        }
        let mut out: Vec<Option<RowOut>> = vec![None; picks.len()];
        let (decodes, prompts): (Vec<usize>, Vec<usize>) =
            (0..batch.n_seqs()).partition(|&s| batch.seq_tokens(s).len() == 1);
        // Decodes, up to MAX_DECODE_ROWS sequences a launch.
        for group in decodes.chunks(MAX_DECODE_ROWS) {
            let mut sub = ForwardBatch::new(BLOCK_SIZE);
            let mut origin = Vec::new();
            for &s in group {
                let t = batch.seq_tokens(s).start;
                let r = row_of[t];
                sub.push(
                    &batch.tokens[t..t + 1],
                    batch.positions[t] as usize,
                    batch.block_table(s),
                    (r != usize::MAX).then_some(0),
                );
                if r != usize::MAX {
                    origin.push((sub.n_seqs() - 1, r));
                }
            }
            let best = self.decode(&sub)?;
            for (row, r) in origin {
                out[r] = Some(self.pick(&Logits::Device { best }, row, &mut picks[r])?);
            }
        }
        // Prompt chunks, in batches of up to MAX_BATCH tokens; a longer chunk goes in
        // consecutive pieces, each after the one before it.
        let mut sub = ForwardBatch::new(BLOCK_SIZE);
        let mut origin: Vec<usize> = Vec::new();
        for &s in &prompts {
            let range = batch.seq_tokens(s);
            let mut i = range.start;
            while i < range.end {
                let take = (MAX_BATCH - sub.n_tokens()).min(range.end - i);
                let wanted: Vec<usize> =
                    (i..i + take).filter(|&t| row_of[t] != usize::MAX).collect();
                origin.extend(wanted.iter().map(|&t| row_of[t]));
                sub.push(
                    &batch.tokens[i..i + take],
                    batch.positions[i] as usize,
                    batch.block_table(s),
                    wanted.iter().map(|&t| t - i),
                );
                i += take;
                if sub.n_tokens() == MAX_BATCH {
                    self.flush_prompts(&sub, &origin, picks, &mut out)?;
                    sub = ForwardBatch::new(BLOCK_SIZE);
                    origin.clear();
                }
            }
        }
        if !sub.is_empty() {
            self.flush_prompts(&sub, &origin, picks, &mut out)?;
        }
        Ok(out
            .into_iter()
            .map(|o| o.expect("every row picked"))
            .collect())
    }

    fn flush_prompts(
        &mut self,
        sub: &ForwardBatch,
        origin: &[usize],
        picks: &mut [RowPick],
        out: &mut [Option<RowOut>],
    ) -> Result<(), CudaError> {
        let logits = self.prefill(sub)?;
        for (row, &r) in origin.iter().enumerate() {
            out[r] = Some(self.pick(&logits, row, &mut picks[r])?);
        }
        Ok(())
    }

    /// Row `row` of `logits`, as `pick` asks.
    fn pick(
        &mut self,
        logits: &Logits,
        row: usize,
        pick: &mut RowPick,
    ) -> Result<RowOut, CudaError> {
        let nv = self.hp.n_vocab;
        let host_row = |this: &mut Self| -> Result<Vec<f32>, CudaError> {
            let mut v = match logits {
                Logits::Host(h) => return Ok(h[row * nv..(row + 1) * nv].to_vec()),
                Logits::Device { .. } => this
                    .dev
                    .stream
                    .clone_dtoh(&this.step.logits.slice(row * nv..(row + 1) * nv))?,
            };
            this.softcap(&mut v);
            Ok(v)
        };
        let sampler = match pick {
            RowPick::Logits => return Ok(RowOut::Logits(host_row(self)?)),
            RowPick::Greedy => None,
            RowPick::Sample(s) if s.is_plain_greedy() => None,
            RowPick::Sample(s) => Some(s),
        };
        if let Logits::Host(h) = logits {
            let r = &h[row * nv..(row + 1) * nv];
            return Ok(RowOut::Token(match sampler {
                None => crate::sampler::argmax(r),
                Some(s) => s.sample(r),
            }));
        }
        let Logits::Device { best } = *logits else {
            unreachable!("host rows returned above")
        };
        // A row other than the first is copied to a row of its own for the device picks.
        if row > 0 {
            let src = self.step.logits.slice(row * nv..(row + 1) * nv);
            self.dev.stream.memcpy_dtod(&src, &mut self.step.row)?;
        }
        let s = &mut self.step;
        let buf = if row > 0 { &mut s.row } else { &mut s.logits };
        let Some(sampler) = sampler else {
            if !(best && row == 0) {
                argmax(&self.dev, buf, nv, &mut s.best_parts, &mut s.best)?;
            }
            let best = self.dev.stream.clone_dtoh(&s.best)?;
            return Ok(RowOut::Token(best[0] as u32));
        };
        // A final soft cap changes the logits' values: the host applies it.
        let plan = match self.softcap {
            None => sampler.device_plan(nv, MAX_CANDIDATES),
            Some(_) => None,
        };
        let Some(plan) = plan else {
            let v = host_row(self)?;
            return Ok(RowOut::Token(sampler.sample(&v)));
        };
        let u = sampler.peek_uniform();
        match s.sampler.pick(&self.dev, buf, nv, &plan, u)? {
            DevicePick::Token { id, drew } => {
                if drew {
                    sampler.consume_uniform();
                }
                Ok(RowOut::Token(id))
            }
            // Every logit infinite or NaN after the adjustments: the sampler's rule for it,
            // on the adjusted logits.
            DevicePick::NoFinite => {
                let v = self.dev.stream.clone_dtoh(&buf.slice(..nv))?;
                Ok(RowOut::Token(crate::sampler::argmax(&v)))
            }
        }
    }

    fn softcap(&self, logits: &mut [f32]) {
        if let Some(cap) = self.softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
    }

    /// A decode step of up to MAX_DECODE_ROWS sequences of one token: by the captured
    /// graph (one sequence), or eagerly. Returns whether the first row's argmax is done.
    fn decode(&mut self, b: &ForwardBatch) -> Result<bool, CudaError> {
        let rows = b.n_seqs();
        let longest = b.context_len.iter().copied().max().unwrap_or(1) as usize;
        let n_split = ops::decode_splits(longest);
        self.step.meta.fill(&self.dev, b)?;
        if !self.use_graph || rows > 1 || self.eager_steps == 0 {
            // The first step runs eagerly: it loads every kernel and surfaces any error
            // outside a capture.
            self.record_step(n_split, rows)?;
            if rows == 1 {
                self.eager_steps += 1;
            }
            return Ok(rows == 1);
        }
        if self.graph.is_none() {
            let attention: Vec<_> = [32, 64, 128, 256]
                .iter()
                .map(|&d| {
                    Ok(self
                        .dev
                        .function("attention", ops::decode_kernel(d))?
                        .cu_function())
                })
                .collect::<Result<_, CudaError>>()?;
            let combine = self
                .dev
                .function("attention", "attn_combine")?
                .cu_function();
            let (stream, cc) = (self.dev.stream.clone(), self.dev.compute_capability);
            let graph = DecodeGraph::capture(&stream, cc, n_split, &attention, combine, || {
                self.record_step(n_split, 1)
            })?;
            self.graph = Some(graph);
        }
        let graph = self.graph.as_mut().expect("captured above");
        graph.set_splits(n_split)?;
        graph.launch()?;
        Ok(true)
    }

    /// Launches the kernels of a decode step of `rows` sequences (what the graph captures
    /// for one): the batch arrays come from `step.meta` on the device. With one row, the
    /// argmax of its logits goes to `step.best`.
    fn record_step(&mut self, n_split: usize, rows: usize) -> Result<(), CudaError> {
        let hp = &self.hp;
        let dev = &self.dev;
        let s = &mut self.step;
        let e = hp.n_embd;
        let pool_slots = self.num_blocks * BLOCK_SIZE;
        let te = &self.w.token_embd;
        let [xa, xb] = &mut s.x;
        ops::embed_rows(
            dev,
            &te.w,
            te.ty,
            &s.meta.ids(),
            xa,
            e,
            rows,
            self.embd_scale,
        )?;
        // The residual stream moves from one buffer to the other at every add.
        let (mut x, mut x_next) = (xa, xb);
        let mut pending = false;
        let (pos, slots) = (s.meta.pos(), s.meta.slots());
        let kv = s.meta.paged(rows, BLOCK_SIZE, pool_slots);
        for (li, l) in self.w.layers.iter().enumerate() {
            let o = pending.then_some(&s.o);
            s.acts
                .add_norm_quantize(dev, x, o, x_next, &l.attn_norm, rows, hp.rms_eps)?;
            std::mem::swap(&mut x, &mut x_next);
            matvecs(
                dev,
                &s.acts,
                e,
                rows,
                [(&l.wq, &mut s.q), (&l.wk, &mut s.k), (&l.wv, &mut s.v)],
            )?;
            qk_extras(dev, l, &mut s.q, &mut s.k, &mut s.v, rows, hp.rms_eps)?;
            ops::rope_qk_append(
                dev,
                &mut s.q,
                &s.k,
                &s.v,
                &mut self.k_cache[li],
                &mut self.v_cache[li],
                &l.attn,
                &l.rope,
                &pos,
                &slots,
                rows,
                pool_slots,
            )?;
            ops::attention_decode(
                dev,
                &l.attn,
                &s.q,
                &self.k_cache[li],
                &self.v_cache[li],
                &mut s.part_o,
                &mut s.part_ml,
                &kv,
                n_split,
            )?;
            ops::attention_combine(
                dev,
                &l.attn,
                &s.part_o,
                &s.part_ml,
                &mut s.acts,
                n_split,
                rows,
            )?;
            let wo = &l.wo;
            mmvq(
                dev, wo.ty, &wo.w, &s.acts, &mut s.o, wo.n_in, wo.n_out, rows,
            )?;
            if let Some(w) = &l.post_attn_norm {
                ops::rms_norm_inplace(dev, &mut s.o, w, rows, hp.rms_eps)?;
            }
            s.acts
                .add_norm_quantize(dev, x, Some(&s.o), x_next, &l.ffn_norm, rows, hp.rms_eps)?;
            std::mem::swap(&mut x, &mut x_next);
            match &l.ffn {
                GpuFfn::Dense { gate, up, down } => {
                    matvecs(dev, &s.acts, e, rows, [(gate, &mut s.g), (up, &mut s.u)])?;
                    s.acts
                        .gated_quantize(dev, &s.g, &s.u, rows * gate.n_out, self.gelu)?;
                    mmvq(
                        dev, down.ty, &down.w, &s.acts, &mut s.o, down.n_in, down.n_out, rows,
                    )?;
                }
                GpuFfn::Experts(xp) => {
                    let r = &xp.router;
                    mmvq(
                        dev,
                        r.ty,
                        &r.w,
                        &s.acts,
                        &mut s.moe.router,
                        e,
                        r.n_out,
                        rows,
                    )?;
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
                    )?;
                }
            }
            if let Some(w) = &l.post_ffn_norm {
                ops::rms_norm_inplace(dev, &mut s.o, w, rows, hp.rms_eps)?;
            }
            pending = true;
        }
        let o = pending.then_some(&s.o);
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
            hp.rms_eps,
        )?;
        if rows == 1 {
            argmax(dev, &s.logits, hp.n_vocab, &mut s.best_parts, &mut s.best)?;
        }
        Ok(())
    }

    /// A batch of up to MAX_BATCH prompt tokens (chunks of any number of sequences); returns
    /// the logits of its `logit_rows`.
    fn prefill(&mut self, b: &ForwardBatch) -> Result<Logits, CudaError> {
        if self.batch.is_none() {
            let buffers = alloc_batch(&self.dev, &self.w, &self.widths, self.max_blocks)?;
            self.buffer_bytes += buffers.bytes();
            self.batch = Some(buffers);
        }
        let n = b.n_tokens();
        let hp = &self.hp;
        let e = hp.n_embd;
        let dev = &self.dev;
        let bb = self.batch.as_mut().expect("allocated above");
        bb.meta.fill(dev, b)?;
        let pool_slots = self.num_blocks * BLOCK_SIZE;
        let te = &self.w.token_embd;
        ops::embed_rows(
            dev,
            &te.w,
            te.ty,
            &bb.meta.ids(),
            &mut bb.x,
            e,
            n,
            self.embd_scale,
        )?;
        let (pos, slots, q_start) = (bb.meta.pos(), bb.meta.slots(), bb.meta.q_start());
        let kv = bb.meta.paged(b.n_seqs(), BLOCK_SIZE, pool_slots);
        let longest = (0..b.n_seqs())
            .map(|s| b.seq_tokens(s).len())
            .max()
            .unwrap_or(1);
        let mut pending = false;
        for (li, l) in self.w.layers.iter().enumerate() {
            let o = pending.then_some(&bb.o);
            ops::add_norm_f16(dev, &mut bb.x, o, &l.attn_norm, &mut bb.xh, n, hp.rms_eps)?;
            let xh = bb.xh.slice(..n * e);
            linear(dev, &bb.gemm, &mut bb.w, &l.wq, &xh, &mut bb.q, n)?;
            linear(dev, &bb.gemm, &mut bb.w, &l.wk, &xh, &mut bb.k, n)?;
            linear(dev, &bb.gemm, &mut bb.w, &l.wv, &xh, &mut bb.v, n)?;
            qk_extras(dev, l, &mut bb.q, &mut bb.k, &mut bb.v, n, hp.rms_eps)?;
            ops::rope_qk_append(
                dev,
                &mut bb.q,
                &bb.k,
                &bb.v,
                &mut self.k_cache[li],
                &mut self.v_cache[li],
                &l.attn,
                &l.rope,
                &pos,
                &slots,
                n,
                pool_slots,
            )?;
            ops::attention_prefill(
                dev,
                &l.attn,
                &bb.q,
                &self.k_cache[li],
                &self.v_cache[li],
                &mut bb.xh,
                &q_start,
                &kv,
                n,
                longest,
            )?;
            let xh = bb.xh.slice(..n * l.wo.n_in);
            linear(dev, &bb.gemm, &mut bb.w, &l.wo, &xh, &mut bb.o, n)?;
            if let Some(w) = &l.post_attn_norm {
                ops::rms_norm_inplace(dev, &mut bb.o, w, n, hp.rms_eps)?;
            }
            ops::add_norm_f16(
                dev,
                &mut bb.x,
                Some(&bb.o),
                &l.ffn_norm,
                &mut bb.xh,
                n,
                hp.rms_eps,
            )?;
            let xh = bb.xh.slice(..n * e);
            match &l.ffn {
                GpuFfn::Dense { gate, up, down } => {
                    linear(dev, &bb.gemm, &mut bb.w, gate, &xh, &mut bb.g, n)?;
                    linear(dev, &bb.gemm, &mut bb.w, up, &xh, &mut bb.u, n)?;
                    let f = gate.n_out;
                    ops::gated_f16(
                        dev,
                        &bb.g,
                        &bb.u,
                        &mut bb.xh,
                        &mut bb.row_scale,
                        n,
                        f,
                        self.gelu,
                    )?;
                    let xh = bb.xh.slice(..n * f);
                    linear(dev, &bb.gemm, &mut bb.w, down, &xh, &mut bb.o, n)?;
                    ops::scale_rows(dev, &mut bb.o, &bb.row_scale, n, e)?;
                }
                GpuFfn::Experts(xp) => {
                    // Experts through the decode kernels, every token's chosen experts in
                    // one launch per projection (no grouped GEMM yet: each token reads its
                    // experts' weights). The router is a GEMM on the f16 rows.
                    linear(
                        dev,
                        &bb.gemm,
                        &mut bb.w,
                        &xp.router,
                        &xh,
                        &mut bb.moe.router,
                        n,
                    )?;
                    let acts = bb.moe_acts.as_mut().expect("allocated with expert layers");
                    // The normed rows again, as int8 (bb.o is free: it takes a copy of x).
                    acts.add_norm_quantize(
                        dev,
                        &bb.x,
                        None,
                        &mut bb.o,
                        &l.ffn_norm,
                        n,
                        hp.rms_eps,
                    )?;
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
                    )?;
                }
            }
            if let Some(w) = &l.post_ffn_norm {
                ops::rms_norm_inplace(dev, &mut bb.o, w, n, hp.rms_eps)?;
            }
            pending = true;
        }
        let rows: Vec<usize> = b.logit_rows.iter().map(|&r| r as usize).collect();
        if rows.is_empty() {
            return Ok(Logits::Host(Vec::new()));
        }
        let o = pending.then_some(&bb.o);
        let (norm, out) = (&self.w.output_norm, &self.w.output);
        if rows.len() <= MAX_DECODE_ROWS {
            // Few rows: their residual streams into the step buffers and the decode
            // kernels (no dequantized output matrix).
            let s = &mut self.step;
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
                hp.rms_eps,
            )?;
            return Ok(Logits::Device { best: false });
        }
        ops::add_norm_f16(dev, &mut bb.x, o, norm, &mut bb.xh, n, hp.rms_eps)?;
        // The rows' normed activations together, consecutive rows in one copy.
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
        let (r, nv) = (rows.len(), hp.n_vocab);
        if bb.logits.as_ref().is_none_or(|l| l.len() < r * nv) {
            bb.logits = Some(dev.stream.alloc_zeros(r * nv)?);
            self.buffer_bytes += r * nv * 4;
        }
        let logits = bb.logits.as_mut().expect("allocated above");
        let xh = bb.xh_rows.slice(..r * e);
        linear(dev, &bb.gemm, &mut bb.w, out, &xh, logits, r)?;
        let mut host = dev.stream.clone_dtoh(&logits.slice(..r * nv))?;
        self.softcap(&mut host);
        Ok(Logits::Host(host))
    }
}

/// The prompt batches' buffers: the largest dequantized weight chunk sizes the scratch.
fn alloc_batch(
    dev: &CudaDevice,
    w: &GpuWeights,
    widths: &Widths,
    max_blocks: usize,
) -> Result<BatchBuffers, CudaError> {
    // Matrices are dequantized in chunks of rows that fit GEMM_SCRATCH weights (at least
    // one row); smaller models need less.
    let w_max = w
        .layers
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
        .map(|w| w.n_in * w.n_out.min(gemm_chunk_rows(GEMM_SCRATCH, w.n_in)))
        .max()
        .unwrap_or(0);
    BatchBuffers::new(dev, &w.layers, widths, max_blocks, w_max)
}

/// `y (n x w.n_out) = x (n x w.n_in, f16) . w^T` through f16 weights: F16 weights as they
/// are, any other type dequantized into the scratch buffer first, in chunks of rows that
/// fit it.
fn linear(
    dev: &CudaDevice,
    gemm: &Gemm,
    scratch: &mut CudaSlice<f16>,
    w: &GpuLinear,
    x: &CudaView<f16>,
    y: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    let rb = w.row_bytes();
    if w.ty == memra_gguf::GgmlType::F16 {
        let all = w.w.slice(..w.n_out * rb);
        return gemm.f16_f32(dev, &all, x, y, 0, w.n_out, n, w.n_in, w.n_out);
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

/// Biases and QK-norms of `n` tokens' q, k, v, where the architecture has them.
fn qk_extras(
    dev: &CudaDevice,
    l: &GpuLayer,
    q: &mut CudaSlice<f32>,
    k: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    n: usize,
    eps: f32,
) -> Result<(), CudaError> {
    for (b, y) in [(&l.bq, &mut *q), (&l.bk, &mut *k), (&l.bv, &mut *v)] {
        if let Some(b) = b {
            ops::add_bias(dev, y, b, n * b.len())?;
        }
    }
    let (nh, nkv) = (l.attn.n_head, l.attn.n_head_kv);
    if let Some(w) = &l.q_norm {
        ops::rms_norm_inplace(dev, q, w, n * nh, eps)?;
    }
    if let Some(w) = &l.k_norm {
        ops::rms_norm_inplace(dev, k, w, n * nkv, eps)?;
    }
    Ok(())
}

/// The output head of `rows` tokens: `x + o` (o when given) into `x_out`, the final norm,
/// and the logits by the decode matvec.
#[allow(clippy::too_many_arguments)]
fn output_logits(
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

/// A mixture-of-experts FFN for `n` tokens whose router logits are in `moe.router` and
/// whose normed input is quantized in `acts`: route, the chosen experts' gate and up, the
/// gated activation, their down projections, and the weighted sum into `o`. `acts` is
/// reused for the gated activations.
#[allow(clippy::too_many_arguments)]
fn moe_ffn(
    dev: &CudaDevice,
    x: &GpuExperts,
    acts: &mut DeviceActs,
    g: &mut CudaSlice<f32>,
    u: &mut CudaSlice<f32>,
    moe: &mut MoeBuffers,
    o: &mut CudaSlice<f32>,
    n: usize,
    gelu: bool,
) -> Result<(), CudaError> {
    let (n_exp, k) = (x.gate.n_expert, x.n_used);
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
    mmvq_moe(dev, &x.gate.view(), &moe.ids, k, acts, g, n, false)?;
    mmvq_moe(dev, &x.up.view(), &moe.ids, k, acts, u, n, false)?;
    acts.gated_quantize(dev, g, u, n * k * x.gate.n_out, gelu)?;
    mmvq_moe(dev, &x.down.view(), &moe.ids, k, acts, &mut moe.y, n, true)?;
    ops::moe_combine(dev, &moe.y, &moe.weights, o, n, k, x.down.n_out)
}

/// Decode products of `N` matrices with the same input (`rows` tokens): those of one
/// weight type share a launch (q, k and v; gate and up), so small matrices do not leave
/// the GPU idle.
fn matvecs<const N: usize>(
    dev: &CudaDevice,
    acts: &DeviceActs,
    ncols: usize,
    rows: usize,
    mats: [(&GpuLinear, &mut CudaSlice<f32>); N],
) -> Result<(), CudaError> {
    let mut pending: Vec<(&GpuLinear, &mut CudaSlice<f32>)> = mats.into_iter().collect();
    while let Some(ty) = pending.first().map(|(w, _)| w.ty) {
        let (same, rest): (Vec<_>, Vec<_>) = pending.into_iter().partition(|(w, _)| w.ty == ty);
        let mut set: Vec<_> = same.into_iter().map(|(w, y)| (&w.w, y, w.n_out)).collect();
        mmvq_set(dev, ty, &mut set, acts, ncols, rows)?;
        pending = rest;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{RowOut, RowPick};
    use crate::generate::{perplexity, CpuRunner, Runner};
    use crate::models::Model;

    fn rms(v: impl Iterator<Item = f64>) -> f64 {
        let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + x * x, n + 1));
        (s / n.max(1) as f64).sqrt()
    }

    /// Models for the GPU model tests: `MEMRA_GPU_TEST_MODELS` (comma-separated paths;
    /// scripts/device-check.sh passes the tiny models and synthetic ones).
    fn test_models() -> Vec<String> {
        std::env::var("MEMRA_GPU_TEST_MODELS")
            .expect("MEMRA_GPU_TEST_MODELS")
            .split(',')
            .map(str::to_string)
            .collect()
    }

    /// Compares rows of logits; a best token may differ only where the CPU's margin
    /// between its two best is within `4 x` the rows' RMS difference (a near tie).
    /// Returns (worst relative RMS difference, rows whose best token agrees, failures).
    fn compare_rows(
        what: &str,
        cpu: &[f32],
        gpu: &[f32],
        n_vocab: usize,
    ) -> (f64, usize, Vec<String>) {
        let (mut worst, mut agree, mut failures) = (0f64, 0, Vec::new());
        assert_eq!(cpu.len(), gpu.len(), "{what}: logit counts");
        for (r, (c, g)) in cpu.chunks(n_vocab).zip(gpu.chunks(n_vocab)).enumerate() {
            let diff = rms(c.iter().zip(g).map(|(a, b)| f64::from(a - b)));
            worst = worst.max(diff / rms(c.iter().map(|&a| f64::from(a))));
            let best = |v: &[f32]| crate::sampler::argmax(v) as usize;
            if best(c) == best(g) {
                agree += 1;
                continue;
            }
            let mut rest = c.to_vec();
            rest[best(c)] = f32::NEG_INFINITY;
            let margin = f64::from(c[best(c)] - rest[best(&rest)]);
            if margin > 4.0 * diff {
                failures.push(format!(
                    "{what}: row {r}: best tokens differ at a margin of {margin:.4} (RMS difference {diff:.4})"
                ));
            }
        }
        (worst, agree, failures)
    }

    const TEXT: &str = "Hello world, this is a test of the decoder. The quick brown fox jumps \
        over the lazy dog; it was the best of times, it was the worst of times.";

    /// The rows' worst relative RMS difference, and those failures where best tokens differ
    /// beyond a near tie.
    fn check(
        what: &str,
        reference: &[f32],
        got: &[f32],
        nv: usize,
        failures: &mut Vec<String>,
    ) -> f64 {
        let (worst, _, mut f) = compare_rows(what, reference, got, nv);
        failures.append(&mut f);
        worst
    }

    /// GPU logits against the CPU engine's: the tokens as one prompt batch with every row's
    /// logits (the GEMM and flash attention path), and one token at a time (the decode
    /// graph). The reference is the CPU engine with exact activations (f32, no rounding);
    /// the GPU rounds activations (f16 for prompts, int8 per 32 for decode, an f16 cache),
    /// as llama.cpp's CPU engine does (Q8_0 / Q8_K), and the GPU must stay at least as
    /// close to the reference as that rounding does (10% headroom), or within 5%. Some models amplify
    /// rounding a lot (tiny-gemma3's post-norms: docs/cuda.md); the bound follows them.
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_decoder_matches_cpu_logits() {
        let mut failures = Vec::new();
        for path in test_models() {
            let mut model = Model::load(std::path::Path::new(&path)).unwrap();
            let tokens = model.tokenizer.encode(TEXT, true, true).unwrap();
            let nv = model.decoder.hp.n_vocab;
            let mut cpu_rows = |exact: bool| {
                model.decoder.exact_activations = exact;
                let mut cache = model.decoder.new_cache(256);
                let rows = model
                    .decoder
                    .forward(&mut cache, &tokens, LogitRows::From(0));
                rows.unwrap()
            };
            let exact = cpu_rows(true);
            let rounded = cpu_rows(false);
            let d = &model.decoder;
            let mut gpu = GpuDecoder::new(0, d, 256).unwrap();
            let batch = gpu.forward(&tokens, LogitRows::From(0)).unwrap();
            gpu.reset();
            let mut steps = Vec::new();
            for &t in &tokens {
                steps.extend(gpu.forward(&[t], LogitRows::Last).unwrap());
            }
            let f = &mut failures;
            let cpu_q8 = check(
                &format!("{path} cpu q8"),
                &exact,
                &rounded,
                nv,
                &mut Vec::new(),
            );
            let worst_b = check(&format!("{path} batch"), &exact, &batch, nv, f);
            let worst_s = check(&format!("{path} steps"), &exact, &steps, nv, f);
            // The greedy pick on the device equals the host's argmax of the same logits.
            gpu.reset();
            gpu.forward(&tokens[..tokens.len() - 1], LogitRows::Last)
                .unwrap();
            let best = gpu.forward_greedy(tokens[tokens.len() - 1]).unwrap();
            let last = &steps[(tokens.len() - 1) * nv..];
            assert_eq!(best, crate::sampler::argmax(last), "{path}: greedy pick");
            eprintln!(
                "{path}: {} tokens; RMS logit difference to exact arithmetic: GPU prompt batch \
                 {:.2}%, GPU decode steps {:.2}%, CPU with llama.cpp's Q8 rounding {:.2}%",
                tokens.len(),
                100.0 * worst_b,
                100.0 * worst_s,
                100.0 * cpu_q8
            );
            // 10% headroom: on models where rounding decorrelates the logits entirely
            // (synthetic q4_k_m: ~200% both ways) the two differences are equal but for noise.
            let bound = (1.1 * cpu_q8).max(0.05);
            for (what, worst) in [("batch", worst_b), ("steps", worst_s)] {
                if worst > bound {
                    failures.push(format!(
                        "{path} {what}: logits differ by {:.2}% RMS (bound {:.2}%)",
                        100.0 * worst,
                        100.0 * bound
                    ));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// `memra perplexity --device cuda` against the CPU engine (exact activations, as
    /// above) within 0.5%, and 16 greedy tokens: identical to the CPU's, or, where the
    /// CPU's own two roundings part earlier, agreeing at least as long as they do.
    /// Perplexity is skipped on synthetic models (random weights make it astronomical).
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_perplexity_and_greedy_match_the_cpu() {
        let text = match std::env::var("MEMRA_GPU_TEST_TEXT") {
            Ok(p) => std::fs::read_to_string(p).unwrap(),
            Err(_) => TEXT.repeat(40),
        };
        let mut failures = Vec::new();
        for path in test_models() {
            let mut model = Model::load(std::path::Path::new(&path)).unwrap();
            let ctx = 128;
            let prompt = model
                .tokenizer
                .encode("Once upon a time", true, true)
                .unwrap();
            let greedy = |r: &mut dyn Runner| {
                r.reset();
                let mut next = crate::sampler::argmax(&r.feed(&prompt).unwrap());
                let mut out = Vec::new();
                for _ in 0..16 {
                    out.push(next);
                    next = r.feed_greedy(next).unwrap();
                }
                out
            };
            let mut cpu_runs = Vec::new();
            for exact in [false, true] {
                model.decoder.exact_activations = exact;
                let mut cpu = CpuRunner::new(&model.decoder, ctx, 512);
                let ppl = if model.name.starts_with("synthetic") {
                    None
                } else {
                    Some(
                        perplexity(&model, &mut cpu, &text, ctx, Some(4), |_, _, _| {})
                            .unwrap()
                            .ppl,
                    )
                };
                cpu_runs.push((ppl, greedy(&mut cpu)));
            }
            let [(ppl_q8, ids_q8), (ppl_exact, ids_exact)] =
                [cpu_runs[0].clone(), cpu_runs[1].clone()];
            let d = &model.decoder;
            let mut gpu = GpuDecoder::new(0, d, ctx).unwrap();
            if let (Some(want), Some(q8)) = (ppl_exact, ppl_q8) {
                let got = perplexity(&model, &mut gpu, &text, ctx, Some(4), |_, _, _| {})
                    .unwrap()
                    .ppl;
                eprintln!(
                    "{path}: perplexity GPU {got:.4}, CPU exact {want:.4} ({:+.3}%), CPU Q8 {q8:.4} ({:+.3}%)",
                    100.0 * (got - want) / want,
                    100.0 * (got - q8) / q8
                );
                if (got - want).abs() / want > 0.005 {
                    failures.push(format!("{path}: perplexity GPU {got:.4} vs CPU {want:.4}"));
                }
            }
            let ids_gpu = greedy(&mut gpu);
            let agree = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
            let (gpu_n, cpu_n) = (agree(&ids_gpu, &ids_exact), agree(&ids_q8, &ids_exact));
            eprintln!(
                "{path}: greedy tokens agreeing with exact CPU arithmetic: GPU {gpu_n}/16, CPU Q8 {cpu_n}/16"
            );
            if gpu_n < 16 && gpu_n < cpu_n {
                failures.push(format!(
                    "{path}: greedy tokens part from the CPU's at {gpu_n}: GPU {ids_gpu:?}, CPU {ids_exact:?}"
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// Sampling on the device against the host sampler on the same GPU's logits: 32 steps
    /// with llama.cpp's default filters, penalties and a bias, the same seed: the same
    /// tokens, so the device follows the sampler's rules and its use of random numbers.
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_sampled_generation_matches_host_sampling() {
        use crate::sampler::SamplerConfig;
        for path in test_models() {
            let model = Model::load(std::path::Path::new(&path)).unwrap();
            let prompt = model
                .tokenizer
                .encode("Once upon a time", true, true)
                .unwrap();
            let mut config = SamplerConfig {
                repeat_penalty: 1.3,
                frequency_penalty: 0.1,
                seed: 7,
                ..SamplerConfig::default()
            };
            config.logit_bias.insert(prompt[prompt.len() - 1], -1.5);
            let mut gpu = GpuDecoder::new(0, &model.decoder, 128).unwrap();
            let mut runs = Vec::new();
            for on_device in [true, false] {
                gpu.reset();
                let mut sampler = Sampler::new(config.clone()).unwrap();
                prompt.iter().for_each(|&t| sampler.accept(t));
                let logits = gpu.forward(&prompt, LogitRows::Last).unwrap();
                let mut next = sampler.sample(&logits);
                let mut out = Vec::new();
                for _ in 0..32 {
                    sampler.accept(next);
                    out.push(next);
                    next = if on_device {
                        gpu.forward_sample(next, &mut sampler).unwrap()
                    } else {
                        let logits = gpu.forward(&[next], LogitRows::Last).unwrap();
                        sampler.sample(&logits)
                    };
                }
                runs.push(out);
            }
            assert_eq!(runs[0], runs[1], "{path}: device vs host sampling");
            eprintln!("{path}: 32 sampled tokens, device and host sampling agree");
        }
    }

    /// A model and context larger than the GPU's free memory is refused before anything is
    /// allocated, with the sizes and the way out named; a token outside the vocabulary and
    /// a full context are errors, not crashes.
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_bad_requests_are_clear_errors() {
        let path = test_models().remove(0);
        let model = Model::load(std::path::Path::new(&path)).unwrap();
        let d = &model.decoder;
        let err = GpuDecoder::new(0, d, 100_000_000)
            .err()
            .expect("too large")
            .to_string();
        assert!(
            err.contains("MiB of GPU memory") && err.contains("-c"),
            "{err}"
        );
        let mut gpu = GpuDecoder::new(0, d, 4).unwrap();
        let err = gpu
            .forward(&[d.hp.n_vocab as u32], LogitRows::Last)
            .unwrap_err();
        assert!(err.to_string().contains("outside the vocabulary"), "{err}");
        gpu.forward(&[1, 2, 3, 4], LogitRows::Last).unwrap();
        let err = gpu.forward(&[1], LogitRows::Last).unwrap_err();
        assert!(err.to_string().contains("context is full"), "{err}");
    }

    /// Greedy tokens of `prompt` by the one-context API, stopping at end-of-generation.
    fn gpu_alone(gpu: &mut GpuDecoder, model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
        gpu.reset();
        let mut next = crate::sampler::argmax(&gpu.forward(prompt, LogitRows::Last).unwrap());
        let mut out = Vec::new();
        while out.len() < n && !model.tokenizer.is_end_of_generation(next) {
            out.push(next);
            if out.len() < n {
                next = gpu.forward_greedy(next).unwrap();
            }
        }
        out
    }

    const PROMPTS: [&str; 6] = [
        "Hello",
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who \
         every morning rowed out before dawn and came back with the tide.",
        "1, 2, 3, 4, 5,",
        "// Binary search in C\nint search(int *a, int n, int x) {",
    ];

    /// The serving engine on the GPU: six different prompts batched give each the greedy
    /// tokens it gives alone (the one-context API), with whole prompts in a step, prompts
    /// chunked by small budgets, prefix-cache hits, and a pool small enough to force
    /// preemption; per-row logits of batched prompt rows and decode rows agree with the
    /// single-sequence ones.
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_engine_batches_equal_alone() {
        use crate::engine::{
            Engine, EngineConfig, Event, GenerationParams, GpuBatchRunner, Request,
        };
        use crate::scheduler::SchedulerConfig;
        use std::sync::Arc;
        let mut failures = Vec::new();
        for path in test_models() {
            let model = Arc::new(Model::load(std::path::Path::new(&path)).unwrap());
            let n = 12;
            let ctx = 512;
            let prompts: Vec<Vec<u32>> = PROMPTS
                .iter()
                .map(|p| model.tokenizer.encode(p, true, true).unwrap())
                .collect();
            let mut gpu = GpuDecoder::new(0, &model.decoder, ctx).unwrap();
            let want: Vec<Vec<u32>> = prompts
                .iter()
                .map(|p| gpu_alone(&mut gpu, &model, p, n))
                .collect();
            // Per-row logits: three prompts in one prompt batch, then one decode step of the
            // three, against each alone.
            let nv = model.decoder.hp.n_vocab;
            let mut alone_rows = Vec::new();
            for p in &prompts[..3] {
                gpu.reset();
                let first = gpu.forward(p, LogitRows::Last).unwrap();
                let next = crate::sampler::argmax(&first);
                let second = gpu.forward(&[next], LogitRows::Last).unwrap();
                alone_rows.push((first, next, second));
            }
            let mut pool =
                GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(3 * ctx)).unwrap();
            let per = ctx / BLOCK_SIZE;
            let tables: Vec<Vec<u32>> = (0..3)
                .map(|s| ((s * per) as u32..((s + 1) * per) as u32).collect())
                .collect();
            let mut b = ForwardBatch::new(BLOCK_SIZE);
            for (s, p) in prompts[..3].iter().enumerate() {
                b.push(p, 0, &tables[s], [p.len() - 1]);
            }
            let mut picks: Vec<RowPick> = (0..3).map(|_| RowPick::Logits).collect();
            let firsts = pool.forward_step(&b, &mut picks).unwrap();
            let mut d = ForwardBatch::new(BLOCK_SIZE);
            for (s, p) in prompts[..3].iter().enumerate() {
                d.push(&[alone_rows[s].1], p.len(), &tables[s], [0]);
            }
            let mut picks: Vec<RowPick> = (0..3).map(|_| RowPick::Logits).collect();
            let seconds = pool.forward_step(&d, &mut picks).unwrap();
            for s in 0..3 {
                for (what, got, want) in [
                    ("prompt row", &firsts[s], &alone_rows[s].0),
                    ("decode row", &seconds[s], &alone_rows[s].2),
                ] {
                    let RowOut::Logits(got) = got else {
                        panic!("logits asked")
                    };
                    let diff = rms(got.iter().zip(want.iter()).map(|(a, b)| f64::from(a - b)));
                    let scale = rms(want.iter().map(|&a| f64::from(a)));
                    eprintln!("{path}: sequence {s} {what}: batched vs alone RMS difference {:.2e} (logits RMS {scale:.2})", diff);
                    if diff > 1e-3 * scale.max(1.0) {
                        failures.push(format!(
                            "{path}: sequence {s} {what}: batched logits differ by {diff:.3e} RMS"
                        ));
                    }
                    assert_eq!(got.len(), nv);
                }
            }
            drop(pool);
            drop(gpu);
            let run = |kv_tokens: usize,
                       budget: usize,
                       label: &str,
                       failures: &mut Vec<String>|
             -> usize {
                let gpu =
                    GpuDecoder::with_pool(0, &model.decoder, ctx, PoolSize::Tokens(kv_tokens))
                        .unwrap();
                let engine = Engine::start(
                    model.clone(),
                    Box::new(GpuBatchRunner::new(gpu)),
                    EngineConfig {
                        scheduler: SchedulerConfig {
                            max_running: 8,
                            token_budget: budget,
                        },
                        n_ctx: ctx,
                    },
                );
                let handles: Vec<_> = prompts
                    .iter()
                    .map(|p| {
                        let mut params = GenerationParams {
                            max_tokens: n,
                            ..GenerationParams::default()
                        };
                        params.sampler.temperature = 0.0;
                        engine
                            .submit(Request {
                                prompt: p.clone(),
                                params,
                            })
                            .unwrap()
                    })
                    .collect();
                let mut preemptions = 0;
                for (i, h) in handles.into_iter().enumerate() {
                    let mut ids = Vec::new();
                    for ev in h {
                        match ev {
                            Event::Token(t) => ids.push(t.id),
                            Event::Finished { usage, .. } => preemptions += usage.preemptions,
                            Event::Error(e) => panic!("{path}: {e}"),
                            Event::PromptScores(_) => {}
                        }
                    }
                    if ids != want[i] {
                        failures.push(format!(
                            "{path} {label}: prompt {i}: batched {ids:?}, alone {:?}",
                            want[i]
                        ));
                    }
                }
                preemptions
            };
            run(8 * ctx, 2048, "budget 2048", &mut failures);
            run(8 * ctx, 5, "budget 5", &mut failures);
            run(8 * ctx, 17, "budget 17", &mut failures);
            // Exactly the prompts' blocks (every prompt admitted in the first step), or the
            // longest request's: sequences growing into a new block find none free.
            let longest = prompts.iter().map(|p| p.len()).max().unwrap() + n;
            let prompt_blocks: usize = prompts.iter().map(|p| p.len().div_ceil(BLOCK_SIZE)).sum();
            let small = prompt_blocks.max(longest.div_ceil(BLOCK_SIZE)) * BLOCK_SIZE;
            let preempted = run(small, 2048, "small pool", &mut failures);
            eprintln!("{path}: batched runs done ({preempted} preemptions in the small pool)");
            if preempted == 0 {
                failures.push(format!("{path}: the small pool forced no preemption"));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
