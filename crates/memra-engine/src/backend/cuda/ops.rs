//! Launch wrappers of the kernels other than the matrix products: element-wise,
//! normalization, rotary, attention, dequantization and embedding, MoE routing, the greedy
//! pick. Each documents the shapes it needs; sizes are checked before launching.

use cudarc::driver::{
    CudaSlice, CudaView, CudaViewMut, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use half::f16;
use memra_gguf::GgmlType;

use super::matvec::{device_type_id, regrouped, DeviceActs};
use super::{env_usize, CudaDevice, CudaError};
pub use crate::models::layers::AttentionShape;

const THREADS: u32 = 256;

/// One thread per element, in blocks of 256.
pub(super) fn grid_1d(n: usize) -> LaunchConfig {
    blocks(n.div_ceil(THREADS as usize).max(1), THREADS)
}

/// `grid` blocks of `threads`, no dynamic shared memory.
pub(super) fn blocks(grid: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn check(ok: bool, what: &str) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::Invalid(what.to_string()))
    }
}

/// `x = rms_norm(x) * w` in place, for `rows` rows of `w.len()`.
pub fn rms_norm_inplace(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    w: &CudaSlice<f32>,
    rows: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let n = w.len();
    check(x.len() >= rows * n, "rms_norm: buffer too small")?;
    let f = dev.function("norm", "rms_norm_inplace_f32")?;
    let cfg = blocks(rows, THREADS);
    let n_i = n as i32;
    // SAFETY: rows x n elements of x, n of w (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(x)
            .arg(w)
            .arg(&n_i)
            .arg(&eps)
            .launch(cfg)?;
    }
    Ok(())
}

/// `y[i] += b[i % b.len()]` for the first `total` elements.
pub fn add_bias(
    dev: &CudaDevice,
    y: &mut CudaSlice<f32>,
    b: &CudaSlice<f32>,
    total: usize,
) -> Result<(), CudaError> {
    check(y.len() >= total && total % b.len() == 0, "add_bias: shapes")?;
    let f = dev.function("elementwise", "add_bias_f32")?;
    let (n_i, t_i) = (b.len() as i32, total as i32);
    // SAFETY: total elements of y, b.len() of b (checked).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(y)
            .arg(b)
            .arg(&n_i)
            .arg(&t_i)
            .launch(grid_1d(total))?;
    }
    Ok(())
}

/// Rotary embedding parameters on the device.
pub struct DeviceRope {
    pub halves: bool,
    pub n_dims: usize,
    pub base: f32,
    pub freq_scale: f32,
    pub freq_factors: Option<CudaSlice<f32>>,
}

/// Checks that the kernels are instantiated for a layer's attention shape: equal key and
/// value widths of 32, 64, 128 or 256, and at most MAX_GROUP query heads per kv head.
pub fn check_shape(s: &AttentionShape) -> Result<(), CudaError> {
    if s.head_dim_k != s.head_dim_v || !matches!(s.head_dim_k, 32 | 64 | 128 | 256) {
        return Err(CudaError::Invalid(format!(
            "attention with key and value heads of {} and {} (the kernels take equal widths \
             of 32, 64, 128 or 256)",
            s.head_dim_k, s.head_dim_v
        )));
    }
    if s.n_head % s.n_head_kv != 0 || s.n_head / s.n_head_kv > MAX_GROUP {
        return Err(CudaError::Invalid(format!(
            "{} query heads over {} kv heads (at most {MAX_GROUP} per kv head)",
            s.n_head, s.n_head_kv
        )));
    }
    Ok(())
}

/// Query heads per kv head the decode kernels handle (the largest `G` in attention.cu).
const MAX_GROUP: usize = 8;

/// Where the sequences of a step keep their keys and values in the paged pool, on the
/// device: per sequence its context length after the step and its block table, padded to
/// `max_blocks` entries (entries past a sequence's blocks are never read).
pub struct PagedKv<'a> {
    pub ctx_len: CudaView<'a, i32>,
    pub block_tables: CudaView<'a, i32>,
    pub max_blocks: usize,
    /// Positions per block: a power of two (16 for the decode kernel).
    pub block_size: usize,
    pub n_seqs: usize,
    /// Slots in the pool (bounds what a block table may point at).
    pub pool_slots: usize,
}

impl PagedKv<'_> {
    /// Checks the layout against the pool and the shape; returns the attention kernels'
    /// integer arguments in their order: max_blocks, log2 of the block size, n_head,
    /// n_head_kv, window.
    fn kernel_ints(
        &self,
        s: &AttentionShape,
        k_cache: &CudaSlice<f16>,
        v_cache: &CudaSlice<f16>,
    ) -> Result<[i32; 5], CudaError> {
        let kv_row = s.n_head_kv * s.head_dim_k;
        check(
            // Any power of two for prompts; the decode kernel checks for its own size.
            self.block_size.is_power_of_two()
                && self.ctx_len.len() >= self.n_seqs
                && self.block_tables.len() >= self.n_seqs * self.max_blocks
                && k_cache.len() >= self.pool_slots * kv_row
                && v_cache.len() >= self.pool_slots * kv_row
                && self.n_seqs > 0,
            "paged attention: layout",
        )?;
        Ok([
            self.max_blocks as i32,
            self.block_size.trailing_zeros() as i32,
            s.n_head as i32,
            s.n_head_kv as i32,
            s.window.unwrap_or(0) as i32,
        ])
    }
}

/// The QK-norms of a layer, where its architecture has them: RMS norms of each q and k
/// head (head_dim weights each) before RoPE.
#[derive(Clone, Copy)]
pub struct QkNorms<'a> {
    pub q: Option<&'a CudaSlice<f32>>,
    pub k: Option<&'a CudaSlice<f32>>,
    pub eps: f32,
}

/// Where [`rope_qk_append`] finds a batch's q, k and v.
pub enum QkvRows<'a> {
    /// Each in its own buffer, q rotated in place.
    Apart {
        k: &'a CudaSlice<f32>,
        v: &'a CudaSlice<f32>,
    },
    /// A fused product's rows, q, k and v side by side in each; q rotated into its own
    /// buffer.
    Fused(&'a CudaSlice<f32>),
    /// A fused product's rows as its runs' split sums (the bias not yet added), which the
    /// kernel adds in part order as the reduce would; q rotated into its own buffer.
    Sums {
        sums: &'a CudaSlice<f32>,
        bias: Option<&'a CudaSlice<f32>>,
        runs: &'a [SumsRun],
    },
}

/// A run of a fused product's columns left as split sums: `cols` columns as `parts`
/// arrays of `slots` rows, from element `offset` of the sums.
#[derive(Clone, Copy, Debug)]
pub struct SumsRun {
    pub cols: usize,
    pub parts: usize,
    pub slots: usize,
    pub offset: usize,
}

/// `QkvSums` in rope.cu.
#[repr(C)]
struct QkvSums {
    sums: u64,
    bias: u64,
    end: [i32; 3],
    parts: [i32; 3],
    slots: [i32; 3],
    off: [i64; 3],
}

// SAFETY: plain data, laid out as the kernel's struct.
unsafe impl DeviceRepr for QkvSums {}

/// Most runs [`QkvRows::Sums`] takes (`QkvSums` in rope.cu).
pub const MAX_SUMS_RUNS: usize = 3;

/// The QK-norms (if any) and RoPE on q and k for `n_tok` tokens, token `t` at position
/// `pos[t]`, then k and v into pool row `slot[t]`. `q`: n_tok x n_head x head_dim (read
/// there too unless the rows are fused), k: n_tok x n_head_kv x head_dim, v likewise;
/// `pos` and `slot` are `n_tok` i32 on the device (a graph replays them), each slot below
/// `pool_slots`.
#[allow(clippy::too_many_arguments)]
pub fn rope_qk_append(
    dev: &CudaDevice,
    q: &mut CudaSlice<f32>,
    rows: QkvRows,
    k_cache: &mut CudaSlice<f16>,
    v_cache: &mut CudaSlice<f16>,
    shape: &AttentionShape,
    r: &DeviceRope,
    norms: QkNorms,
    pos: &CudaView<i32>,
    slot: &CudaView<i32>,
    n_tok: usize,
    pool_slots: usize,
) -> Result<(), CudaError> {
    let (nh, nkv, dk) = (shape.n_head, shape.n_head_kv, shape.head_dim_k);
    let (q_len, kv_len) = (nh * dk, nkv * dk);
    let rows_fit = match &rows {
        QkvRows::Apart { k, v } => k.len() >= n_tok * kv_len && v.len() >= n_tok * kv_len,
        QkvRows::Fused(y) => y.len() >= n_tok * (q_len + 2 * kv_len),
        QkvRows::Sums { sums, bias, runs } => {
            !runs.is_empty()
                && runs.len() <= MAX_SUMS_RUNS
                && runs.iter().map(|r| r.cols).sum::<usize>() == q_len + 2 * kv_len
                && runs.iter().all(|r| {
                    r.parts >= 1
                        && r.slots >= n_tok
                        && sums.len() >= r.offset + r.parts * r.slots * r.cols
                })
                && bias.is_none_or(|b| b.len() >= q_len + 2 * kv_len)
        }
    };
    check(
        q.len() >= n_tok * q_len
            && rows_fit
            && k_cache.len() >= pool_slots * kv_len
            && v_cache.len() >= pool_slots * kv_len
            && dk <= 256
            && dk % 32 == 0
            && r.n_dims <= dk
            && r.n_dims % 2 == 0
            && norms.q.is_none_or(|w| w.len() == dk)
            && norms.k.is_none_or(|w| w.len() == dk)
            && pos.len() >= n_tok
            && slot.len() >= n_tok,
        "rope_qk_append: shapes",
    )?;
    let f = dev.function("rope", "rope_qk_append")?;
    // ROPE_WARPS heads a block of 128 threads, then a thread per v element.
    const ROPE_WARPS: usize = 4;
    let blocks = (nh + nkv).div_ceil(ROPE_WARPS) + (nkv * dk).div_ceil(128);
    let ints = [nh, nkv, dk, dk, r.n_dims].map(|v| v as i32);
    let halves = i32::from(r.halves);
    let null: u64 = 0;
    let cfg = LaunchConfig {
        grid_dim: (blocks as u32, n_tok as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut qkv_sums = QkvSums {
        sums: 0,
        bias: 0,
        end: [0; 3],
        parts: [1; 3],
        slots: [0; 3],
        off: [0; 3],
    };
    // Raw pointers: k and v may sit inside the fused rows, at their columns' offsets.
    let (q_in, k_ptr, v_ptr, ld_q, ld_kv) = match rows {
        QkvRows::Apart { k, v } => (
            q.device_ptr(&dev.stream).0,
            k.device_ptr(&dev.stream).0,
            v.device_ptr(&dev.stream).0,
            q_len,
            kv_len,
        ),
        QkvRows::Fused(y) => {
            let p = y.device_ptr(&dev.stream).0;
            let f32s = |n: usize| (4 * n) as u64;
            let ld = q_len + 2 * kv_len;
            (p, p + f32s(q_len), p + f32s(q_len + kv_len), ld, ld)
        }
        QkvRows::Sums { sums, bias, runs } => {
            qkv_sums.sums = sums.device_ptr(&dev.stream).0;
            qkv_sums.bias = bias.map_or(0, |b| b.device_ptr(&dev.stream).0);
            let mut end = 0;
            for (i, r) in runs.iter().enumerate() {
                end += r.cols;
                qkv_sums.end[i] = end as i32;
                qkv_sums.parts[i] = r.parts as i32;
                qkv_sums.slots[i] = r.slots as i32;
                qkv_sums.off[i] = r.offset as i64;
            }
            // The kernel reads the sums only; q_in is never read.
            let p = q.device_ptr(&dev.stream).0;
            (p, p, p, q_len, kv_len)
        }
    };
    let (ld_q, ld_kv) = (ld_q as i32, ld_kv as i32);
    // SAFETY: the caller keeps every slot below pool_slots, the pool length checked above;
    // every other index is within the shapes checked (heads of at most 256, the kernel's
    // shared rows; fused rows of q_len + 2 kv_len).
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(&q_in)
            .arg(q)
            .arg(&k_ptr)
            .arg(&v_ptr)
            .arg(&ld_q)
            .arg(&ld_kv);
        b.arg(k_cache).arg(v_cache);
        for i in &ints {
            b.arg(i);
        }
        b.arg(pos).arg(slot).arg(&r.base).arg(&r.freq_scale);
        match &r.freq_factors {
            Some(ff) => b.arg(ff),
            None => b.arg(&null),
        };
        b.arg(&halves);
        for w in [norms.q, norms.k] {
            match w {
                Some(w) => b.arg(w),
                None => b.arg(&null),
            };
        }
        b.arg(&norms.eps).arg(&qkv_sums).launch(cfg)?;
    }
    Ok(())
}

/// Keys per split of the decode attention: one 32-key step per warp of the block's two
/// (enough work to hide the merge), and short contexts still spread over several blocks.
/// (`KEYS_PER_SPLIT` in attention.cu too: the kernel gives each sequence its own context's
/// split count.)
pub const KEYS_PER_SPLIT: usize = 64;
/// The most splits (`MAX_SPLITS` in attention.cu, the combine kernel's shared weights):
/// 64-key splits up to depth 8,192 (the kernel rounds a split's share up to
/// 32 keys: at depth 4,096, 64 splits left a third of them empty, 65 do not).
pub const MAX_SPLITS: usize = 128;

/// Splits for a decode step over `n_kv` visible positions (the longest sequence's).
pub fn decode_splits(n_kv: usize) -> usize {
    n_kv.div_ceil(KEYS_PER_SPLIT).clamp(1, MAX_SPLITS)
}

/// Below this many blocks (KV heads x splits x sequences) a decode launch deals each
/// query head a block of its own, with the one-head kernel (`attn_decode_d*_g1`); from it,
/// a block takes its KV head's whole group, reading the keys once. Few heads a warp is less
/// serial work per warp, which is what a short context's step costs (H200 tg128, 8 heads a
/// block -> 2 -> 1: qwen3-30b-a3b 287.6 -> 321.5, llama3-8b 360.5 -> 371.6), but each head
/// reads the keys again (llama3-8b tg128 @ d4096, 520 blocks: 337.4 -> 306.8 from 8 heads
/// to 2). On the H100 (llama3-8b, 128-token prompts, 3 splits, docs/cuda.md), the one-head
/// kernel against the group's: 1 row (24 blocks) 362.7 -> 369.6 t/s, 9 rows (216) 2,123 ->
/// 2,237, 16 rows (384) 3,663 -> 3,672, 32 rows (768) 6,025 -> 5,845; in a second lease,
/// the rule as it is against the group kernel taking one head a block below 128 blocks
/// (the rule before): 1 row 362.3 -> 368.1, 9 rows 2,160 -> 2,184 (two runs each). Models
/// with other groups and KV heads (qwen3-30b-a3b, Gemma, Qwen 0.5B) were not measured.
/// `MEMRA_DECODE_ONE_HEAD_BELOW` sets it, to measure.
const DECODE_ONE_HEAD_BELOW_BLOCKS: usize = 384;

fn decode_one_head_below() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        env_usize("MEMRA_DECODE_ONE_HEAD_BELOW").unwrap_or(DECODE_ONE_HEAD_BELOW_BLOCKS)
    })
}

/// Whether a decode launch of `n_seqs` sequences over `n_split` splits takes the one-head
/// kernel (a block per query head) rather than the group's (a block per KV head).
pub fn decode_one_head(n_head_kv: usize, n_split: usize, n_seqs: usize) -> bool {
    n_head_kv * n_split * n_seqs < decode_one_head_below()
}

/// The decode attention's grid.x: a block per query head with the one-head kernel, else a
/// block per KV head (the kernel derives its heads from gridDim.x).
pub fn decode_grid_x(n_head: usize, n_head_kv: usize, n_split: usize, n_seqs: usize) -> usize {
    match decode_one_head(n_head_kv, n_split, n_seqs) {
        true => n_head,
        false => n_head_kv,
    }
}

/// Decode attention, first half, for one query of each of `kv.n_seqs` sequences: block
/// (kv head and share of its query heads, split, sequence) writes its partial result for
/// that share of the group's query heads into `part_o` (sequences x n_split x n_head x
/// head_dim) and `part_ml` (sequences x n_split x n_head x 2). `q` is sequences x n_head x
/// head_dim.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    dev: &CudaDevice,
    s: &AttentionShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f16>,
    v_cache: &CudaSlice<f16>,
    part_o: &mut CudaSlice<f32>,
    part_ml: &mut CudaSlice<f32>,
    kv: &PagedKv,
    n_split: usize,
) -> Result<(), CudaError> {
    check_shape(s)?;
    let ints = kv.kernel_ints(s, k_cache, v_cache)?;
    // DECODE_BLOCK in attention.cu: the kernel's slot arithmetic is compiled for it.
    check(
        kv.block_size == 16,
        "attention_decode: blocks of 16 positions",
    )?;
    let n = kv.n_seqs;
    check(
        q.len() >= n * s.n_head * s.head_dim_k
            && (1..=MAX_SPLITS).contains(&n_split)
            && part_o.len() >= n * n_split * s.n_head * s.head_dim_k
            && part_ml.len() >= n * n_split * s.n_head * 2,
        "attention_decode: shapes",
    )?;
    let f = dev.function(
        "attention",
        decode_kernel(
            s.head_dim_k,
            s.n_head / s.n_head_kv,
            decode_one_head(s.n_head_kv, n_split, n),
        ),
    )?;
    // Two warps (DECODE_WARPS in attention.cu).
    let cfg = LaunchConfig {
        grid_dim: (
            decode_grid_x(s.n_head, s.n_head_kv, n_split, n) as u32,
            n_split as u32,
            n as u32,
        ),
        block_dim: (64, 1, 1),
        shared_mem_bytes: 0,
    };
    let ns = n_split as i32;
    // SAFETY: shapes checked above; the caller keeps each context length within its
    // sequence's blocks and every block below the pool's.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(part_o)
            .arg(part_ml)
            .arg(&kv.ctx_len)
            .arg(&kv.block_tables);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&s.scale).arg(&ns).launch(cfg)?;
    }
    Ok(())
}

/// The decode attention kernel for heads of `head_dim`: the one-head kernel, or the group
/// kernel compiled for groups of up to 4 or up to [`MAX_GROUP`] (`G` in attention.cu) as
/// `group` needs. The kernel for 8 running a group of 4 took 4% more time at 1 row and 3-4%
/// at 16 and 64 on llama3-8b (H100, docs/cuda.md).
pub fn decode_kernel(head_dim: usize, group: usize, one_head: bool) -> &'static str {
    match (head_dim, one_head, group <= 4) {
        (32, true, _) => "attn_decode_d32_g1",
        (64, true, _) => "attn_decode_d64_g1",
        (128, true, _) => "attn_decode_d128_g1",
        (_, true, _) => "attn_decode_d256_g1",
        (32, false, true) => "attn_decode_d32_g4",
        (64, false, true) => "attn_decode_d64_g4",
        (128, false, true) => "attn_decode_d128_g4",
        (_, false, true) => "attn_decode_d256_g4",
        (32, false, false) => "attn_decode_d32_g8",
        (64, false, false) => "attn_decode_d64_g8",
        (128, false, false) => "attn_decode_d128_g8",
        _ => "attn_decode_d256_g8",
    }
}

/// Decode attention, second half: merges the splits of `n_seqs` sequences into their
/// attention outputs (a row per sequence), quantized for the output projection into `acts`.
pub fn attention_combine(
    dev: &CudaDevice,
    s: &AttentionShape,
    part_o: &CudaSlice<f32>,
    part_ml: &CudaSlice<f32>,
    acts: &mut DeviceActs,
    n_split: usize,
    n_seqs: usize,
) -> Result<(), CudaError> {
    attention_combine_into(dev, s, part_o, part_ml, None, acts, n_split, n_seqs)
}

/// [`attention_combine`], also writing the f32 output into `out` when given.
#[allow(clippy::too_many_arguments)]
pub fn attention_combine_into(
    dev: &CudaDevice,
    s: &AttentionShape,
    part_o: &CudaSlice<f32>,
    part_ml: &CudaSlice<f32>,
    out: Option<&mut CudaSlice<f32>>,
    acts: &mut DeviceActs,
    n_split: usize,
    n_seqs: usize,
) -> Result<(), CudaError> {
    let len = n_seqs * s.n_head * s.head_dim_k;
    check(
        acts.q.len() >= len
            && (1..=MAX_SPLITS).contains(&n_split)
            && part_o.len() >= n_seqs * n_split * s.n_head * s.head_dim_k
            && part_ml.len() >= n_seqs * n_split * s.n_head * 2
            && out.as_ref().is_none_or(|o| o.len() >= len),
        "attention_combine: shapes",
    )?;
    let f = dev.function("attention", "attn_combine")?;
    // SPLIT_GROUPS (4) threads per dimension (attention.cu).
    let mut cfg = blocks(s.n_head, 4 * s.head_dim_k as u32);
    cfg.grid_dim.1 = n_seqs as u32;
    let (nh, d, ns, null) = (s.n_head as i32, s.head_dim_k as i32, n_split as i32, 0u64);
    // SAFETY: n_seqs x n_split x n_head x head_dim partials and n_seqs x n_head x
    // head_dim outputs (checked above).
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(part_o).arg(part_ml);
        match out {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        b.arg(&null)
            .arg(&mut acts.q)
            .arg(&mut acts.d)
            .arg(&mut acts.s)
            .arg(&nh)
            .arg(&d)
            .arg(&ns)
            .launch(cfg)?;
    }
    Ok(())
}

/// Decode attention, second half, for the decodes of a prompt batch: merges the splits of
/// `n_seqs` sequences into rows `0..n_seqs` of `out` (f16, the output projection's GEMM
/// input).
pub fn attention_combine_f16(
    dev: &CudaDevice,
    s: &AttentionShape,
    part_o: &CudaSlice<f32>,
    part_ml: &CudaSlice<f32>,
    out: &mut CudaSlice<f16>,
    n_split: usize,
    n_seqs: usize,
) -> Result<(), CudaError> {
    check(
        out.len() >= n_seqs * s.n_head * s.head_dim_k
            && (1..=MAX_SPLITS).contains(&n_split)
            && part_o.len() >= n_seqs * n_split * s.n_head * s.head_dim_k
            && part_ml.len() >= n_seqs * n_split * s.n_head * 2,
        "attention_combine_f16: shapes",
    )?;
    let f = dev.function("attention", "attn_combine")?;
    let mut cfg = blocks(s.n_head, 4 * s.head_dim_k as u32);
    cfg.grid_dim.1 = n_seqs as u32;
    let (nh, d, ns, null) = (s.n_head as i32, s.head_dim_k as i32, n_split as i32, 0u64);
    // SAFETY: n_seqs x n_split x n_head x head_dim partials and n_seqs x n_head x head_dim
    // outputs (checked above); the f32 and int8 outputs are null.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(part_o)
            .arg(part_ml)
            .arg(&null)
            .arg(out)
            .arg(&null)
            .arg(&null)
            .arg(&null)
            .arg(&nh)
            .arg(&d)
            .arg(&ns)
            .launch(cfg)?;
    }
    Ok(())
}

/// The prompt attention kernel's chooser: the tensor-core kernel for heads of up to
/// MAX_TC_PROMPT_HEAD_DIM dimensions (its accumulators for a 16-row fragment of a 256-wide
/// head would not fit a thread's registers), the CUDA-core one above and where
/// `MEMRA_TC_PROMPT_ATTENTION=0` asks for it (to measure).
const MAX_TC_PROMPT_HEAD_DIM: usize = 128;

fn prompt_attention_on_tensor_cores(head_dim: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    head_dim <= MAX_TC_PROMPT_HEAD_DIM
        && *ON.get_or_init(|| std::env::var("MEMRA_TC_PROMPT_ATTENTION").map_or(true, |v| v != "0"))
}

/// Prompt attention for the chunks of `kv.n_seqs` sequences: sequence `s` has the queries
/// (rows of `q`) `q_start[s]..q_start[s + 1]`, at its last positions (the pool already holds
/// their keys and values); `longest` is the most queries of one sequence. `out` is f16, a
/// row of n_head x head_dim per query.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    dev: &CudaDevice,
    s: &AttentionShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f16>,
    v_cache: &CudaSlice<f16>,
    out: &mut CudaSlice<f16>,
    q_start: &CudaView<i32>,
    kv: &PagedKv,
    n_q: usize,
    longest: usize,
) -> Result<(), CudaError> {
    let tc = prompt_attention_on_tensor_cores(s.head_dim_k);
    attention_prefill_on(
        dev, s, q, k_cache, v_cache, out, q_start, kv, n_q, longest, tc,
    )
}

/// attention_prefill on the kernel chosen by the caller (the test runs both).
#[allow(clippy::too_many_arguments)]
fn attention_prefill_on(
    dev: &CudaDevice,
    s: &AttentionShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f16>,
    v_cache: &CudaSlice<f16>,
    out: &mut CudaSlice<f16>,
    q_start: &CudaView<i32>,
    kv: &PagedKv,
    n_q: usize,
    longest: usize,
    tensor_cores: bool,
) -> Result<(), CudaError> {
    check_shape(s)?;
    let ints = kv.kernel_ints(s, k_cache, v_cache)?;
    let d = s.head_dim_k;
    check(
        q.len() >= n_q * s.n_head * d
            && out.len() >= n_q * s.n_head * d
            && q_start.len() > kv.n_seqs
            && longest <= n_q,
        "attention_prefill: shapes",
    )?;
    let (f, cfg) = if tensor_cores && d <= MAX_TC_PROMPT_HEAD_DIM {
        // attn_prefill_tc: blocks of TC_ROWS (query, head) rows of one KV head; two stages
        // of a key and a value tile, TC_KEYS rows of d + 8 halves each.
        const TC_ROWS: usize = 64;
        const TC_KEYS: usize = 64;
        let name = match d {
            32 => "attn_prefill_tc_d32",
            64 => "attn_prefill_tc_d64",
            _ => "attn_prefill_tc_d128",
        };
        let f = dev.function("attention", name)?;
        let smem = 2 * 2 * TC_KEYS * (d + 8) * 2;
        if smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let group = s.n_head / s.n_head_kv;
        let cfg = LaunchConfig {
            grid_dim: (
                (longest * group).div_ceil(TC_ROWS) as u32,
                s.n_head_kv as u32,
                kv.n_seqs as u32,
            ),
            block_dim: (128, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        (f, cfg)
    } else {
        let name = match d {
            32 => "attn_prefill_d32",
            64 => "attn_prefill_d64",
            128 => "attn_prefill_d128",
            _ => "attn_prefill_d256",
        };
        let f = dev.function("attention", name)?;
        // Shared memory: the query tile (32 x d f32), a key tile (32 rows of d/2 + 1 words)
        // and a value tile (32 x d/2 words); see attn_prefill.
        const QUERIES_PER_BLOCK: usize = 32;
        let smem = 4 * (QUERIES_PER_BLOCK * d + 32 * (d / 2 + 1) + 32 * d / 2);
        if smem > 48 * 1024 {
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )?;
        }
        let cfg = LaunchConfig {
            grid_dim: (
                longest.div_ceil(QUERIES_PER_BLOCK) as u32,
                s.n_head as u32,
                kv.n_seqs as u32,
            ),
            block_dim: (256, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        (f, cfg)
    };
    // SAFETY: shapes checked above; the caller keeps q_start within the n_q rows, each
    // context length within its sequence's blocks and every block below the pool's.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(out)
            .arg(q_start)
            .arg(&kv.ctx_len)
            .arg(&kv.block_tables);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&s.scale).launch(cfg)?;
    }
    Ok(())
}

/// Threads of an `add_norm_f16` block (one a row): enough that a row of a few thousand
/// issues its loads at once (norm.cu).
const ADD_NORM_THREADS: u32 = 1024;

/// What [`add_norm_f16`] adds to each row first: `parts` arrays of rows `stride` floats
/// apart (a product's rows: 1 part; a tile product's split sums, unreduced), summed in part
/// order, times `scale[row]` where given (the gated activation's factors).
#[derive(Clone, Copy)]
pub struct Addend<'a> {
    pub sums: &'a CudaSlice<f32>,
    pub parts: usize,
    pub stride: usize,
    pub scale: Option<&'a CudaSlice<f32>>,
}

impl<'a> Addend<'a> {
    /// Rows of the residual's width, as they are.
    pub fn rows(o: &'a CudaSlice<f32>) -> Self {
        Addend {
            sums: o,
            parts: 1,
            stride: 0,
            scale: None,
        }
    }
}

/// Prompt batches: `x += o` (when given), then the RMS norm of each of `rows` rows times
/// `w`, as f16 into `out`.
pub fn add_norm_f16(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    o: Option<Addend>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f16>,
    rows: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let n = w.len();
    let o_fits = |o: &Addend| {
        o.parts >= 1
            && (o.parts == 1 || o.stride >= rows * n)
            && o.sums.len() >= (o.parts - 1) * o.stride + rows * n
            && o.scale.is_none_or(|s| s.len() >= rows)
    };
    check(
        x.len() >= rows * n && o.as_ref().is_none_or(o_fits) && out.len() >= rows * n,
        "add_norm_f16: shapes",
    )?;
    let f = dev.function("norm", "add_norm_f16")?;
    let cfg = blocks(rows, ADD_NORM_THREADS);
    let (n_i, null) = (n as i32, 0u64);
    let (parts, stride) = o.map_or((0, 0), |o| (o.parts as i32, o.stride as i64));
    // SAFETY: rows x n elements of x and out, of each part of o; rows of the scales; n of
    // w (checked above).
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(x);
        match &o {
            Some(o) => b.arg(o.sums),
            None => b.arg(&null),
        };
        match o.and_then(|o| o.scale) {
            Some(s) => b.arg(s),
            None => b.arg(&null),
        };
        b.arg(w)
            .arg(out)
            .arg(&n_i)
            .arg(&parts)
            .arg(&stride)
            .arg(&eps)
            .launch(cfg)?;
    }
    Ok(())
}

/// Columns of a gated row one block takes (`GATED_CHUNK` of elementwise.cu).
const GATED_CHUNK: usize = 1024;

/// The length of the `scales` buffer [`gated_f16`] needs for `rows` rows of `n`: each row's
/// factor, then each chunk's largest magnitude.
pub fn gated_scales_len(rows: usize, n: usize) -> usize {
    rows * (1 + n.div_ceil(GATED_CHUNK))
}

/// Prompt batches: `out = act(g) * u` as f16 for `rows` rows of `n` (the rows of g and u
/// `ld` apart: n, or 2n where u is the second half of a fused gate/up product's rows);
/// rows whose values would overflow f16 are scaled down, and `scales[row]` gets the factor
/// to apply to the down projection's output ([`scale_rows`]). `scales` holds
/// [`gated_scales_len`] floats.
#[allow(clippy::too_many_arguments)]
pub fn gated_f16(
    dev: &CudaDevice,
    g: &CudaView<f32>,
    u: &CudaView<f32>,
    ld: usize,
    out: &mut CudaSlice<f16>,
    scales: &mut CudaSlice<f32>,
    rows: usize,
    n: usize,
    gelu: bool,
) -> Result<(), CudaError> {
    let total = rows * n;
    let inputs = rows.saturating_sub(1) * ld + n;
    check(
        ld >= n
            && g.len() >= inputs
            && u.len() >= inputs
            && out.len() >= total
            && scales.len() >= gated_scales_len(rows, n)
            && rows <= 65_535,
        "gated_f16: shapes",
    )?;
    if total == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(GATED_CHUNK) as u32, rows as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_i, ld_i, gelu) = (n as i32, ld as i32, i32::from(gelu));
    let amax = dev.function("elementwise", "gated_amax")?;
    let f = dev.function("elementwise", "gated_f16")?;
    // SAFETY: rows x n elements of g, u and out, gated_scales_len of scales (checked
    // above); the grid is the one both kernels index scales by.
    unsafe {
        dev.stream
            .launch_builder(&amax)
            .arg(g)
            .arg(u)
            .arg(&mut *scales)
            .arg(&n_i)
            .arg(&ld_i)
            .arg(&gelu)
            .launch(cfg)?;
        dev.stream
            .launch_builder(&f)
            .arg(g)
            .arg(u)
            .arg(out)
            .arg(scales)
            .arg(&n_i)
            .arg(&ld_i)
            .arg(&gelu)
            .launch(cfg)?;
    }
    Ok(())
}

/// `x[row] *= s[row]` for `rows` rows of `n`.
pub fn scale_rows(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    s: &CudaSlice<f32>,
    rows: usize,
    n: usize,
) -> Result<(), CudaError> {
    check(x.len() >= rows * n && s.len() >= rows, "scale_rows: shapes")?;
    let f = dev.function("elementwise", "scale_rows")?;
    let cfg = blocks(rows, THREADS);
    let n_i = n as i32;
    // SAFETY: rows x n elements of x, rows of s (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(x)
            .arg(s)
            .arg(&n_i)
            .launch(cfg)?;
    }
    Ok(())
}

/// MoE routing of `n_tok` tokens: softmax over `n_exp` router logits, the `n_used` most
/// probable experts into `ids`, their probabilities (renormalized when `normalize`) into
/// `weights` (both `n_tok x n_used`).
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    dev: &CudaDevice,
    logits: &CudaSlice<f32>,
    ids: &mut CudaSlice<i32>,
    weights: &mut CudaSlice<f32>,
    n_tok: usize,
    n_exp: usize,
    n_used: usize,
    normalize: bool,
) -> Result<(), CudaError> {
    check(
        logits.len() >= n_tok * n_exp
            && ids.len() >= n_tok * n_used
            && weights.len() >= n_tok * n_used
            && (1..=16).contains(&n_used)
            && n_used <= n_exp
            && n_exp <= 1024,
        "moe_route: shapes (at most 1024 experts, 16 used)",
    )?;
    // The kernel whose lanes hold enough of the logits (n_exp <= 1024, checked above).
    let name = match n_exp.div_ceil(32) {
        1 => "moe_route_1",
        2 => "moe_route_2",
        3..=4 => "moe_route_4",
        5..=8 => "moe_route_8",
        9..=16 => "moe_route_16",
        _ => "moe_route_32",
    };
    let f = dev.function("moe", name)?;
    let cfg = blocks(n_tok, 32);
    let (ne, nu, norm) = (n_exp as i32, n_used as i32, i32::from(normalize));
    // SAFETY: shapes checked above.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(logits)
            .arg(ids)
            .arg(weights)
            .arg(&ne)
            .arg(&nu)
            .arg(&norm)
            .launch(cfg)?;
    }
    Ok(())
}

/// `out[t] = sum_k weights[t][k] * y[t][k]` for `n_tok` tokens (`y`: `n_tok x n_used x n`).
pub fn moe_combine(
    dev: &CudaDevice,
    y: &CudaSlice<f32>,
    weights: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n_tok: usize,
    n_used: usize,
    n: usize,
) -> Result<(), CudaError> {
    check(
        y.len() >= n_tok * n_used * n && weights.len() >= n_tok * n_used && out.len() >= n_tok * n,
        "moe_combine: shapes",
    )?;
    let f = dev.function("moe", "moe_combine")?;
    // One thread per output element, so that no thread waits on more than its n_used loads.
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(THREADS as usize) as u32, n_tok as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nu, n_i) = (n_used as i32, n as i32);
    // SAFETY: shapes checked above.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(y)
            .arg(weights)
            .arg(out)
            .arg(&nu)
            .arg(&n_i)
            .launch(cfg)?;
    }
    Ok(())
}

/// The ggml type id the device decoders dispatch on, for the types they know.
/// Embedding rows: `out[t] = w[ids[t]] * scale` for `n` tokens (`w`: rows of `ncols`
/// weights of `ty`; ids are checked against `n_rows` by the caller).
#[allow(clippy::too_many_arguments)]
pub fn embed_rows(
    dev: &CudaDevice,
    w: &CudaSlice<u8>,
    ty: GgmlType,
    ids: &CudaView<i32>,
    out: &mut CudaSlice<f32>,
    ncols: usize,
    n: usize,
    scale: f32,
) -> Result<(), CudaError> {
    let ty_id = device_type_id(ty, ncols).ok_or(CudaError::Unsupported {
        op: "embedding",
        ty,
    })?;
    check(
        ids.len() >= n && out.len() >= n * ncols && ncols % 32 == 0,
        "embed_rows: shapes",
    )?;
    let f = dev.function("dequant", "embed_rows")?;
    let cfg = blocks(n, 128);
    let c = ncols as i32;
    // SAFETY: ids index rows of w (checked by the caller against the vocabulary); n rows
    // of out (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(w)
            .arg(&ty_id)
            .arg(ids)
            .arg(out)
            .arg(&c)
            .arg(&scale)
            .launch(cfg)?;
    }
    Ok(())
}

/// Dequantizes `rows` rows of `ncols` weights of `ty` (starting at byte 0 of `w`) to f16.
/// F16 weights need no conversion: the caller uses them as they are.
pub fn dequantize_f16(
    dev: &CudaDevice,
    w: &CudaView<u8>,
    ty: GgmlType,
    out: &mut CudaViewMut<f16>,
    rows: usize,
    ncols: usize,
) -> Result<(), CudaError> {
    let row_bytes = ty.row_bytes(ncols as u64).unwrap_or(0) as usize;
    let n = rows * ncols;
    check(
        row_bytes > 0 && w.len() >= rows * row_bytes && out.len() >= n && ncols % 32 == 0,
        "dequantize_f16: shapes",
    )?;
    let float = |name, out: &mut CudaViewMut<f16>| -> Result<(), CudaError> {
        let f = dev.function("dequant", name)?;
        let n_i = n as i64;
        // SAFETY: n elements in and out (checked above).
        unsafe {
            dev.stream
                .launch_builder(&f)
                .arg(w)
                .arg(out)
                .arg(&n_i)
                .launch(grid_1d(n))?;
        }
        Ok(())
    };
    let name = match ty {
        GgmlType::F32 => return float("dequant_f16_f32", out),
        GgmlType::Bf16 => return float("dequant_f16_bf16", out),
        GgmlType::Q4_0 => "dequant_f16_q4_0",
        GgmlType::Q4_1 => "dequant_f16_q4_1",
        GgmlType::Q5_0 => "dequant_f16_q5_0",
        GgmlType::Q5_1 => "dequant_f16_q5_1",
        GgmlType::Q8_0 if regrouped(ty, ncols) => "dequant_f16_q8_0_r",
        GgmlType::Q6K if regrouped(ty, ncols) => "dequant_f16_q6_k_r",
        GgmlType::Q8_0 => "dequant_f16_q8_0",
        GgmlType::Iq4Nl => "dequant_f16_iq4_nl",
        GgmlType::Q2K => "dequant_f16_q2_k",
        GgmlType::Q3K => "dequant_f16_q3_k",
        GgmlType::Q4K => "dequant_f16_q4_k",
        GgmlType::Q5K => "dequant_f16_q5_k",
        GgmlType::Q6K => "dequant_f16_q6_k",
        GgmlType::Iq4Xs => "dequant_f16_iq4_xs",
        _ => {
            return Err(CudaError::Unsupported {
                op: "dequantize",
                ty,
            })
        }
    };
    let f = dev.function("dequant", name)?;
    let (c, subs) = (ncols as i32, (n / 32) as i64);
    // SAFETY: rows x row_bytes of w and n elements of out (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(w)
            .arg(out)
            .arg(&c)
            .arg(&subs)
            .launch(grid_1d(n / 32))?;
    }
    Ok(())
}

#[cfg(test)]
#[path = "ops_tests.rs"]
mod tests;
