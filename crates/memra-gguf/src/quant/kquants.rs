//! The 256-element super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_XS,
//! TQ1_0 and TQ2_0.
//!
//! Layouts follow ggml's `block_q2_K` ... `block_tq2_0` (ggml/src/ggml-common.h); the
//! element order inside a block follows ggml's reference `dequantize_row_*`. Each weight
//! block decodes to integer levels plus per-sub-block scales, so the dot products against
//! Q8_K activations run on integers per sub-block, as llama.cpp's CPU kernels do.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::legacy::IQ4NL_LEVELS;
use super::{ActBlock, WeightBlock};
use crate::types::{GgmlType, QK_K};

/// Bytes of packed 6-bit scales and mins in Q4_K and Q5_K (ggml `K_SCALE_SIZE`).
pub const K_SCALE_SIZE: usize = 12;

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ2K {
    /// Per 16 elements: scale in the low nibble, min in the high nibble.
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: f16,
    pub dmin: f16,
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ3K {
    /// The high (third) bit of each element.
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    /// Sixteen 6-bit scales, packed.
    pub scales: [u8; 12],
    pub d: f16,
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    /// Eight 6-bit scales and eight 6-bit mins, packed.
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

/// The activation form k-quant weights are multiplied with: int8 values, an f32 scale and
/// the sums of each 16 values (used to apply the weights' mins without a second pass).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8K {
    pub d: f32,
    pub qs: [i8; QK_K],
    pub bsums: [i16; QK_K / 16],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Xs {
    pub d: f16,
    /// High two bits of the eight 6-bit sub-block scales.
    pub scales_h: u16,
    /// Low four bits of the eight sub-block scales.
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}

/// Ternary weights, five per byte in base 3 (1.6875 bits per weight).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockTq1_0 {
    pub qs: [u8; (QK_K - 4 * QK_K / 64) / 5],
    pub qh: [u8; QK_K / 64],
    pub d: f16,
}

/// Ternary weights, four 2-bit values per byte.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockTq2_0 {
    pub qs: [u8; QK_K / 4],
    pub d: f16,
}

const _: () = {
    assert!(size_of::<BlockQ2K>() == 84);
    assert!(size_of::<BlockQ3K>() == 110);
    assert!(size_of::<BlockQ4K>() == 144);
    assert!(size_of::<BlockQ5K>() == 176);
    assert!(size_of::<BlockQ6K>() == 210);
    assert!(size_of::<BlockQ8K>() == 292);
    assert!(size_of::<BlockIq4Xs>() == 136);
    assert!(size_of::<BlockTq1_0>() == 54);
    assert!(size_of::<BlockTq2_0>() == 66);
};

/// A weight super-block decoded to integer levels: `value[i] = scale[i / group] *
/// level[i] - min[i / group]`, with `group` = 256 / number of scales.
pub(crate) struct Decoded<const GROUPS: usize> {
    levels: [i32; QK_K],
    /// Integer sub-block scales, multiplied by `d`.
    scales: [i32; GROUPS],
    /// Integer sub-block mins, multiplied by `dmin` (zero for formats without mins).
    mins: [i32; GROUPS],
    d: f32,
    dmin: f32,
}

impl<const GROUPS: usize> Decoded<GROUPS> {
    const GROUP: usize = QK_K / GROUPS;

    /// A block without minimums: `value = d * scales[g] * level`.
    pub(crate) fn new(levels: [i32; QK_K], scales: [i32; GROUPS], d: f32) -> Self {
        Decoded {
            levels,
            scales,
            mins: [0; GROUPS],
            d,
            dmin: 0.0,
        }
    }

    pub(crate) fn dequantize(&self, out: &mut [f32]) {
        for (g, chunk) in out.chunks_exact_mut(Self::GROUP).enumerate() {
            let s = self.d * self.scales[g] as f32;
            let m = self.dmin * self.mins[g] as f32;
            for (o, &q) in chunk
                .iter_mut()
                .zip(&self.levels[g * Self::GROUP..(g + 1) * Self::GROUP])
            {
                *o = s * q as f32 - m;
            }
        }
    }

    pub(crate) fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        for (l, &v) in levels.iter_mut().zip(&self.levels) {
            *l = v as i8;
        }
        let per = 16 / GROUPS; // 16-element slices per group
        for j in 0..16 {
            let g = j / per;
            scale16[j] = self.d * self.scales[g] as f32;
            min16[j] = self.dmin * self.mins[g] as f32;
        }
    }

    /// Dot product with a Q8_K block: integer sums per sub-block, scaled once.
    pub(crate) fn dot(&self, a: &BlockQ8K) -> f32 {
        let mut sum_scaled = 0i32;
        let mut sum_mins = 0i32;
        for g in 0..GROUPS {
            let range = g * Self::GROUP..(g + 1) * Self::GROUP;
            let s: i32 = self.levels[range.clone()]
                .iter()
                .zip(&a.qs[range])
                .map(|(&w, &x)| w * i32::from(x))
                .sum();
            sum_scaled += self.scales[g] * s;
            if self.dmin != 0.0 {
                let per = Self::GROUP / 16;
                let bsum: i32 = a.bsums[g * per..(g + 1) * per]
                    .iter()
                    .map(|&b| i32::from(b))
                    .sum();
                sum_mins += self.mins[g] * bsum;
            }
        }
        a.d * (self.d * sum_scaled as f32 - self.dmin * sum_mins as f32)
    }
}

impl BlockQ2K {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        // Each 128-element half uses 32 bytes of qs; shift 0,2,4,6 picks one of four
        // 32-element runs, whose two 16-element halves have their own scales.
        for half in 0..2 {
            let q = &self.qs[half * 32..half * 32 + 32];
            for run in 0..4 {
                for l in 0..32 {
                    levels[half * 128 + run * 32 + l] = i32::from((q[l] >> (2 * run)) & 3);
                }
            }
        }
        Decoded {
            levels,
            scales: self.scales.map(|s| i32::from(s & 0x0f)),
            mins: self.scales.map(|s| i32::from(s >> 4)),
            d: self.d.to_f32(),
            dmin: self.dmin.to_f32(),
        }
    }
}

/// Unpacks Q3_K's sixteen 6-bit scales: low four bits from bytes 0..8, high two bits from
/// bytes 8..12, and an offset of 32.
fn q3k_scales(packed: &[u8; 12]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 {
            packed[i] & 0x0f
        } else {
            packed[i - 8] >> 4
        };
        let high = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = i32::from(low | (high << 4)) - 32;
    }
    out
}

impl BlockQ3K {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        for half in 0..2 {
            let q = &self.qs[half * 32..half * 32 + 32];
            for run in 0..4 {
                let bit = half * 4 + run;
                for l in 0..32 {
                    let low = i32::from((q[l] >> (2 * run)) & 3);
                    let high_set = self.hmask[l] & (1 << bit) != 0;
                    levels[half * 128 + run * 32 + l] = low - if high_set { 0 } else { 4 };
                }
            }
        }
        Decoded {
            levels,
            scales: q3k_scales(&self.scales),
            mins: [0; 16],
            d: self.d.to_f32(),
            dmin: 0.0,
        }
    }
}

/// The 6-bit scale and min of sub-block `j` of Q4_K/Q5_K (ggml `get_scale_min_k4`).
fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (i32, i32) {
    let (d, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    };
    (d.into(), m.into())
}

fn k4_scales_mins(packed: &[u8; K_SCALE_SIZE]) -> ([i32; 8], [i32; 8]) {
    let mut scales = [0i32; 8];
    let mut mins = [0i32; 8];
    for j in 0..8 {
        (scales[j], mins[j]) = scale_min_k4(j, packed);
    }
    (scales, mins)
}

impl BlockQ4K {
    fn decode(&self) -> Decoded<8> {
        let mut levels = [0i32; QK_K];
        // Each 32 bytes of qs hold two 32-element sub-blocks: low nibbles, then high.
        for (c, q) in self.qs.chunks_exact(32).enumerate() {
            for l in 0..32 {
                levels[c * 64 + l] = i32::from(q[l] & 0x0f);
                levels[c * 64 + 32 + l] = i32::from(q[l] >> 4);
            }
        }
        let (scales, mins) = k4_scales_mins(&self.scales);
        Decoded {
            levels,
            scales,
            mins,
            d: self.d.to_f32(),
            dmin: self.dmin.to_f32(),
        }
    }
}

impl BlockQ5K {
    fn decode(&self) -> Decoded<8> {
        let mut levels = [0i32; QK_K];
        for (c, q) in self.qs.chunks_exact(32).enumerate() {
            let (bit_lo, bit_hi) = (1u8 << (2 * c), 1u8 << (2 * c + 1));
            for l in 0..32 {
                let h0 = if self.qh[l] & bit_lo != 0 { 16 } else { 0 };
                let h1 = if self.qh[l] & bit_hi != 0 { 16 } else { 0 };
                levels[c * 64 + l] = i32::from(q[l] & 0x0f) + h0;
                levels[c * 64 + 32 + l] = i32::from(q[l] >> 4) + h1;
            }
        }
        let (scales, mins) = k4_scales_mins(&self.scales);
        Decoded {
            levels,
            scales,
            mins,
            d: self.d.to_f32(),
            dmin: self.dmin.to_f32(),
        }
    }
}

impl BlockQ6K {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        for half in 0..2 {
            let ql = &self.ql[half * 64..half * 64 + 64];
            let qh = &self.qh[half * 32..half * 32 + 32];
            let y = &mut levels[half * 128..half * 128 + 128];
            for l in 0..32 {
                let h = qh[l];
                y[l] = i32::from((ql[l] & 0x0f) | ((h & 3) << 4)) - 32;
                y[l + 32] = i32::from((ql[l + 32] & 0x0f) | (((h >> 2) & 3) << 4)) - 32;
                y[l + 64] = i32::from((ql[l] >> 4) | (((h >> 4) & 3) << 4)) - 32;
                y[l + 96] = i32::from((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32;
            }
        }
        Decoded {
            levels,
            scales: self.scales.map(i32::from),
            mins: [0; 16],
            d: self.d.to_f32(),
            dmin: 0.0,
        }
    }
}

impl BlockIq4Xs {
    fn decode(&self) -> Decoded<8> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 8];
        for (ib, q) in self.qs.chunks_exact(16).enumerate() {
            let low = (self.scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0f;
            let high = ((self.scales_h >> (2 * ib)) & 3) as u8;
            scales[ib] = i32::from(low | (high << 4)) - 32;
            for j in 0..16 {
                levels[ib * 32 + j] = IQ4NL_LEVELS[(q[j] & 0x0f) as usize].into();
                levels[ib * 32 + 16 + j] = IQ4NL_LEVELS[(q[j] >> 4) as usize].into();
            }
        }
        Decoded {
            levels,
            scales,
            mins: [0; 8],
            d: self.d.to_f32(),
            dmin: 0.0,
        }
    }
}

/// A base-3 digit of a TQ1_0 byte: the byte is a fixed-point fraction of 3^5, so
/// multiplying by 3^n (mod 256) and taking the top bits of `q * 3` reads digit n.
fn trit(byte: u8, n: u32) -> i32 {
    let q = byte.wrapping_mul(3u8.pow(n));
    ((u16::from(q) * 3) >> 8) as i32 - 1
}

impl BlockTq1_0 {
    fn decode(&self) -> Decoded<1> {
        let mut levels = [0i32; QK_K];
        let mut i = 0;
        // 32 bytes x 5 digits, then 16 bytes x 5 digits, then 4 bytes x 4 digits.
        for (range, digits) in [(0..32, 5), (32..48, 5)] {
            for n in 0..digits {
                for &b in &self.qs[range.clone()] {
                    levels[i] = trit(b, n);
                    i += 1;
                }
            }
        }
        for n in 0..4 {
            for &b in &self.qh {
                levels[i] = trit(b, n);
                i += 1;
            }
        }
        Decoded {
            levels,
            scales: [1],
            mins: [0],
            d: self.d.to_f32(),
            dmin: 0.0,
        }
    }
}

impl BlockTq2_0 {
    fn decode(&self) -> Decoded<1> {
        let mut levels = [0i32; QK_K];
        for (c, q) in self.qs.chunks_exact(32).enumerate() {
            for shift in 0..4 {
                for (m, &b) in q.iter().enumerate() {
                    levels[c * 128 + shift * 32 + m] = i32::from((b >> (2 * shift)) & 3) - 1;
                }
            }
        }
        Decoded {
            levels,
            scales: [1],
            mins: [0],
            d: self.d.to_f32(),
            dmin: 0.0,
        }
    }
}

weight_via_decode! {
    BlockQ4K => GgmlType::Q4K => fast,
    BlockQ5K => GgmlType::Q5K => fast,
    BlockQ6K => GgmlType::Q6K => fast,
    BlockQ2K => GgmlType::Q2K,
    BlockQ3K => GgmlType::Q3K,
    BlockIq4Xs => GgmlType::Iq4Xs,
    BlockTq1_0 => GgmlType::Tq1_0,
    BlockTq2_0 => GgmlType::Tq2_0,
}

/// Per-16 scales and mins from eight 32-element sub-block scales and mins.
#[inline]
fn k4_affine(
    d: f32,
    dmin: f32,
    packed: &[u8; K_SCALE_SIZE],
    scale16: &mut [f32],
    min16: &mut [f32],
) {
    let (scales, mins) = k4_scales_mins(packed);
    for j in 0..8 {
        scale16[2 * j..2 * j + 2].fill(d * scales[j] as f32);
        min16[2 * j..2 * j + 2].fill(dmin * mins[j] as f32);
    }
}

// The hot k-quants unpack straight to int8 (the `Decoded` path goes through i32).
impl BlockQ4K {
    fn unpack_fast(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        for (q, y) in self.qs.chunks_exact(32).zip(levels.chunks_exact_mut(64)) {
            for l in 0..32 {
                y[l] = (q[l] & 0x0f) as i8;
                y[l + 32] = (q[l] >> 4) as i8;
            }
        }
        k4_affine(
            self.d.to_f32(),
            self.dmin.to_f32(),
            &self.scales,
            scale16,
            min16,
        );
    }
}

impl BlockQ5K {
    fn unpack_fast(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        for (c, (q, y)) in self
            .qs
            .chunks_exact(32)
            .zip(levels.chunks_exact_mut(64))
            .enumerate()
        {
            let (lo_bit, hi_bit) = (2 * c, 2 * c + 1);
            for l in 0..32 {
                let h = self.qh[l];
                y[l] = ((q[l] & 0x0f) | (((h >> lo_bit) & 1) << 4)) as i8;
                y[l + 32] = ((q[l] >> 4) | (((h >> hi_bit) & 1) << 4)) as i8;
            }
        }
        k4_affine(
            self.d.to_f32(),
            self.dmin.to_f32(),
            &self.scales,
            scale16,
            min16,
        );
    }
}

impl BlockQ6K {
    fn unpack_fast(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        for half in 0..2 {
            let ql = &self.ql[half * 64..half * 64 + 64];
            let qh = &self.qh[half * 32..half * 32 + 32];
            let y = &mut levels[half * 128..half * 128 + 128];
            for l in 0..32 {
                let h = qh[l];
                y[l] = ((ql[l] & 0x0f) | ((h & 3) << 4)) as i8 - 32;
                y[l + 32] = ((ql[l + 32] & 0x0f) | (((h >> 2) & 3) << 4)) as i8 - 32;
                y[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
                y[l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let d = self.d.to_f32();
        for (s, &sc) in scale16.iter_mut().zip(&self.scales) {
            *s = d * f32::from(sc);
        }
        min16.fill(0.0);
    }
}

impl WeightBlock for BlockQ8K {
    const TYPE: GgmlType = GgmlType::Q8K;
    type Act = BlockQ8K;
    fn dequantize(&self, out: &mut [f32]) {
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = self.d * f32::from(q);
        }
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        levels.copy_from_slice(&self.qs);
        scale16.fill(self.d);
        min16.fill(0.0);
    }
    fn dot(&self, a: &BlockQ8K) -> f32 {
        let sumi: i32 = self
            .qs
            .iter()
            .zip(&a.qs)
            .map(|(&w, &x)| i32::from(w) * i32::from(x))
            .sum();
        self.d * a.d * sumi as f32
    }
}

impl ActBlock for BlockQ8K {
    /// ggml's `quantize_row_q8_K_ref`: the value of largest magnitude maps to -127, so the
    /// scale's sign follows it; `bsums` holds the sum of each 16 quants.
    fn quantize(x: &[f32]) -> BlockQ8K {
        let mut max = 0f32;
        let mut amax = 0f32;
        for &v in x {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        let mut b = BlockQ8K::zeroed();
        if amax == 0.0 {
            return b;
        }
        let iscale = -127.0 / max;
        for (q, &v) in b.qs.iter_mut().zip(x) {
            // ggml rounds with `nearest_int`, half to even.
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        for (s, q) in b.bsums.iter_mut().zip(b.qs.chunks_exact(16)) {
            *s = q.iter().map(|&v| i16::from(v)).sum();
        }
        b.d = 1.0 / iscale;
        b
    }
}
