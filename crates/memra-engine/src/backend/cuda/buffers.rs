//! Device buffers of the GPU decoder, allocated once (a captured graph points into them):
//! the step's batch description, the decode step's activations (up to
//! [`MAX_DECODE_ROWS`] sequences), and the prompt batches' (up to [`MAX_BATCH`] tokens).

use cudarc::driver::{CudaSlice, CudaView};
use half::f16;

use super::gemm::Gemm;
use super::matvec::{DeviceActs, MAX_MMQ_TOKENS, MAX_TOKENS};
use super::ops::{self, PagedKv, MAX_SPLITS};
use super::sampling::{ArgmaxParts, DeviceSampler};
use super::weights::GpuLayer;
use super::{CudaDevice, CudaError};
use crate::batch::ForwardBatch;

/// Tokens per prompt batch (llama.cpp's default micro-batch); a step with more prompt
/// tokens runs as several batches.
pub const MAX_BATCH: usize = 512;
/// Sequences one decode step takes: the tensor-core kernels' limit (a model with a matrix
/// of a format without them takes [`MAX_MATVEC_ROWS`]).
pub const MAX_DECODE_ROWS: usize = MAX_MMQ_TOKENS;
/// Rows the dp4a mat-vec kernels take, every format.
pub const MAX_MATVEC_ROWS: usize = MAX_TOKENS;
/// Partial results (sequences x splits) a decode step's attention keeps: the longest
/// context's splits for up to MAX_MATVEC_ROWS sequences, fewer splits each for more
/// (`GpuDecoder::decode`), so that 16 rows do not need 16 x 128 splits of partials.
pub const DECODE_PARTS: usize = MAX_SPLITS * MAX_MATVEC_ROWS;
/// Partial results (sequences x splits) the decode attention of a prompt batch's decodes
/// keeps: 8 splits of each of MAX_BATCH decodes, more splits when fewer sequences.
pub const BATCH_DECODE_PARTS: usize = 8 * MAX_BATCH;
/// Weights dequantized to f16 at a time for a prompt GEMM (32 Mi, 64 MiB): a larger matrix goes
/// in chunks of rows. Measured on llama3-8b q4_k_m (docs/cuda.md): the whole largest
/// matrix (112 MiB) 16,183 t/s pp512, 64 MiB 15,728, 32 MiB 14,857.
pub const GEMM_SCRATCH: usize = 32 << 20;

/// Rows per chunk of a matrix of rows of `n_in` in `scratch` weights: a multiple of 256
/// (the GEMM's tiles: chunks of 1,170 rows made pp512 23% slower), at least one row.
pub fn gemm_chunk_rows(scratch: usize, n_in: usize) -> usize {
    let rows = scratch / n_in;
    if rows >= 256 {
        rows / 256 * 256
    } else {
        rows.max(1)
    }
}

/// Device bytes of a buffer.
pub fn bytes_of<T>(s: &CudaSlice<T>) -> usize {
    s.len() * std::mem::size_of::<T>()
}

/// A batch's arrays on the device, at fixed offsets of one buffer (a captured graph reads
/// the same addresses every step): token ids, positions and KV slots per token, query
/// starts, context lengths and block tables (padded to `max_blocks`) per sequence.
pub struct StepMeta {
    buf: CudaSlice<i32>,
    max_tokens: usize,
    max_seqs: usize,
    pub max_blocks: usize,
    host: Vec<i32>,
}

impl StepMeta {
    pub fn new(
        dev: &CudaDevice,
        max_tokens: usize,
        max_seqs: usize,
        max_blocks: usize,
    ) -> Result<StepMeta, CudaError> {
        let len = 3 * max_tokens + 2 * max_seqs + 1 + max_seqs * max_blocks;
        Ok(StepMeta {
            buf: dev.stream.alloc_zeros(len)?,
            max_tokens,
            max_seqs,
            max_blocks,
            host: Vec::with_capacity(len),
        })
    }

    pub fn bytes(&self) -> usize {
        bytes_of(&self.buf)
    }

    fn offsets(&self) -> [usize; 6] {
        let t = self.max_tokens;
        let s = self.max_seqs;
        [0, t, 2 * t, 3 * t, 3 * t + s + 1, 3 * t + 2 * s + 1]
    }

    /// Copies `b`'s arrays to the device: written into a host mirror of the layout, then
    /// one copy of its used prefix (one copy per step, not six: each costs a driver call).
    pub fn fill(&mut self, dev: &CudaDevice, b: &ForwardBatch) -> Result<(), CudaError> {
        let (t, s) = (b.n_tokens(), b.n_seqs());
        if t > self.max_tokens || s > self.max_seqs {
            return Err(CudaError::Invalid(format!(
                "a batch of {t} tokens in {s} sequences (at most {} and {})",
                self.max_tokens, self.max_seqs
            )));
        }
        let mb = self.max_blocks;
        let o = self.offsets();
        let used = o[5] + s * mb;
        self.host.clear();
        self.host.resize(used, 0);
        let h = &mut self.host;
        for (section, values) in [
            (o[0], &b.tokens),
            (o[1], &b.positions),
            (o[2], &b.slots),
            (o[3], &b.query_start),
            (o[4], &b.context_len),
        ] {
            for (d, &v) in h[section..].iter_mut().zip(values.iter()) {
                *d = v as i32;
            }
        }
        for q in 0..s {
            let table = b.block_table(q);
            if table.len() > mb {
                return Err(CudaError::Invalid(format!(
                    "a sequence of {} blocks (at most {mb})",
                    table.len()
                )));
            }
            let row = &mut h[o[5] + q * mb..o[5] + (q + 1) * mb];
            for (d, &v) in row.iter_mut().zip(table) {
                *d = v as i32;
            }
        }
        dev.stream
            .memcpy_htod(&self.host, &mut self.buf.slice_mut(..used))?;
        Ok(())
    }

    pub fn ids(&self) -> CudaView<'_, i32> {
        let o = self.offsets();
        self.buf.slice(o[0]..o[1])
    }

    pub fn pos(&self) -> CudaView<'_, i32> {
        let o = self.offsets();
        self.buf.slice(o[1]..o[2])
    }

    pub fn slots(&self) -> CudaView<'_, i32> {
        let o = self.offsets();
        self.buf.slice(o[2]..o[3])
    }

    /// The query starts of the sequences from `first` on.
    pub fn q_start_from(&self, first: usize) -> CudaView<'_, i32> {
        let o = self.offsets();
        self.buf.slice(o[3] + first..o[4])
    }

    /// The paged layout of the first `n_seqs` sequences.
    pub fn paged(&self, n_seqs: usize, block_size: usize, pool_slots: usize) -> PagedKv<'_> {
        self.paged_from(0, n_seqs, block_size, pool_slots)
    }

    /// The paged layout of `n_seqs` sequences from sequence `first` on.
    pub fn paged_from(
        &self,
        first: usize,
        n_seqs: usize,
        block_size: usize,
        pool_slots: usize,
    ) -> PagedKv<'_> {
        let o = self.offsets();
        PagedKv {
            ctx_len: self.buf.slice(o[4] + first..o[5]),
            block_tables: self.buf.slice(o[5] + first * self.max_blocks..),
            max_blocks: self.max_blocks,
            block_size,
            n_seqs,
            pool_slots,
        }
    }
}

/// Routing and per-expert outputs of MoE layers, for `rows` tokens (minimal for dense
/// models).
pub struct MoeBuffers {
    pub router: CudaSlice<f32>,
    pub ids: CudaSlice<i32>,
    pub weights: CudaSlice<f32>,
    /// The router kernel's count of finished blocks (`moe_router_f32`: its last block
    /// routes, and resets it).
    pub route_counter: CudaSlice<u32>,
    /// tokens x chosen experts x n_embd.
    pub y: CudaSlice<f32>,
    /// The gated activations of the fused expert kernels (tokens x chosen experts x each
    /// expert's width), the down products' input.
    pub gated: DeviceActs,
    /// The grouping of a batch's (token, expert) pairs by expert (prompt batches of layers
    /// whose experts have tile copies).
    pub grouped: Option<GroupedMoe>,
}

/// What `moe_group` writes and the grouped products read (`experts.rs`).
pub struct GroupedMoe {
    /// Each slot's token, each pair's slot.
    pub slot_tok: CudaSlice<i32>,
    pub slot_of: CudaSlice<i32>,
    /// (expert, first slot, count) per tile, and the count of tiles.
    pub tiles: CudaSlice<i32>,
    pub tiles_n: CudaSlice<i32>,
    /// The gated activations' f16 range factors, per slot (and `gated_f16`'s scratch).
    pub scale: CudaSlice<f32>,
}

impl GroupedMoe {
    /// Tiles a batch of `pairs` (token, expert) pairs over `n_exp` experts can need, with
    /// at least 16 slots a tile.
    pub fn max_tiles(pairs: usize, n_exp: usize) -> usize {
        pairs.div_ceil(16) + n_exp.min(pairs)
    }
}

impl MoeBuffers {
    pub fn new(
        dev: &CudaDevice,
        layers: &[GpuLayer],
        rows: usize,
        n_embd: usize,
    ) -> Result<MoeBuffers, CudaError> {
        let experts: Vec<_> = layers.iter().filter_map(|l| l.ffn.experts()).collect();
        let n_exp = experts.iter().map(|x| x.gate.n_expert).max().unwrap_or(0);
        let n_used = experts.iter().map(|x| x.n_used).max().unwrap_or(0);
        let n_ff = experts.iter().map(|x| x.gate.n_out).max().unwrap_or(0);
        let s = &dev.stream;
        let tiles = experts.iter().any(|x| x.gate.tiles.is_some());
        let pairs = rows * n_used;
        let grouped = match tiles && rows > MAX_DECODE_ROWS {
            true => Some(GroupedMoe {
                slot_tok: s.alloc_zeros(pairs)?,
                slot_of: s.alloc_zeros(pairs)?,
                tiles: s.alloc_zeros(3 * GroupedMoe::max_tiles(pairs, n_exp))?,
                tiles_n: s.alloc_zeros(1)?,
                scale: s.alloc_zeros(ops::gated_scales_len(pairs, n_ff))?,
            }),
            false => None,
        };
        Ok(MoeBuffers {
            grouped,
            gated: DeviceActs::new(dev, (rows * n_used * n_ff).next_multiple_of(32).max(32))?,
            router: s.alloc_zeros((rows * n_exp).max(1))?,
            ids: s.alloc_zeros((rows * n_used).max(1))?,
            weights: s.alloc_zeros((rows * n_used).max(1))?,
            route_counter: s.alloc_zeros(1)?,
            y: s.alloc_zeros((rows * n_used * n_embd).max(1))?,
        })
    }

    pub fn bytes(&self) -> usize {
        bytes_of(&self.router)
            + bytes_of(&self.ids)
            + bytes_of(&self.weights)
            + bytes_of(&self.route_counter)
            + bytes_of(&self.y)
            + self.gated.bytes()
            + self.grouped.as_ref().map_or(0, |g| {
                bytes_of(&g.slot_tok)
                    + bytes_of(&g.slot_of)
                    + bytes_of(&g.tiles)
                    + bytes_of(&g.tiles_n)
                    + bytes_of(&g.scale)
            })
    }
}

/// Buffers of a decode step of up to [`MAX_DECODE_ROWS`] sequences (one token each).
pub struct StepBuffers {
    pub meta: StepMeta,
    /// The residual stream, in two buffers that take turns (the fused add + norm reads one
    /// and writes the other).
    pub x: [CudaSlice<f32>; 2],
    pub q: CudaSlice<f32>,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
    pub o: CudaSlice<f32>,
    pub g: CudaSlice<f32>,
    pub u: CudaSlice<f32>,
    pub part_o: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
    pub moe: MoeBuffers,
    /// Rows x n_vocab.
    pub logits: CudaSlice<f32>,
    /// One row of logits, for sampling a row other than the first on the device.
    pub row: CudaSlice<f32>,
    /// Each row's argmax.
    pub best: CudaSlice<i32>,
    pub best_parts: ArgmaxParts,
    pub sampler: DeviceSampler,
    pub acts: DeviceActs,
    /// The constrained rows of a step and their masks (`sampling::mask_rows_on_device`).
    pub mask_list: CudaSlice<u32>,
}

/// The widths a decoder's buffers need.
pub struct Widths {
    pub n_embd: usize,
    pub q_len: usize,
    pub kv_len: usize,
    /// Widest FFN activation of one token (all chosen experts').
    pub ffn: usize,
    pub n_head: usize,
    pub n_vocab: usize,
}

impl Widths {
    fn widest(&self) -> usize {
        self.n_embd.max(self.ffn).max(self.q_len)
    }
}

impl StepBuffers {
    pub fn new(
        dev: &CudaDevice,
        layers: &[GpuLayer],
        w: &Widths,
        max_blocks: usize,
    ) -> Result<StepBuffers, CudaError> {
        let r = MAX_DECODE_ROWS;
        let s = &dev.stream;
        Ok(StepBuffers {
            meta: StepMeta::new(dev, r, r, max_blocks)?,
            x: [s.alloc_zeros(r * w.n_embd)?, s.alloc_zeros(r * w.n_embd)?],
            q: s.alloc_zeros(r * w.q_len)?,
            k: s.alloc_zeros(r * w.kv_len)?,
            v: s.alloc_zeros(r * w.kv_len)?,
            o: s.alloc_zeros(r * w.n_embd)?,
            g: s.alloc_zeros((r * w.ffn).max(1))?,
            u: s.alloc_zeros((r * w.ffn).max(1))?,
            part_o: s.alloc_zeros(DECODE_PARTS * w.q_len)?,
            part_ml: s.alloc_zeros(DECODE_PARTS * w.n_head * 2)?,
            moe: MoeBuffers::new(dev, layers, r, w.n_embd)?,
            logits: s.alloc_zeros(r * w.n_vocab)?,
            row: s.alloc_zeros(w.n_vocab)?,
            best: s.alloc_zeros(r)?,
            best_parts: ArgmaxParts::new(dev)?,
            sampler: DeviceSampler::new(dev)?,
            acts: DeviceActs::with_mmq(dev, r * w.widest().div_ceil(32) * 32)?,
            mask_list: s.alloc_zeros(r * (1 + w.n_vocab.div_ceil(32)))?,
        })
    }

    pub fn bytes(&self) -> usize {
        let f32s = [
            &self.x[0],
            &self.x[1],
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.g,
            &self.u,
            &self.part_o,
            &self.part_ml,
            &self.logits,
            &self.row,
        ];
        f32s.iter().map(|b| bytes_of(b)).sum::<usize>()
            + self.moe.bytes()
            + self.meta.bytes()
            + self.acts.bytes()
            + bytes_of(&self.mask_list)
    }
}

/// Buffers of prompt batches, allocated at the first batch.
pub struct BatchBuffers {
    pub meta: StepMeta,
    pub x: CudaSlice<f32>,
    /// f16 GEMM inputs: normed rows, attention output, gated activations.
    pub xh: CudaSlice<f16>,
    /// The rows whose logits a batch returns, gathered for the output GEMM.
    pub xh_rows: CudaSlice<f16>,
    pub q: CudaSlice<f32>,
    pub k: CudaSlice<f32>,
    pub v: CudaSlice<f32>,
    /// The fused q/k/v products' rows (layers with `qkv16` or `qkv_tiles`), which
    /// `rope_qk_append` reads as they are.
    pub qkv: Option<CudaSlice<f32>>,
    pub o: CudaSlice<f32>,
    pub g: CudaSlice<f32>,
    pub u: CudaSlice<f32>,
    /// Per-row factors undoing the f16 range scaling of the gated activations (and
    /// `gated_f16`'s scratch).
    pub row_scale: CudaSlice<f32>,
    /// One weight matrix dequantized to f16.
    pub w: CudaSlice<f16>,
    /// The split sums of the dense tile products (`qgemm::work_len`).
    pub tile_work: CudaSlice<f32>,
    pub gemm: Gemm,
    /// MoE layers: the FFN input quantized for the expert kernels, and routing.
    pub moe_acts: Option<DeviceActs>,
    pub moe: MoeBuffers,
    /// Logits of the rows asked for (grown as needed), and their argmax.
    pub logits: Option<CudaSlice<f32>>,
    pub best: CudaSlice<i32>,
    /// The decode attention's partial results for the batch's decodes.
    pub part_o: CudaSlice<f32>,
    pub part_ml: CudaSlice<f32>,
}

impl BatchBuffers {
    /// `w_max`: the largest dequantized chunk of a weight matrix (f16 elements);
    /// `tile_work`: the most split sums of a dense tile product (f32 elements).
    pub fn new(
        dev: &CudaDevice,
        layers: &[GpuLayer],
        w: &Widths,
        max_blocks: usize,
        (w_max, tile_work): (usize, usize),
    ) -> Result<BatchBuffers, CudaError> {
        let b = MAX_BATCH;
        let has_experts = layers.iter().any(|l| l.ffn.experts().is_some());
        let fused = layers
            .iter()
            .any(|l| l.qkv16.is_some() || !l.qkv_tiles.is_empty());
        let s = &dev.stream;
        Ok(BatchBuffers {
            meta: StepMeta::new(dev, b, b, max_blocks)?,
            x: s.alloc_zeros(b * w.n_embd)?,
            xh: s.alloc_zeros(b * w.widest())?,
            xh_rows: s.alloc_zeros(b * w.n_embd)?,
            q: s.alloc_zeros(b * w.q_len)?,
            k: s.alloc_zeros(b * w.kv_len)?,
            v: s.alloc_zeros(b * w.kv_len)?,
            qkv: match fused {
                true => Some(s.alloc_zeros(b * (w.q_len + 2 * w.kv_len))?),
                false => None,
            },
            o: s.alloc_zeros(b * w.n_embd)?,
            g: s.alloc_zeros((b * w.ffn).max(1))?,
            u: s.alloc_zeros((b * w.ffn).max(1))?,
            row_scale: s.alloc_zeros(ops::gated_scales_len(b, w.ffn))?,
            w: s.alloc_zeros(w_max.max(1))?,
            tile_work: s.alloc_zeros(tile_work.max(1))?,
            gemm: Gemm::new(dev)?,
            moe_acts: if has_experts {
                Some(DeviceActs::new(
                    dev,
                    b * w.n_embd.max(w.ffn).div_ceil(32) * 32,
                )?)
            } else {
                None
            },
            moe: MoeBuffers::new(dev, layers, b, w.n_embd)?,
            logits: None,
            best: s.alloc_zeros(b)?,
            part_o: s.alloc_zeros(BATCH_DECODE_PARTS * w.q_len)?,
            part_ml: s.alloc_zeros(BATCH_DECODE_PARTS * w.n_head * 2)?,
        })
    }

    pub fn bytes(&self) -> usize {
        let f32s = [
            &self.x,
            &self.q,
            &self.k,
            &self.v,
            &self.o,
            &self.g,
            &self.u,
            &self.part_o,
            &self.part_ml,
            &self.tile_work,
        ];
        f32s.iter().map(|b| bytes_of(b)).sum::<usize>()
            + bytes_of(&self.xh)
            + bytes_of(&self.xh_rows)
            + bytes_of(&self.w)
            + bytes_of(&self.best)
            + self.meta.bytes()
            + self.moe.bytes()
            + self.moe_acts.as_ref().map_or(0, DeviceActs::bytes)
            + self.qkv.as_ref().map_or(0, bytes_of)
    }
}
