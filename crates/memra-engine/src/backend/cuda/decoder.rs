//! The decoder on the GPU: the same [`Decoder`] the CPU engine runs (every architecture,
//! mixture-of-experts layers included), with its weights uploaded in their quantized form
//! (`weights.rs`) and a paged f16 KV pool: blocks of [`BLOCK_SIZE`] positions that the
//! sequences of a [`ForwardBatch`] hold through their block tables.
//!
//! A step's sequences take one of two paths by what they compute, so a sequence's numbers
//! do not depend on what else is in the batch; both run the one forward
//! (`models/forward.rs`) over their own operations:
//! - one token (decode, `decode.rs`): int8 activations and the `mmvq` kernels (dp4a up to 8
//!   sequences, the int8 tensor cores up to [`MAX_DECODE_ROWS`]), split-K paged attention;
//!   the whole step is a CUDA graph captured once per row count and replayed
//!   (`graph.rs`), so only the batch arrays go in and the ids (or the logits, when the host
//!   samples) come out;
//! - several tokens (prompt chunks, perplexity; `prompt.rs`): batches of up to
//!   [`MAX_BATCH`] tokens through f16 GEMMs on dequantized weights and paged flash
//!   attention; a step of many decodes alone replays a graph per row and split count.
//!
//! The one-context API (`forward`, `forward_greedy`, `forward_sample`: the [`Runner`] of
//! `memra bench`, the GPU tests) is a sequence that holds blocks 0, 1, 2, ... in order.
//!
//! [`Runner`]: crate::generate::Runner

use std::collections::{HashMap, HashSet};

use cudarc::driver::CudaSlice;
use half::f16;

use super::buffers::{BatchBuffers, StepBuffers, Widths, BATCH_DECODE_PARTS, DECODE_PARTS};
pub use super::buffers::{MAX_BATCH, MAX_DECODE_ROWS, MAX_MATVEC_ROWS};
use super::decode::DecodePass;
use super::graph::{DecodeGraph, DecodeKernels, StepGraph};
use super::ops;
use super::prompt::{alloc_batch, Logits, Pending, PromptPass, RowsOn, DENSE_TILE_ROWS};
use super::sampling::{
    argmax, argmax_rows, mask_rows_on_device as ops_mask_rows, DevicePick, MAX_CANDIDATES,
};
use super::weights::{matrix_bytes, GpuWeights};
use super::{env_usize, CudaDevice, CudaError};
use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::constraint::apply_mask;
use crate::models::forward::forward;
use crate::models::layers::{Activation, Decoder, Hyper};
use crate::models::LogitRows;
use crate::sampler::Sampler;

/// Positions per KV block on the GPU (a power of two: the kernels shift and mask).
pub const BLOCK_SIZE: usize = crate::kv::DEFAULT_BLOCK_SIZE;

/// Decodes in one step from which they go through the prompt path's GEMMs (f16 weights
/// dequantized once for all rows) instead of the int8 mat-vec kernels in groups of
/// MAX_MATVEC_ROWS, one group after another, for a model with a matrix of a format without
/// tensor-core kernels. Measured on the H200 (synthetic llama3-8b Q4_K_M, docs/engine.md): a
/// group of 8 costs about 7.4 ms a step, the GEMM path about 20 ms plus 0.19 ms a sequence,
/// so the GEMM path wins from a fourth group on.
pub const GEMM_DECODE_ROWS: usize = 3 * MAX_MATVEC_ROWS + 1;

/// As [`GEMM_DECODE_ROWS`] when the decoder keeps f16 copies of the weights
/// ([`F16Weights`]): the GEMMs then read 2 bytes a weight and no dequantization, about 8.4
/// ms a step for an 8B on the H200 whatever the rows, against about 2.7 ms for one row and
/// 7.4 ms for a group of 8 through the mat-vec kernels.
pub const GEMM_DECODE_ROWS_F16: usize = MAX_MATVEC_ROWS + 1;

/// As [`GEMM_DECODE_ROWS_F16`] when every matrix has tensor-core kernels: a step of up to
/// MAX_DECODE_ROWS decodes reads the quantized weights once, about 6.2 ms for 12 to 16
/// rows of an 8B on the H200 against the GEMM path's 8.4 ms (docs/cuda.md), and a second
/// group would cost more than the GEMM path.
pub const GEMM_DECODE_ROWS_MMQ: usize = MAX_DECODE_ROWS + 1;

/// As [`GEMM_DECODE_ROWS`] (no f16 copies) when every matrix has tensor-core kernels: from
/// the seventh group of MAX_DECODE_ROWS on, by the measured costs (a group about 6.2 ms,
/// the GEMM path dequantizing every matrix about 19 ms plus 0.19 ms a sequence).
pub const GEMM_DECODE_ROWS_MMQ_DEQUANT: usize = 6 * MAX_DECODE_ROWS + 1;

/// As [`GEMM_DECODE_ROWS_MMQ`] when the decoder keeps tile copies of the dense matrices
/// ([`DENSE_TILES_SHARE`]): measured on the H200 (synthetic llama3-8b Q4_K_M, 2026-12-04,
/// `gpu_qgemm_speed`), a layer's products through the tiles took about 103 us at 16 rows
/// against the int8 kernels' 130, and a tile product costs nearly the same at 9 rows as
/// at 16, so the tiles take every step past one int8 group of 8.
pub const GEMM_DECODE_ROWS_TILES: usize = MAX_MATVEC_ROWS + 1;

/// The share of free memory (after the weights, their f16 copies and the asked KV cache)
/// the dense matrices' tile copies may take: an 8B's 5.5 GiB. `MEMRA_DENSE_TILES=0` goes
/// without them.
pub const DENSE_TILES_SHARE: f64 = 0.25;

/// Decode steps of up to this many rows replay with programmatic edges between their
/// kernels (each launched as its predecessor's blocks finish); the tensor-core kernels of
/// more rows replay with plain ones. Measured on the H200 (synthetic llama3-8b Q4_K_M,
/// `bench --batched -npp 128 -ntg 32`): S_TG at 4 / 8 rows 826-840 / 1,105-1,120 with a
/// programmatic graph against 777 / 1,068 eagerly, but at 16 rows 2,392-2,438 against
/// 2,533 (the early-launched blocks of the next kernel hold the SMs the 16-row kernels'
/// later blocks need), and with plain edges 2,704-2,723 against 2,566 (12 rows: 1,899-1,915
/// against 1,824).
const PDL_DECODE_ROWS: usize = MAX_MATVEC_ROWS;

/// Steps of at least this many leading decodes take the prompt attention for them (the
/// tensor cores, a query's group heads as a tile's rows, no split partials to combine)
/// rather than the decode kernels; a step of decodes alone is graphed either way (the
/// prompt kernel's grid depends only on the row count). H100, llama3-8b Q4_K_M, `bench
/// --batched -npp 128 -ntg 32`, both graphed (docs/cuda.md, 2026-12-07): 48 rows 6,336 /
/// 6,301 t/s through the decode kernels against 5,804 through the prompt attention, 64
/// rows 8,215 / 8,103 against 7,328, 96 rows 8,438 / 8,890 against 9,678 / 9,593, 128
/// rows 10,508 / 10,639 against 11,985 / 12,621. `MEMRA_PROMPT_ATTENTION_FROM` sets it,
/// to measure.
const PROMPT_ATTENTION_FROM_DECODES: usize = 96;

/// Graphs of batched decode steps kept at once (each a row count and split count seen
/// twice); past it they are dropped and captured again as the counts come back.
const MAX_BATCH_GRAPHS: usize = 64;

/// Whether the decoder keeps f16 copies of the matrices the GEMMs multiply (prompts and
/// steps of many decodes), besides the quantized ones the mat-vec kernels read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum F16Weights {
    /// When the copies take at most [`F16_AUTO_SHARE`] of the memory the quantized
    /// weights and the asked KV cache leave free.
    Auto,
    On,
    Off,
}

/// The share of free memory f16 copies may take under [`F16Weights::Auto`]: an 8B's
/// 14 GiB on an H200 (134 GiB free), not on a 24 GiB card where they would crowd out
/// the KV cache.
pub const F16_AUTO_SHARE: f64 = 0.25;

/// The share of free memory (after the weights, their f16 copies and the asked KV cache)
/// the experts' tile copies may take (`qgemm.rs`: the grouped products of MoE batches; the
/// 30B-A3B's take about 20 GiB on the H200's 140). `MEMRA_EXPERT_TILES=0` goes without
/// them (batches through the decode kernels, every token reading its experts' rows).
pub const EXPERT_TILES_SHARE: f64 = 0.5;

/// How a decoder is set up on its GPU.
#[derive(Clone, Copy, Debug)]
pub struct GpuOptions {
    pub pool: PoolSize,
    pub f16_weights: F16Weights,
}

/// How large the KV pool is.
#[derive(Clone, Copy, Debug)]
pub enum PoolSize {
    /// At least this many positions.
    Tokens(usize),
    /// This fraction of the GPU memory free after the weights and buffers.
    MemoryFraction(f64),
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
    /// Decode steps through the mat-vec kernels, by row count (1 to `decode_rows`); the
    /// counts seen once (run eagerly).
    graphs: HashMap<usize, DecodeGraph>,
    decode_seen: HashSet<usize>,
    /// Replay a captured graph per token (off: launch every kernel; `MEMRA_CUDA_GRAPH=0`).
    use_graph: bool,
    /// Graphs of decode steps through the GEMMs, by (rows, attention splits); the keys
    /// seen once (run eagerly); whether capturing them works for this model.
    batch_graphs: HashMap<(usize, usize), StepGraph>,
    batch_seen: HashSet<(usize, usize)>,
    batch_graphs_work: bool,
    /// Decodes in a step from which they take the GEMM path (GEMM_DECODE_ROWS_MMQ or
    /// GEMM_DECODE_ROWS_MMQ_DEQUANT with tensor-core kernels for every matrix, else
    /// GEMM_DECODE_ROWS_F16 with f16 copies, GEMM_DECODE_ROWS without;
    /// `MEMRA_GEMM_DECODE_ROWS` overrides it, to measure both sides).
    gemm_decode_rows: usize,
    /// Batches of up to this many rows multiply through the dense tile copies (0: none
    /// kept; DENSE_TILE_ROWS, fewer by `MEMRA_DENSE_TILE_ROWS`).
    tile_rows: usize,
    /// Sequences one decode step takes: MAX_DECODE_ROWS where every matrix has tensor-core
    /// kernels, else MAX_MATVEC_ROWS (`MEMRA_DECODE_MMQ=0` forces the latter, to measure).
    decode_rows: usize,
    /// A prompt batch's leading decodes take the decode attention kernels while fewer than
    /// this many, else the prompt attention (PROMPT_ATTENTION_FROM_DECODES).
    prompt_attention_from: usize,
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
        let f16_weights = F16Weights::Auto;
        GpuDecoder::with_options(ordinal, model, n_ctx, GpuOptions { pool, f16_weights })
    }

    /// Uploads `model` to GPU `ordinal` as `opts` say, for sequences of up to `n_ctx`
    /// positions.
    pub fn with_options(
        ordinal: usize,
        model: &Decoder,
        n_ctx: usize,
        opts: GpuOptions,
    ) -> Result<GpuDecoder, CudaError> {
        let pool = opts.pool;
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
        let mut w = GpuWeights::upload(&dev, model)?;
        let keep_f16 = match opts.f16_weights {
            F16Weights::On => true,
            F16Weights::Off => false,
            F16Weights::Auto => {
                let (free, _) = dev.ctx.mem_get_info()?;
                let left = free.saturating_sub(asked) as f64;
                w.f16_copy_bytes() as f64 <= F16_AUTO_SHARE * left
            }
        };
        if keep_f16 {
            let (free, _) = dev.ctx.mem_get_info()?;
            let need = w.f16_copy_bytes();
            if need + asked > free {
                return Err(CudaError::Invalid(format!(
                    "f16 copies of the weights need {} MiB of GPU memory besides the KV \
                     cache's {} MiB; {} MiB are free (--f16-weights off goes without them)",
                    need >> 20,
                    asked >> 20,
                    free >> 20
                )));
            }
            w.keep_f16(&dev)?;
        }
        let want_dense = std::env::var("MEMRA_DENSE_TILES").map_or(true, |v| v != "0");
        let mut tile_rows = 0;
        if want_dense && w.dense_tile_bytes() > 0 {
            let (free, _) = dev.ctx.mem_get_info()?;
            let left = free.saturating_sub(asked) as f64;
            if w.dense_tile_bytes() as f64 <= DENSE_TILES_SHARE * left {
                w.keep_dense_tiles(&dev, model)?;
                // Up to 64 rows the tiles beat the f16 copies and the int8 kernels: on the
                // H100 (2026-12-06, docs/cuda.md) S_TG 3,993 / 5,117 / 7,226 at 24 / 32 / 64
                // sequences through them against 3,008 / 3,911 / 6,874 without.
                tile_rows = env_usize("MEMRA_DENSE_TILE_ROWS")
                    .unwrap_or(DENSE_TILE_ROWS)
                    .min(DENSE_TILE_ROWS);
            }
        }
        let want_tiles = std::env::var("MEMRA_EXPERT_TILES").map_or(true, |v| v != "0");
        if want_tiles && w.expert_tile_bytes() > 0 {
            let (free, _) = dev.ctx.mem_get_info()?;
            let left = free.saturating_sub(asked) as f64;
            if w.expert_tile_bytes() as f64 <= EXPERT_TILES_SHARE * left {
                w.keep_expert_tiles(&dev, model)?;
            }
        }
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
        let mmq =
            w.tensor_core_decode() && std::env::var("MEMRA_DECODE_MMQ").map_or(true, |v| v != "0");
        let decode_rows = if mmq {
            MAX_DECODE_ROWS
        } else {
            MAX_MATVEC_ROWS
        };
        let gemm_decode_rows =
            env_usize("MEMRA_GEMM_DECODE_ROWS").unwrap_or(match (mmq, keep_f16) {
                _ if tile_rows >= MAX_DECODE_ROWS => GEMM_DECODE_ROWS_TILES,
                (true, true) => GEMM_DECODE_ROWS_MMQ,
                (true, false) => GEMM_DECODE_ROWS_MMQ_DEQUANT,
                (false, true) => GEMM_DECODE_ROWS_F16,
                (false, false) => GEMM_DECODE_ROWS,
            });
        Ok(GpuDecoder {
            hp: hp.clone(),
            embd_scale: model.embd_scale.unwrap_or(1.0),
            gelu: model.activation == Activation::GeluTanh,
            softcap: model.final_logit_softcap,
            weight_bytes: w.matrix_bytes + w.f16_bytes + w.tile_bytes,
            cache_bytes: slots * token_bytes,
            w,
            k_cache,
            v_cache,
            num_blocks,
            max_blocks,
            widths,
            step,
            batch,
            graphs: HashMap::new(),
            decode_seen: HashSet::new(),
            use_graph,
            batch_graphs: HashMap::new(),
            batch_seen: HashSet::new(),
            batch_graphs_work: true,
            gemm_decode_rows,
            tile_rows,
            decode_rows,
            prompt_attention_from: env_usize("MEMRA_PROMPT_ATTENTION_FROM")
                .unwrap_or(PROMPT_ATTENTION_FROM_DECODES),
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
        let f16 = match self.w.f16_bytes {
            0 => String::new(),
            b => format!(" (f16 copies for the GEMMs {:.0} MiB)", mib(b)),
        };
        let f16 = match self.w.tile_bytes {
            0 => f16,
            b => format!("{f16} (tile copies {:.0} MiB)", mib(b)),
        };
        format!(
            "gpu memory: {:.0} MiB held: weights {:.0} MiB{f16}, KV cache {:.0} MiB (f16, {} \
             positions in blocks of {BLOCK_SIZE}), buffers {:.0} MiB{driver}",
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
        // Decodes as (sequence, token) rows.
        let (mut decodes, mut prompts): (Vec<usize>, Vec<usize>) =
            (0..batch.n_seqs()).partition(|&s| batch.seq_tokens(s).len() == 1);
        let mut rows: Vec<(usize, usize)> = decodes
            .iter()
            .map(|&s| (s, batch.seq_tokens(s).start))
            .collect();
        // Few decodes go through the mat-vec kernels, MAX_DECODE_ROWS a launch; from
        // gemm_decode_rows on, with the prompt chunks through the GEMM path instead (one
        // read of the weights for all of them; docs/engine.md has the measurements).
        if decodes.len() >= self.gemm_decode_rows {
            decodes.append(&mut prompts);
            prompts = std::mem::take(&mut decodes);
            rows.clear();
        } else {
            // A speculative verify step (the last token and its drafts), or a draft model's
            // catch-up, while few rows decode: each token a row of the dp4a mat-vec kernels
            // at its own position, over the sequence's blocks, so a verify step rounds as
            // plain decoding does (the tensor-core kernels of 9 to 16 rows round otherwise,
            // so the rows stay within 8) and a short chunk replays a decode graph instead of
            // the prompt path's eager launches. The rows of a launch append their keys and
            // values before any attends, and a later group runs after an earlier one, so
            // each token sees the ones before it, as in a prompt batch.
            prompts.retain(|&s| {
                let r = batch.seq_tokens(s);
                let short = batch.is_as_decodes(s)
                    && rows.len() + r.len() <= MAX_MATVEC_ROWS
                    && rows.len() + r.len() < self.gemm_decode_rows;
                if short {
                    rows.extend(r.map(|t| (s, t)));
                }
                !short
            });
        }
        for group in rows.chunks(self.decode_rows) {
            let mut sub = ForwardBatch::new(BLOCK_SIZE);
            let mut origin = Vec::new();
            for &(s, t) in group {
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
            let mut logits = self.decode(&sub)?;
            self.mask_rows(&mut logits, &origin, picks)?;
            for (row, r) in origin {
                out[r] = Some(self.pick(&logits, row, &mut picks[r])?);
            }
        }
        // Prompt chunks (and many decodes), in batches of up to MAX_BATCH tokens; a longer
        // chunk goes in consecutive pieces, each after the one before it.
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
        let host = origin.iter().all(|&r| matches!(picks[r], RowPick::Logits));
        let mut logits = self.prefill(sub, host)?;
        let rows: Vec<(usize, usize)> = origin.iter().copied().enumerate().collect();
        self.mask_rows(&mut logits, &rows, picks)?;
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
        let span = row * nv..(row + 1) * nv;
        let host_row = |this: &mut Self| -> Result<Vec<f32>, CudaError> {
            let mut v = match logits {
                Logits::Host(h) => return Ok(h[span.clone()].to_vec()),
                Logits::Device { .. } => this
                    .dev
                    .stream
                    .clone_dtoh(&this.step.logits.slice(span.clone()))?,
                Logits::Rows { on, .. } => this
                    .dev
                    .stream
                    .clone_dtoh(&this.row_logits(*on).slice(span.clone()))?,
            };
            this.softcap(&mut v);
            Ok(v)
        };
        // A constrained row's mask goes to the device and sets the logits it bans to minus
        // infinity before the pick, so a greedy pick done with the step is of no use.
        // The mask may still be being computed on the host: this waits for it.
        let (sampler, mask) = match pick {
            RowPick::Logits => return Ok(RowOut::Logits(host_row(self)?)),
            RowPick::Greedy => (None, None),
            RowPick::Sample(s) if s.is_plain_greedy() => (None, None),
            RowPick::Sample(s) => (Some(s), None),
            RowPick::Masked(s, slot) => match slot.wait() {
                None => return Ok(RowOut::Logits(host_row(self)?)),
                Some(m) if s.is_plain_greedy() => (None, Some(m)),
                Some(m) => (Some(s), Some(m)),
            },
        };
        let first_best = match logits {
            Logits::Host(h) => {
                let mut r = h[span].to_vec();
                if let Some(m) = mask {
                    apply_mask(&mut r, m);
                }
                return Ok(RowOut::Token(match sampler {
                    None => crate::sampler::argmax(&r),
                    Some(s) => s.sample(&r),
                }));
            }
            Logits::Rows { best, .. } if sampler.is_none() && mask.is_none() => {
                return Ok(RowOut::Token(best[row]))
            }
            Logits::Rows { .. } => false,
            Logits::Device { best } => *best && row == 0 && mask.is_none(),
        };
        // A row other than the first of the step's logits is copied to a row of its own
        // for the device picks.
        let own_row = row > 0
            || matches!(
                logits,
                Logits::Rows {
                    on: RowsOn::Batch,
                    ..
                }
            );
        if own_row {
            let on = match logits {
                Logits::Rows { on, .. } => *on,
                _ => RowsOn::Step,
            };
            let s = &mut self.step;
            let src = match on {
                RowsOn::Step => s.logits.slice(span.clone()),
                RowsOn::Batch => self
                    .batch
                    .as_ref()
                    .and_then(|b| b.logits.as_ref())
                    .expect("rows on the device")
                    .slice(span.clone()),
            };
            self.dev.stream.memcpy_dtod(&src, &mut s.row)?;
        }
        let s = &mut self.step;
        let buf = if own_row { &mut s.row } else { &mut s.logits };
        if let Some(m) = mask {
            s.sampler.apply_mask(&self.dev, buf, nv, m)?;
        }
        let Some(sampler) = sampler else {
            if !first_best {
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
            let mut v = host_row(self)?;
            if let Some(m) = mask {
                apply_mask(&mut v, m);
            }
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

    /// The logits of a `Logits::Rows` result.
    fn row_logits(&self, on: RowsOn) -> &CudaSlice<f32> {
        match on {
            RowsOn::Step => &self.step.logits,
            RowsOn::Batch => self
                .batch
                .as_ref()
                .and_then(|b| b.logits.as_ref())
                .expect("rows on the device"),
        }
    }

    /// The greedy picks of the constrained rows among `rows` ((row of `logits`, pick)
    /// pairs), when `logits` are rows on the device with their argmaxes: every such row's
    /// mask goes up in one copy, one launch bans what they ban, one launch takes every
    /// row's argmax again, and those rows' picks become plain greedy ones. (Each masked and
    /// picked on its own cost a host round trip a row: 13% of the generation of 64 rows
    /// with 32 constrained, docs/benchmarks.md.) Rows whose mask failed, and sampled rows,
    /// are left to `pick`.
    fn mask_rows(
        &mut self,
        logits: &mut Logits,
        rows: &[(usize, usize)],
        picks: &mut [RowPick],
    ) -> Result<(), CudaError> {
        let Logits::Rows { best, on } = logits else {
            return Ok(());
        };
        let mut masked = Vec::new();
        let mut masks = Vec::new();
        for &(row, r) in rows {
            if let RowPick::Masked(s, slot) = &picks[r] {
                if let (true, Some(m)) = (s.is_plain_greedy(), slot.wait()) {
                    masked.push(row);
                    masks.push(m);
                }
            }
        }
        if masked.is_empty() {
            return Ok(());
        }
        let (nv, n_rows) = (self.hp.n_vocab, best.len());
        let (dev, list) = (&self.dev, &mut self.step.mask_list);
        let (x, out) = match *on {
            RowsOn::Step => (&mut self.step.logits, &mut self.step.best),
            RowsOn::Batch => {
                let bb = self.batch.as_mut().expect("rows on the device");
                (
                    bb.logits.as_mut().expect("rows on the device"),
                    &mut bb.best,
                )
            }
        };
        let had = list.len();
        ops_mask_rows(dev, x, nv, list, &masked, &masks)?;
        // The list grows for a prompt batch of many constrained rows.
        let grown = 4 * list.len().saturating_sub(had);
        argmax_rows(dev, x, n_rows, nv, out)?;
        let ids = dev.stream.clone_dtoh(&out.slice(..n_rows))?;
        *best = ids.into_iter().map(|b| b as u32).collect();
        self.buffer_bytes += grown;
        for &(row, r) in rows {
            if masked.contains(&row) {
                picks[r] = RowPick::Greedy;
            }
        }
        Ok(())
    }

    fn softcap(&self, logits: &mut [f32]) {
        if let Some(cap) = self.softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
    }

    /// A decode step of up to `decode_rows` sequences of one token, by the graph captured
    /// for its row count (the first step of a count runs eagerly: it loads every kernel and
    /// surfaces any error outside a capture), or eagerly. One row's logits come back as
    /// `Logits::Device` with its argmax done, several as `Logits::Rows` with every row's
    /// argmax.
    fn decode(&mut self, b: &ForwardBatch) -> Result<Logits, CudaError> {
        let rows = b.n_seqs();
        let longest = b.context_len.iter().copied().max().unwrap_or(1) as usize;
        // As many splits as the partials hold for this many rows.
        let n_split = ops::decode_splits(longest)
            .min(DECODE_PARTS / rows.max(1))
            .max(1);
        self.step.meta.fill(&self.dev, b)?;
        if let Some(graph) = self.graphs.get_mut(&rows) {
            graph.set_splits(n_split)?;
            graph.launch()?;
        } else if !self.use_graph || self.decode_seen.insert(rows) {
            self.record_step(n_split, rows)?;
        } else {
            match self.capture_decode(n_split, rows) {
                Ok(graph) => {
                    graph.launch()?;
                    self.graphs.insert(rows, graph);
                }
                Err(e) => {
                    // The capture ran nothing: this step eagerly, and no more captures.
                    eprintln!(
                        "memra: decode steps of {rows} rows run eagerly: capture failed ({e})"
                    );
                    self.use_graph = false;
                    self.record_step(n_split, rows)?;
                }
            }
        }
        if rows == 1 {
            return Ok(Logits::Device { best: true });
        }
        let ids = self.dev.stream.clone_dtoh(&self.step.best.slice(..rows))?;
        Ok(Logits::Rows {
            best: ids.into_iter().map(|b| b as u32).collect(),
            on: RowsOn::Step,
        })
    }

    /// The decode step of `rows` sequences as a graph (`n_split` attention splits, which
    /// it rewrites as contexts grow).
    fn capture_decode(&mut self, n_split: usize, rows: usize) -> Result<DecodeGraph, CudaError> {
        let (head_dim, group) = (self.hp.head_dim_k, self.hp.n_head / self.hp.n_head_kv);
        let kernel = |one_head| -> Result<_, CudaError> {
            let name = ops::decode_kernel(head_dim, group, one_head);
            Ok(self.dev.function("attention", name)?.cu_function())
        };
        let attention = DecodeKernels {
            group: kernel(false)?,
            one_head: kernel(true)?,
        };
        let combine = self
            .dev
            .function("attention", "attn_combine")?
            .cu_function();
        let (stream, cc) = (self.dev.stream.clone(), self.dev.compute_capability);
        let ours = match rows <= PDL_DECODE_ROWS {
            true => self.dev.loaded_functions(),
            false => HashSet::new(),
        };
        DecodeGraph::capture(&stream, cc, &ours, n_split, attention, combine, || {
            self.record_step(n_split, rows)
        })
    }

    /// Launches the kernels of a decode step of `rows` sequences (what the graph captures
    /// for one): the batch arrays come from `step.meta` on the device. With one row, the
    /// argmax of its logits goes to `step.best`.
    fn record_step(&mut self, n_split: usize, rows: usize) -> Result<(), CudaError> {
        let mut pass = DecodePass {
            dev: &self.dev,
            hp: &self.hp,
            w: &self.w,
            k_cache: &mut self.k_cache,
            v_cache: &mut self.v_cache,
            s: &mut self.step,
            rows,
            n_split,
            pool_slots: self.num_blocks * BLOCK_SIZE,
            block_size: BLOCK_SIZE,
            embd_scale: self.embd_scale,
            gelu: self.gelu,
            cur: 0,
            pending: false,
        };
        forward(&self.hp, &mut pass)
    }

    /// A batch of up to MAX_BATCH prompt tokens (chunks of any number of sequences); returns
    /// the logits of its `logit_rows`.
    /// `host_logits`: every row's logits go to the host (all its picks ask for them).
    ///
    /// A step of decodes alone, every row's greedy pick wanted (the steady state of many
    /// sequences generating), replays a graph captured for its row and split counts: the
    /// second time a count is seen (the first runs eagerly and sizes the buffers), so the
    /// host launches one graph instead of ~700 kernels and GEMMs.
    fn prefill(&mut self, b: &ForwardBatch, host_logits: bool) -> Result<Logits, CudaError> {
        if self.batch.is_none() {
            let buffers = alloc_batch(&self.dev, &self.w, &self.widths, self.max_blocks)?;
            self.buffer_bytes += buffers.bytes();
            self.batch = Some(buffers);
        }
        let bb = self.batch.as_mut().expect("allocated above");
        bb.meta.fill(&self.dev, b)?;
        // The leading one-token sequences (the scheduler puts decodes first) take the
        // decode attention, with as many splits as the partials' buffer holds for them;
        // many of them, the prompt attention.
        let one_token = (0..b.n_seqs())
            .take_while(|&s| b.seq_tokens(s).len() == 1)
            .count();
        let decodes = match one_token < self.prompt_attention_from {
            true => one_token,
            false => 0,
        };
        let decode_ctx = b.context_len[..decodes].iter().copied().max().unwrap_or(1);
        let decode_split = ops::decode_splits(decode_ctx as usize)
            .min(BATCH_DECODE_PARTS / decodes.max(1))
            .max(1);
        let n = b.n_tokens();
        let every_row = b.logit_rows.len() == n
            && b.logit_rows
                .iter()
                .enumerate()
                .all(|(i, &r)| r as usize == i);
        let graphable = self.use_graph
            && self.batch_graphs_work
            && one_token == n
            && n > MAX_MATVEC_ROWS
            && every_row
            && !host_logits;
        let key = (n, decode_split);
        if graphable {
            if let Some(g) = self.batch_graphs.get(&key) {
                g.launch()?;
                return self.batch_ids(n);
            }
            if self.batch_seen.contains(&key) {
                match self.capture_batch(b, decodes, decode_split) {
                    Ok(g) => {
                        g.launch()?;
                        if self.batch_graphs.len() >= MAX_BATCH_GRAPHS {
                            self.batch_graphs.clear();
                        }
                        self.batch_graphs.insert(key, g);
                        return self.batch_ids(n);
                    }
                    Err(e) => {
                        // Something in the step synchronizes or allocates: eagerly from
                        // now on (the capture ran nothing).
                        eprintln!("memra: batched decode steps run eagerly: capture failed ({e})");
                        self.batch_graphs_work = false;
                    }
                }
            }
            self.batch_seen.insert(key);
        }
        let mut pass = self.prompt_pass(b, decodes, decode_split, host_logits, false);
        let hp = pass.hp;
        forward(hp, &mut pass)?;
        let (grown, logits) = (pass.grown, pass.logits.take());
        if grown > 0 {
            // A larger logits buffer: the captured graphs point at the old one.
            self.batch_graphs.clear();
            self.buffer_bytes += grown;
        }
        Ok(logits.expect("the head ran"))
    }

    /// Captures the pass of `b` (decodes alone, every row's argmax wanted) as a graph; its
    /// ids stay in the batch buffers' `best`.
    fn capture_batch(
        &mut self,
        b: &ForwardBatch,
        decodes: usize,
        decode_split: usize,
    ) -> Result<StepGraph, CudaError> {
        let rows = b.n_tokens() * self.hp.n_vocab;
        let bb = self.batch.as_ref().expect("allocated by prefill");
        if bb.logits.as_ref().is_none_or(|l| l.len() < rows) {
            return Err(CudaError::Invalid(
                "the logits buffer is not sized yet".into(),
            ));
        }
        let (stream, cc) = (self.dev.stream.clone(), self.dev.compute_capability);
        let ours = self.dev.loaded_functions();
        let mut pass = self.prompt_pass(b, decodes, decode_split, false, true);
        let hp = pass.hp;
        StepGraph::capture(&stream, cc, &ours, || {
            forward(hp, &mut pass)?;
            match pass.grown {
                0 => Ok(()),
                _ => Err(CudaError::Invalid("the captured step allocated".into())),
            }
        })
    }

    /// The argmaxes of the first `n` rows of a batch's logits, left on the device by a
    /// graph.
    fn batch_ids(&mut self, n: usize) -> Result<Logits, CudaError> {
        let bb = self.batch.as_ref().expect("allocated by prefill");
        let ids = self.dev.stream.clone_dtoh(&bb.best.slice(..n))?;
        Ok(Logits::Rows {
            best: ids.into_iter().map(|b| b as u32).collect(),
            on: RowsOn::Batch,
        })
    }

    /// The launches of a prompt batch over `b` (its meta on the device already).
    fn prompt_pass(
        &mut self,
        b: &ForwardBatch,
        decodes: usize,
        decode_split: usize,
        host_logits: bool,
        ids_later: bool,
    ) -> PromptPass<'_> {
        let longest = (decodes..b.n_seqs())
            .map(|s| b.seq_tokens(s).len())
            .max()
            .unwrap_or(1);
        PromptPass {
            dev: &self.dev,
            hp: &self.hp,
            w: &self.w,
            k_cache: &mut self.k_cache,
            v_cache: &mut self.v_cache,
            bb: self.batch.as_mut().expect("allocated by prefill"),
            step: &mut self.step,
            n: b.n_tokens(),
            n_seqs: b.n_seqs(),
            decodes,
            decode_split,
            longest,
            rows: b.logit_rows.iter().map(|&r| r as usize).collect(),
            // Decode steps only: a prompt's rows multiply through the f16 weights whatever
            // their count, so a prompt alone and the same prompt batched get the same logits.
            tile_rows: if decodes == b.n_seqs() {
                self.tile_rows
            } else {
                0
            },
            pool_slots: self.num_blocks * BLOCK_SIZE,
            block_size: BLOCK_SIZE,
            embd_scale: self.embd_scale,
            gelu: self.gelu,
            softcap: self.softcap,
            host_logits,
            ids_later,
            pending: Pending::Nothing,
            logits: None,
            grown: 0,
        }
    }
}

#[cfg(test)]
#[path = "decoder_tests.rs"]
mod tests;
