//! Quantized matrices in the tile layout of `cu/quant_gemm.cu`, and its f16 tensor-core
//! products: a batch's tokens (or, for experts, the batch's tokens grouped by expert)
//! times the quantized weights, without an f16 copy of the weights or a dequantized
//! scratch.
//!
//! The layout is made on the host at load from the file's blocks ([`repack`]): every
//! weight as `s * u - m`, u an unsigned level of 4 bits (when the matrix's levels span at
//! most 16 values: Q4_K, Q4_0, Q4_1, Q3_K, Q2_K) or 8 (the others: Q6_K, Q8_0, Q5_x, the
//! IQ formats' int8 levels), s and m f16 per row and group of 32 columns (16 where the
//! type's scales are per 16). It costs about 0.63 bytes a weight at 4 bits and 1.13-1.25 at
//! 8, besides the quantized copy the mat-vec kernels read.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg,
};
use half::f16;
use rayon::prelude::*;

use super::ops::check;
use super::{CudaDevice, CudaError};
use memra_gguf::GgmlType;

/// Rows a block of the kernels takes (4 warps of 16).
pub(super) const QG_ROWS: usize = 64;
/// Columns a stage of the kernels stages; rows must be multiples.
pub(super) const QG_KC: usize = 128;
const QG_THREADS: u32 = 128;
/// Fewest blocks a dense product aims at before it splits rows over blocks (two a
/// multiprocessor of the H200's 132), and the most parts it splits a row into. Dense
/// products take the layers of decode steps of a few dozen rows (`GpuWeights::
/// keep_dense_tiles`); the tests check them against the CPU.
pub(super) const QG_SPLIT_BLOCKS: usize = 264;
pub(super) const QG_MAX_SPLIT: usize = 8;

/// A matrix (or a projection's experts, one after the other) in the tile layout, on the host.
pub(super) struct HostTiles {
    pub bits: u32,
    pub group: usize,
    pub n_in: usize,
    pub n_out: usize,
    /// Rows per expert in the layout (n_out rounded up to [`QG_ROWS`]).
    pub rows_pad: usize,
    pub n_expert: usize,
    pub levels: Vec<u8>,
    /// (s, -m) as the bits of an f16 pair, s in the low half.
    pub scales: Vec<u32>,
}

/// `bytes` (`n_expert` matrices of `n_out` rows of `n_in` weights of `ty`, one after the
/// other) in the tile layout; None where the kernels cannot take it (rows not a multiple
/// of [`QG_KC`], a type without integer levels, scales out of f16's range).
pub(super) fn repack(
    ty: GgmlType,
    bytes: &[u8],
    n_in: usize,
    n_out: usize,
    n_expert: usize,
) -> Option<HostTiles> {
    let row_bytes = ty.row_bytes(n_in as u64)? as usize;
    if n_in % QG_KC != 0 || bytes.len() != row_bytes * n_out * n_expert || n_out == 0 {
        return None;
    }
    let rows = n_out * n_expert;
    let g16 = n_in / 16;
    // Every row's levels, per-16 scales and mins.
    let mut levels = vec![0i8; rows * n_in];
    let mut s16 = vec![0f32; rows * g16];
    let mut m16 = vec![0f32; rows * g16];
    levels
        .par_chunks_mut(n_in)
        .zip(s16.par_chunks_mut(g16))
        .zip(m16.par_chunks_mut(g16))
        .enumerate()
        .try_for_each(|(r, ((l, s), m))| {
            let src = &bytes[r * row_bytes..(r + 1) * row_bytes];
            memra_gguf::quant::unpack_row(ty, src, l, s, m).ok()
        })?;
    let (lo, hi) = levels
        .par_iter()
        .fold(|| (i8::MAX, i8::MIN), |(a, b), &v| (a.min(v), b.max(v)))
        .reduce(|| (i8::MAX, i8::MIN), |(a, b), (c, d)| (a.min(c), b.max(d)));
    let bits = if i32::from(hi) - i32::from(lo) < 16 {
        4
    } else {
        8
    };
    let offset = -f32::from(lo);
    let paired = |v: &[f32]| v.par_chunks_exact(2).all(|p| p[0] == p[1]);
    let group = if paired(&s16) && paired(&m16) { 32 } else { 16 };
    let rows_pad = n_out.next_multiple_of(QG_ROWS);
    let (n_chunks, gpc) = (n_in / 64, 64 / group);
    let tile_levels = 16 * n_in * bits as usize / 8;
    let tile_scales = n_chunks * 16 * gpc;
    let tiles = n_expert * rows_pad / 16;
    let mut out_levels = vec![0u8; tiles * tile_levels];
    let mut out_scales = vec![0u32; tiles * tile_scales];
    let ok = out_levels
        .par_chunks_mut(tile_levels)
        .zip(out_scales.par_chunks_mut(tile_scales))
        .enumerate()
        .all(|(t, (lv, sc))| {
            let (e, rt) = (t / (rows_pad / 16), t % (rows_pad / 16));
            // The tile's row i, or None past the expert's rows (zeros).
            let row = |i: usize| {
                let r = rt * 16 + i;
                (r < n_out).then_some(e * n_out + r)
            };
            let level = |i: usize, k: usize| -> u32 {
                row(i).map_or(0, |r| {
                    (i32::from(levels[r * n_in + k]) - i32::from(lo)) as u32
                })
            };
            for ch in 0..n_chunks {
                for lane in 0..32 {
                    let (g, t4) = (lane / 4, lane % 4);
                    for j in 0..4 {
                        let k0 = ch * 64 + 16 * j + 2 * t4;
                        let q = |i: usize, dk: usize| level(i, k0 + dk);
                        let words: [u32; 2] = if bits == 4 {
                            let n = [
                                q(g, 0),
                                q(g + 8, 0),
                                q(g, 8),
                                q(g + 8, 8),
                                q(g, 1),
                                q(g + 8, 1),
                                q(g, 9),
                                q(g + 8, 9),
                            ];
                            [n.iter().enumerate().map(|(i, v)| v << (4 * i)).sum(), 0]
                        } else {
                            let w = |dk: usize| {
                                q(g, dk)
                                    | q(g, dk + 1) << 8
                                    | q(g + 8, dk) << 16
                                    | q(g + 8, dk + 1) << 24
                            };
                            [w(0), w(8)]
                        };
                        // Lane's payload of the chunk: 4 words (4-bit) or 8, as uint4s of
                        // the whole warp one after the other.
                        let wpc = bits as usize / 4;
                        for (wi, &word) in words.iter().enumerate().take(wpc) {
                            let at = j * wpc + wi; // word of the lane's payload
                            let (h, in_h) = (at / 4, at % 4);
                            let byte = ((ch * wpc + h) * 32 + lane) * 16 + 4 * in_h;
                            lv[byte..byte + 4].copy_from_slice(&word.to_le_bytes());
                        }
                    }
                }
                for i in 0..16 {
                    for gi in 0..gpc {
                        let (s, m) = row(i).map_or((0.0, 0.0), |r| {
                            let at = r * g16 + (ch * 64 + gi * group) / 16;
                            (s16[at], m16[at] + offset * s16[at])
                        });
                        let (hs, hm) = (f16::from_f32(s), f16::from_f32(-m));
                        if !hs.is_finite() || !hm.is_finite() {
                            return false;
                        }
                        sc[(ch * 16 + i) * gpc + gi] =
                            u32::from(hs.to_bits()) | u32::from(hm.to_bits()) << 16;
                    }
                }
            }
            true
        });
    ok.then_some(HostTiles {
        bits,
        group,
        n_in,
        n_out,
        rows_pad,
        n_expert,
        levels: out_levels,
        scales: out_scales,
    })
}

impl HostTiles {
    /// Appends `other`'s rows to a dense matrix of the same layout (bits, scale groups,
    /// columns): each tile is self-contained (its matrix's level offset is folded into its
    /// mins), so the layout of the whole is the parts' one after the other. Gives `other`
    /// back where the layouts differ or this matrix's rows are not whole blocks.
    pub(super) fn append(&mut self, other: HostTiles) -> Result<(), HostTiles> {
        let same = (self.bits, self.group, self.n_in) == (other.bits, other.group, other.n_in);
        if !same || self.n_expert != 1 || other.n_expert != 1 || self.rows_pad != self.n_out {
            return Err(other);
        }
        self.levels.extend_from_slice(&other.levels);
        self.scales.extend_from_slice(&other.scales);
        self.n_out += other.n_out;
        self.rows_pad += other.rows_pad;
        Ok(())
    }

    /// Weight (expert `e`, `row`, column `k`) as the kernels compute it (f16 ops).
    #[cfg(test)]
    pub fn value(&self, e: usize, row: usize, k: usize) -> f32 {
        let (rt, i, ch) = (e * self.rows_pad / 16 + row / 16, row % 16, k / 64);
        let (kk, wpc) = (k % 64, self.bits as usize / 4);
        let (j, d) = (kk / 16, kk % 16);
        // Inverse of the lane mapping: k = 16j + 2t + {0, 1, 8, 9}.
        let (t4, hi8, odd) = ((d % 8) / 2, d >= 8, d % 2);
        let (g, lower) = (i % 8, i < 8);
        let lane = g * 4 + t4;
        let tile = 16 * self.n_in * self.bits as usize / 8;
        let word_at = |at: usize| {
            let (h, in_h) = (at / 4, at % 4);
            let b = rt * tile + ((ch * wpc + h) * 32 + lane) * 16 + 4 * in_h;
            u32::from_le_bytes(self.levels[b..b + 4].try_into().unwrap())
        };
        let u = if self.bits == 4 {
            // Nibble index: (row g, k), (g + 8, k), (g, k + 8), (g + 8, k + 8); +4 for k + 1.
            let nib = usize::from(!lower) + 2 * usize::from(hi8) + 4 * odd;
            (word_at(j) >> (4 * nib)) & 15
        } else {
            let byte = odd + 2 * usize::from(!lower);
            (word_at(2 * j + usize::from(hi8)) >> (8 * byte)) & 255
        };
        let gpc = 64 / self.group;
        let gi = kk / self.group;
        let sc = self.scales[(rt * (self.n_in / 64) + ch) * 16 * gpc + i * gpc + gi];
        let s = f16::from_bits(sc as u16);
        let negm = f16::from_bits((sc >> 16) as u16);
        // The kernel's hfma2: one rounding of s * u - m.
        f16::from_f32(f32::from(s) * u as f32 + f32::from(negm)).to_f32()
    }
}

/// A [`HostTiles`] on the device.
pub(super) struct TileMatrix {
    pub levels: CudaSlice<u8>,
    pub scales: CudaSlice<u32>,
    pub bits: u32,
    pub group: usize,
    pub n_in: usize,
    pub n_out: usize,
    pub rows_pad: usize,
    pub n_expert: usize,
}

impl TileMatrix {
    pub(super) fn upload(dev: &CudaDevice, h: &HostTiles) -> Result<TileMatrix, CudaError> {
        Ok(TileMatrix {
            levels: dev.stream.clone_htod(&h.levels)?,
            scales: dev.stream.clone_htod(&h.scales)?,
            bits: h.bits,
            group: h.group,
            n_in: h.n_in,
            n_out: h.n_out,
            rows_pad: h.rows_pad,
            n_expert: h.n_expert,
        })
    }

    pub(super) fn bytes(&self) -> usize {
        self.levels.len() + 4 * self.scales.len()
    }

    /// Parts a dense product splits each row into: by the matrix's shape only.
    pub(super) fn split(&self) -> usize {
        let blocks = self.rows_pad / QG_ROWS;
        QG_SPLIT_BLOCKS
            .div_ceil(blocks)
            .clamp(1, QG_MAX_SPLIT.min(self.n_in / QG_KC))
    }

    fn kernel(&self, nt: usize) -> &'static str {
        match (self.bits, self.group, nt) {
            (4, 32, 2) => "qgemm_b4_g32_n2",
            (4, 32, 4) => "qgemm_b4_g32_n4",
            (4, 32, _) => "qgemm_b4_g32_n8",
            (4, _, 2) => "qgemm_b4_g16_n2",
            (4, _, 4) => "qgemm_b4_g16_n4",
            (4, _, _) => "qgemm_b4_g16_n8",
            (_, 32, 2) => "qgemm_b8_g32_n2",
            (_, 32, 4) => "qgemm_b8_g32_n4",
            (_, 32, _) => "qgemm_b8_g32_n8",
            (_, _, 2) => "qgemm_b8_g16_n2",
            (_, _, 4) => "qgemm_b8_g16_n4",
            _ => "qgemm_b8_g16_n8",
        }
    }

    /// One expert's levels (16-byte units) and scales (f16 pairs) in the layout.
    fn strides(&self) -> (i64, i64) {
        let w = self.rows_pad * self.n_in * self.bits as usize / 8 / 16;
        let s = self.rows_pad * self.n_in / self.group;
        (w as i64, s as i64)
    }
}

/// n-tiles of 8 tokens a block takes for `tokens` tokens (a tile of 16, 32 or 64).
pub(super) fn n_tiles(tokens: usize) -> usize {
    match tokens {
        0..=16 => 2,
        17..=32 => 4,
        _ => 8,
    }
}

/// Work-buffer floats a dense product of `n` tokens needs (split sums).
pub(super) fn work_len(t: &TileMatrix, n: usize) -> usize {
    match t.split() {
        1 => 0,
        s => s * n.next_multiple_of(8 * n_tiles(n)) * t.n_out,
    }
}

/// Stages in flight (`QG_STAGES` of the kernel).
fn stages(nt: usize) -> usize {
    if nt <= 4 {
        4
    } else {
        3
    }
}

/// Shared memory of a launch: per stage the block's activations (8 x nt rows of QG_KC
/// halves) and each warp's levels and scales.
fn shared_bytes(t: &TileMatrix, nt: usize) -> u32 {
    let (wpc, sc) = (t.bits as usize / 4, 64 / t.group / 2);
    let per_stage = 8 * nt * QG_KC * 2 + 4 * (2 * wpc * 32 + 16 * sc) * 16;
    (stages(nt) * per_stage) as u32
}

/// The kernel for `t` at `nt` n-tiles, allowed the shared memory it takes.
fn kernel_fn(
    dev: &CudaDevice,
    t: &TileMatrix,
    nt: usize,
) -> Result<(CudaFunction, u32), CudaError> {
    let f = dev.function("quant_gemm", t.kernel(nt))?;
    let smem = shared_bytes(t, nt);
    if smem > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
    }
    Ok((f, smem))
}

/// Where a dense tile product left its result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Sums {
    /// In `y`, the bias added.
    Done,
    /// As split sums in the work buffer, `parts` arrays of `slots` rows of `n_out`, the
    /// bias not added: for [`reduce`], or a kernel that adds them itself in part order
    /// (`add_norm_f16`).
    Parts { parts: usize, slots: usize },
}

/// `y (n x t.n_out, f32, rows ldy apart) = x (n x t.n_in, f16) . t^T (+ bias)`; `work`
/// takes the split sums ([`work_len`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn qgemm(
    dev: &CudaDevice,
    t: &TileMatrix,
    x: &CudaView<f16>,
    y: &mut CudaViewMut<f32>,
    ldy: usize,
    bias: Option<&CudaView<f32>>,
    work: &mut CudaSlice<f32>,
    n: usize,
) -> Result<(), CudaError> {
    match qgemm_unreduced(dev, t, x, y, ldy, bias, &mut work.slice_mut(..), n)? {
        Sums::Done => Ok(()),
        Sums::Parts { parts, slots } => reduce(dev, work, bias, y, ldy, n, t.n_out, parts, slots),
    }
}

/// [`qgemm`] without the reduce launch: a split product's sums stay in `work`.
#[allow(clippy::too_many_arguments)]
pub(super) fn qgemm_unreduced(
    dev: &CudaDevice,
    t: &TileMatrix,
    x: &CudaView<f16>,
    y: &mut CudaViewMut<f32>,
    ldy: usize,
    bias: Option<&CudaView<f32>>,
    work: &mut CudaViewMut<f32>,
    n: usize,
) -> Result<Sums, CudaError> {
    let (k, m) = (t.n_in, t.n_out);
    check(
        t.n_expert == 1
            && n > 0
            && x.len() >= n * k
            && ldy >= m
            && y.len() >= (n - 1) * ldy + m
            && bias.is_none_or(|b| b.len() >= m)
            && work.len() >= work_len(t, n),
        "qgemm: shapes",
    )?;
    let nt = n_tiles(n);
    let parts = t.split();
    let tiles_y = n.div_ceil(8 * nt);
    let (f, smem) = kernel_fn(dev, t, nt)?;
    let cfg = LaunchConfig {
        grid_dim: ((t.rows_pad / QG_ROWS) as u32, tiles_y as u32, parts as u32),
        block_dim: (QG_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let null = 0u64;
    let (n_i, k_i, m_i, ld_i, zero) = (n as i32, k as i32, m as i32, ldy as i32, 0i64);
    let bias_ptr = match (bias, parts) {
        (Some(b), 1) => b.device_ptr(&dev.stream).0,
        _ => 0,
    };
    // SAFETY: shapes checked above; the layout's rows are padded to whole blocks.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(&t.levels)
            .arg(&t.scales)
            .arg(x)
            .arg(&mut *y)
            .arg(&bias_ptr);
        if parts > 1 {
            b.arg(&mut *work);
        } else {
            b.arg(&null);
        }
        b.arg(&null)
            .arg(&null)
            .arg(&null)
            .arg(&n_i)
            .arg(&k_i)
            .arg(&m_i)
            .arg(&ld_i)
            .arg(&zero)
            .arg(&zero)
            .launch(cfg)?;
    }
    let slots = tiles_y * 8 * nt;
    Ok(match parts {
        1 => Sums::Done,
        _ => Sums::Parts { parts, slots },
    })
}

/// `y[t] = bias + the split sums of token t in part order`, for `n` tokens of `m` outputs.
#[allow(clippy::too_many_arguments)]
pub(super) fn reduce(
    dev: &CudaDevice,
    work: &CudaSlice<f32>,
    bias: Option<&CudaView<f32>>,
    y: &mut CudaViewMut<f32>,
    ldy: usize,
    n: usize,
    m: usize,
    parts: usize,
    slots: usize,
) -> Result<(), CudaError> {
    check(
        n > 0
            && n <= slots
            && work.len() >= parts * slots * m
            && ldy >= m
            && y.len() >= (n - 1) * ldy + m
            && bias.is_none_or(|b| b.len() >= m),
        "qgemm_reduce: shapes",
    )?;
    let f = dev.function("quant_gemm", "qgemm_reduce")?;
    let cfg = LaunchConfig {
        grid_dim: (m.div_ceil(256) as u32, n as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let bias_ptr = bias.map_or(0, |b| b.device_ptr(&dev.stream).0);
    let (n_i, m_i, ld_i, p_i, slots) = (n as i32, m as i32, ldy as i32, parts as i32, slots as i32);
    // SAFETY: the work buffer holds parts x slots x m sums, y n rows ldy apart (checked
    // above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(work)
            .arg(&bias_ptr)
            .arg(y)
            .arg(&n_i)
            .arg(&m_i)
            .arg(&ld_i)
            .arg(&p_i)
            .arg(&slots)
            .launch(cfg)?;
    }
    Ok(())
}

/// The device's grouping of a batch's (token, expert) pairs ([`group_by_expert`]).
pub(super) struct ExpertTiles<'a> {
    pub tiles: &'a CudaSlice<i32>,
    pub tiles_n: &'a CudaSlice<i32>,
    /// Blocks the grid holds for tiles (at least the list's length).
    pub max_tiles: usize,
    /// Tokens a tile holds at most: 8 x n-tiles.
    pub nt: usize,
}

/// Grouped product: for every tile (expert e, slots s0..s0 + count), `y[s] = x[idx[s]] .
/// t_e^T` (`x[s]` without idx).
pub(super) fn qgemm_grouped(
    dev: &CudaDevice,
    t: &TileMatrix,
    x: &CudaView<f16>,
    idx: Option<&CudaSlice<i32>>,
    g: &ExpertTiles,
    y: &mut CudaSlice<f32>,
    slots: usize,
) -> Result<(), CudaError> {
    let (k, m) = (t.n_in, t.n_out);
    check(
        y.len() >= slots * m
            && g.tiles.len() >= 3 * g.max_tiles
            && (idx.is_some() || x.len() >= slots * k)
            && idx.is_none_or(|i| i.len() >= slots)
            && matches!(g.nt, 2 | 4 | 8),
        "qgemm_grouped: shapes",
    )?;
    let (f, smem) = kernel_fn(dev, t, g.nt)?;
    let cfg = LaunchConfig {
        grid_dim: ((t.rows_pad / QG_ROWS) as u32, g.max_tiles as u32, 1),
        block_dim: (QG_THREADS, 1, 1),
        shared_mem_bytes: smem,
    };
    let null = 0u64;
    let idx_ptr = idx.map_or(0, |i| i.device_ptr(&dev.stream).0);
    let (k_i, m_i) = (k as i32, m as i32);
    let (ws, ss) = t.strides();
    // SAFETY: the tile list names experts below n_expert and slots below `slots` (built by
    // `moe_group` from the routing); x holds a row for every index.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(&t.levels)
            .arg(&t.scales)
            .arg(x)
            .arg(y)
            .arg(&null)
            .arg(&null)
            .arg(g.tiles)
            .arg(g.tiles_n)
            .arg(&idx_ptr)
            .arg(&0i32)
            .arg(&k_i)
            .arg(&m_i)
            .arg(&m_i)
            .arg(&ws)
            .arg(&ss)
            .launch(cfg)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::matvec::tests::{lcg, random_weights};
    use super::*;
    use memra_gguf::quant::dequantize_to_vec;
    use GgmlType as G;

    /// Every weight of the layout is the file's weight rounded to f16 (within the rounding
    /// of its f16 scale and min), for each type, rows that fill no block of 64, and several
    /// experts; the chosen level width and scale group follow the type.
    #[test]
    fn repack_keeps_every_weight() {
        let mut seed = 7u64;
        let cases = [
            (G::Q4K, 4, 32),
            (G::Q6K, 8, 16),
            (G::Q8_0, 8, 32),
            (G::Q5_0, 8, 32),
            (G::Q4_0, 4, 32),
            (G::Q5K, 8, 32),
            (G::Q3K, 4, 16),
            (G::Q2K, 4, 16),
            (G::Iq4Nl, 8, 32),
        ];
        for (ty, bits, group) in cases {
            let (n_in, n_out, n_exp) = (256usize, 20usize, 3usize);
            let w = random_weights(ty, n_in, n_out * n_exp, &mut seed);
            let want = dequantize_to_vec(ty, &w).unwrap();
            let h = repack(ty, &w, n_in, n_out, n_exp).expect("repacked");
            assert_eq!((h.bits, h.group, h.rows_pad), (bits, group, 64), "{ty}");
            for e in 0..n_exp {
                for r in 0..n_out {
                    let row = &want[(e * n_out + r) * n_in..][..n_in];
                    let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (k, &v) in row.iter().enumerate() {
                        let got = h.value(e, r, k);
                        assert!(
                            (got - v).abs() <= 2e-3 * amax + 1e-7,
                            "{ty} e{e} r{r} k{k}: {got} vs {v}"
                        );
                    }
                }
            }
        }
        // Rows the stages cannot take, a byte count that is not the shape's.
        let w = random_weights(G::Q8_0, 96, 4, &mut seed);
        assert!(repack(G::Q8_0, &w, 96, 4, 1).is_none());
        let w = random_weights(G::Q8_0, 128, 4, &mut seed);
        assert!(repack(G::Q8_0, &w[..w.len() - 1], 128, 4, 1).is_none());
        assert!(repack(G::Q8_0, &w, 128, 2, 1).is_none());
    }

    /// A layer's q, k and v appended into one matrix keep every weight where they share a
    /// layout; a matrix of another layout, or one after rows that are not whole blocks, is
    /// given back untouched.
    #[test]
    fn appended_matrices_keep_their_weights() {
        let mut seed = 11u64;
        let (n_in, shapes) = (512, [256usize, 64, 64]);
        let parts: Vec<HostTiles> = shapes
            .iter()
            .map(|&rows| {
                let w = random_weights(G::Q4K, n_in, rows, &mut seed);
                repack(G::Q4K, &w, n_in, rows, 1).expect("repacked")
            })
            .collect();
        let copy = |h: &HostTiles| HostTiles {
            levels: h.levels.clone(),
            scales: h.scales.clone(),
            ..*h
        };
        let mut all = copy(&parts[0]);
        for p in &parts[1..] {
            assert!(all.append(copy(p)).is_ok());
        }
        assert_eq!((all.n_out, all.rows_pad), (384, 384));
        let mut r0 = 0;
        for p in &parts {
            for r in 0..p.n_out {
                for k in (0..n_in).step_by(7) {
                    assert_eq!(all.value(0, r0 + r, k), p.value(0, r, k), "row {r0} + {r}");
                }
            }
            r0 += p.n_out;
        }
        // Q6_K's 8-bit levels onto 4-bit ones; rows after 100 (not whole blocks of 64).
        let w = random_weights(G::Q6K, n_in, 64, &mut seed);
        let other = repack(G::Q6K, &w, n_in, 64, 1).unwrap();
        let back = all.append(other).expect_err("another layout");
        assert_eq!((back.bits, back.n_out, all.n_out), (8, 64, 384));
        let w = random_weights(G::Q4K, n_in, 100, &mut seed);
        let mut short = repack(G::Q4K, &w, n_in, 100, 1).unwrap();
        assert!(short.append(copy(&parts[1])).is_err());
    }

    /// f16 activations in [-1, 1], and their values.
    fn random_acts(n: usize, seed: &mut u64) -> Vec<f16> {
        (0..n)
            .map(|_| f16::from_f32((lcg(seed) % 20001) as f32 / 10000.0 - 1.0))
            .collect()
    }

    /// `sum_k w(e, r, k) x[k]` in f64 with the layout's weights, and the sum of magnitudes.
    fn reference(h: &HostTiles, e: usize, r: usize, x: &[f16]) -> (f64, f64) {
        (0..h.n_in).fold((0.0, 0.0), |(s, a), k| {
            let p = f64::from(h.value(e, r, k)) * f64::from(x[k].to_f32());
            (s + p, a + p.abs())
        })
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_qgemm_matches_the_cpu_reference() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 31u64;
        // (type, n_in, n_out): split and not, rows that fill no block, 4- and 8-bit, per-16
        // and per-32 scales.
        let shapes = [
            (G::Q4K, 1024, 100),
            (G::Q6K, 512, 64),
            (G::Q8_0, 2048, 300),
            (G::Q5_0, 896, 40),
            (G::Q3K, 256, 17000),
        ];
        for (ty, n_in, rows) in shapes {
            let w = random_weights(ty, n_in, rows, &mut seed);
            let mut h = repack(ty, &w, n_in, rows, 1).expect("repacked");
            // A second matrix of the type appended where the first's rows are whole blocks
            // (as a layer's q, k and v are), refused where they are not.
            let more = random_weights(ty, n_in, 72, &mut seed);
            let more = repack(ty, &more, n_in, 72, 1).expect("repacked");
            assert_eq!(h.append(more).is_ok(), rows % QG_ROWS == 0, "{ty} {rows}");
            let n_out = h.n_out;
            let t = TileMatrix::upload(&dev, &h).unwrap();
            let bias: Vec<f32> = (0..n_out).map(|i| i as f32 * 0.01 - 0.3).collect();
            let bd = dev.stream.clone_htod(&bias).unwrap();
            // Rows of y wider than the product, which starts at a column offset: the
            // columns around it keep their values.
            let (ld, at, fill) = (n_out + 5, 3, 7.5f32);
            for n in [1usize, 5, 16, 17, 40, 64, 100] {
                let x = random_acts(n * n_in, &mut seed);
                let xd = dev.stream.clone_htod(&x).unwrap();
                let mut y = dev.stream.clone_htod(&vec![fill; n * ld]).unwrap();
                let mut work = dev
                    .stream
                    .alloc_zeros::<f32>(work_len(&t, n).max(1))
                    .unwrap();
                let b = (n % 2 == 1).then(|| bd.slice(..));
                let mut yv = y.slice_mut(at..);
                qgemm(
                    &dev,
                    &t,
                    &xd.slice(..),
                    &mut yv,
                    ld,
                    b.as_ref(),
                    &mut work,
                    n,
                )
                .unwrap();
                let got = dev.stream.clone_dtoh(&y).unwrap();
                for tok in 0..n {
                    for (c, &g) in got[tok * ld..][..ld].iter().enumerate() {
                        let Some(r) = c.checked_sub(at).filter(|&r| r < n_out) else {
                            assert_eq!(g, fill, "{ty} n{n} t{tok} column {c} written");
                            continue;
                        };
                        let (want, mag) = reference(&h, 0, r, &x[tok * n_in..][..n_in]);
                        let want = want + b.as_ref().map_or(0.0, |_| f64::from(bias[r]));
                        let g = f64::from(g);
                        assert!(
                            (g - want).abs() <= 1e-4 * mag + 1e-5,
                            "{ty} {n_in}x{n_out} n{n} t{tok} r{r}: {g} vs {want} (split {})",
                            t.split()
                        );
                    }
                }
            }
        }
        // Too few activations, a work buffer too small for the split.
        let w = random_weights(G::Q4K, 256, 64, &mut seed);
        let t = TileMatrix::upload(&dev, &repack(G::Q4K, &w, 256, 64, 1).unwrap()).unwrap();
        let xd = dev.stream.alloc_zeros::<f16>(256 * 3).unwrap();
        let mut y = dev.stream.alloc_zeros::<f32>(64 * 4).unwrap();
        let mut work = dev.stream.alloc_zeros::<f32>(1).unwrap();
        let x = xd.slice(..);
        assert!(qgemm(&dev, &t, &x, &mut y.slice_mut(..), 64, None, &mut work, 4).is_err());
        assert!(qgemm(&dev, &t, &x, &mut y.slice_mut(..), 64, None, &mut work, 3).is_err());
        // Rows closer than the product's width, and too few of them for the stride.
        let mut work = dev.stream.alloc_zeros::<f32>(work_len(&t, 3)).unwrap();
        assert!(qgemm(&dev, &t, &x, &mut y.slice_mut(..), 63, None, &mut work, 3).is_err());
        assert!(qgemm(&dev, &t, &x, &mut y.slice_mut(..), 100, None, &mut work, 3).is_err());
        qgemm(&dev, &t, &x, &mut y.slice_mut(..), 64, None, &mut work, 3).unwrap();
    }

    /// The grouped products and the routing's grouping (`moe_group`) against the reference
    /// per (token, expert) pair: random routes, some experts never chosen, tiles of 16, 32
    /// and 64 slots, the slot order checked as a permutation.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_grouped_qgemm_matches_the_cpu_reference() {
        use super::super::buffers::GroupedMoe;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 37u64;
        let (n_exp, k) = (12usize, 3usize);
        for (ty, n_in, n_out) in [(G::Q4K, 512, 128), (G::Q6K, 256, 192), (G::Q8_0, 384, 64)] {
            let w = random_weights(ty, n_in, n_out * n_exp, &mut seed);
            let h = repack(ty, &w, n_in, n_out, n_exp).expect("repacked");
            let t = TileMatrix::upload(&dev, &h).unwrap();
            for n in [6usize, 40, 200] {
                let pairs = n * k;
                // Distinct experts a token, drawn from the first 10 (2 never chosen).
                let ids: Vec<i32> = (0..n)
                    .flat_map(|_| {
                        let mut c: Vec<i32> = Vec::new();
                        while c.len() < k {
                            let e = (lcg(&mut seed) % 10) as i32;
                            if !c.contains(&e) {
                                c.push(e);
                            }
                        }
                        c
                    })
                    .collect();
                let x = random_acts(n * n_in, &mut seed);
                let xd = dev.stream.clone_htod(&x).unwrap();
                let idd = dev.stream.clone_htod(&ids).unwrap();
                let s = &dev.stream;
                let mut gm = GroupedMoe {
                    slot_tok: s.alloc_zeros(pairs).unwrap(),
                    slot_of: s.alloc_zeros(pairs).unwrap(),
                    tiles: s
                        .alloc_zeros(3 * GroupedMoe::max_tiles(pairs, n_exp))
                        .unwrap(),
                    tiles_n: s.alloc_zeros(1).unwrap(),
                    scale: s.alloc_zeros(pairs).unwrap(),
                };
                let nt = n_tiles(pairs.div_ceil(n_exp));
                super::super::experts::tests::group(&dev, &idd, &mut gm, pairs, k, n_exp, 8 * nt);
                let et = ExpertTiles {
                    tiles: &gm.tiles,
                    tiles_n: &gm.tiles_n,
                    max_tiles: pairs.div_ceil(8 * nt) + n_exp.min(pairs),
                    nt,
                };
                let mut y = s.alloc_zeros::<f32>(pairs * n_out).unwrap();
                qgemm_grouped(
                    &dev,
                    &t,
                    &xd.slice(..),
                    Some(&gm.slot_tok),
                    &et,
                    &mut y,
                    pairs,
                )
                .unwrap();
                let got = s.clone_dtoh(&y).unwrap();
                let slot_of = s.clone_dtoh(&gm.slot_of).unwrap();
                let slot_tok = s.clone_dtoh(&gm.slot_tok).unwrap();
                let mut seen = vec![false; pairs];
                for (p, &sl) in slot_of.iter().enumerate() {
                    let sl = sl as usize;
                    assert!(!seen[sl], "slot {sl} twice");
                    seen[sl] = true;
                    assert_eq!(slot_tok[sl] as usize, p / k);
                    let (tok, e) = (p / k, ids[p] as usize);
                    for r in 0..n_out {
                        let (want, mag) = reference(&h, e, r, &x[tok * n_in..][..n_in]);
                        let g = f64::from(got[sl * n_out + r]);
                        assert!(
                            (g - want).abs() <= 1e-4 * mag + 1e-5,
                            "{ty} n{n} pair {p} e{e} r{r}: {g} vs {want}"
                        );
                    }
                }
                // Slots of one expert are consecutive, experts in order.
                let by_slot: Vec<i32> = {
                    let mut v = vec![0; pairs];
                    for (p, &sl) in slot_of.iter().enumerate() {
                        v[sl as usize] = ids[p];
                    }
                    v
                };
                assert!(by_slot.windows(2).all(|w| w[0] <= w[1]), "{by_slot:?}");
            }
        }
    }

    /// The dense products' time on llama3-8b's shapes against cuBLAS on f16 weights of the
    /// same shape, for the token counts of batched decode:
    /// `--ignored gpu_qgemm_speed --nocapture`. Median of 10 runs of 20 launches back to
    /// back, the weights rotating through copies larger than L2 together.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_qgemm_speed() {
        use super::super::gemm::Gemm;
        let dev = CudaDevice::new(0).expect("GPU");
        let gemm = Gemm::new(&dev).unwrap();
        let mut seed = 41u64;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let time = |run: &mut dyn FnMut(usize)| {
            let mut times = Vec::new();
            let mut i = 0;
            for rep in 0..12 {
                let start = dev.stream.record_event(timing).unwrap();
                for _ in 0..20 {
                    i += 1;
                    run(i);
                }
                let end = dev.stream.record_event(timing).unwrap();
                if rep >= 2 {
                    times.push(f64::from(start.elapsed_ms(&end).unwrap()) / 20.0 * 1e3);
                }
            }
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        };
        // (type, n_in, n_out): q/k/v together, the output projection, gate and up together,
        // down, the Q6_K down of some layers, the output head.
        let shapes = [
            (G::Q4K, 4096usize, 6144usize),
            (G::Q4K, 4096, 4096),
            (G::Q4K, 4096, 28672),
            (G::Q4K, 14336, 4096),
            (G::Q6K, 14336, 4096),
            (G::Q6K, 4096, 128256),
        ];
        for (ty, n_in, n_out) in shapes {
            let w = random_weights(ty, n_in, n_out, &mut seed);
            let h = repack(ty, &w, n_in, n_out, 1).unwrap();
            let copies = (300_000_000 / h.levels.len()).clamp(1, 8);
            let tiles: Vec<_> = (0..copies)
                .map(|_| TileMatrix::upload(&dev, &h).unwrap())
                .collect();
            let f16_copies = (300_000_000 / (2 * n_in * n_out)).clamp(1, 8);
            let w16: Vec<_> = (0..f16_copies)
                .map(|_| dev.stream.alloc_zeros::<f16>(n_in * n_out).unwrap())
                .collect();
            for n in [9usize, 16, 32, 64, 128, 256] {
                let x = random_acts(n * n_in, &mut seed);
                let xd = dev.stream.clone_htod(&x).unwrap();
                let mut y = dev.stream.alloc_zeros::<f32>(n * n_out).unwrap();
                let mut work = dev
                    .stream
                    .alloc_zeros::<f32>(work_len(&tiles[0], n).max(1))
                    .unwrap();
                let q = time(&mut |i| {
                    let t = &tiles[i % copies];
                    let mut yv = y.slice_mut(..);
                    qgemm(&dev, t, &xd.slice(..), &mut yv, n_out, None, &mut work, n).unwrap();
                });
                let c = time(&mut |i| {
                    let wv = w16[i % f16_copies].slice(..);
                    gemm.f16_f32(&dev, &wv, &xd.slice(..), &mut y, 0, n_out, n, n_in, n_out)
                        .unwrap();
                });
                eprintln!(
                    "{ty} {n_in}x{n_out}, {n} tokens: tile layout {q:.1} us ({:.2} TB/s, split {}), \
                     cuBLAS f16 {c:.1} us ({:.2} TB/s)",
                    tiles[0].bytes() as f64 / q / 1e6,
                    tiles[0].split(),
                    (2 * n_in * n_out) as f64 / c / 1e6,
                );
            }
        }
    }
}
