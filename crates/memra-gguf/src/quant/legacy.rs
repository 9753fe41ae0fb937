//! The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, IQ4_NL and MXFP4.
//!
//! Layouts follow ggml's `block_q4_0` ... `block_mxfp4` (ggml/src/ggml-common.h). In every
//! 4-bit format byte `j` of `qs` holds element `j` in its low nibble and element `j + 16`
//! in its high nibble.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::{ActBlock, WeightBlock};
use crate::types::GgmlType;

/// Elements per block of these formats (ggml `QK4_0`, `QK8_0`, ...).
pub const QK: usize = 32;

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_0 {
    pub d: f16,
    /// Fifth bit of each element, element `j` at bit `j` (little-endian u32).
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ5_1 {
    pub d: f16,
    pub m: f16,
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

/// Q8_0 with `s = d * sum(qs)` precomputed, for weights that carry a minimum (Q4_1, Q5_1).
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockQ8_1 {
    pub d: f16,
    pub s: f16,
    pub qs: [i8; QK],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq4Nl {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// OCP microscaling FP4: an E8M0 shared exponent and 32 E2M1 values.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockMxfp4 {
    pub e: u8,
    pub qs: [u8; QK / 2],
}

const _: () = {
    assert!(size_of::<BlockQ4_0>() == 18);
    assert!(size_of::<BlockQ4_1>() == 20);
    assert!(size_of::<BlockQ5_0>() == 22);
    assert!(size_of::<BlockQ5_1>() == 24);
    assert!(size_of::<BlockQ8_0>() == 34);
    assert!(size_of::<BlockQ8_1>() == 36);
    assert!(size_of::<BlockIq4Nl>() == 18);
    assert!(size_of::<BlockMxfp4>() == 17);
};

/// The 16 non-linear levels of IQ4_NL and IQ4_XS (ggml `kvalues_iq4nl`).
pub const IQ4NL_LEVELS: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// E2M1 values times two (ggml `kvalues_mxfp4`); the halving is folded into the scale.
pub const MXFP4_LEVELS: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// An E8M0 exponent as a float, halved to pair with [`MXFP4_LEVELS`]: 2^(e - 128), with
/// e = 0 and 1 landing in the f32 subnormal range exactly as ggml computes it.
pub fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (u32::from(e) - 1) << 23
    };
    f32::from_bits(bits)
}

/// Low and high nibbles of a 4-bit block: elements `j` and `j + 16`.
#[inline]
fn nibbles(qs: &[u8; QK / 2]) -> impl Iterator<Item = (usize, u8, u8)> + '_ {
    qs.iter().enumerate().map(|(j, &b)| (j, b & 0x0f, b >> 4))
}

/// The fifth bits of a Q5 block for elements `j` and `j + 16`, as 0 or 16.
#[inline]
fn fifth_bits(qh: [u8; 4], j: usize) -> (u8, u8) {
    let h = u32::from_le_bytes(qh);
    (
        (((h >> j) & 1) << 4) as u8,
        (((h >> (j + 16)) & 1) << 4) as u8,
    )
}

/// Spreads the 8 bits of a byte to bit 4 of 8 bytes (0x10 or 0x00 each), so a Q5 block's
/// fifth bits join their nibbles with byte operations the compiler vectorizes.
const FIFTH_BITS: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut v = 0u64;
        let mut i = 0;
        while i < 8 {
            if b & (1 << i) != 0 {
                v |= 0x10 << (8 * i);
            }
            i += 1;
        }
        t[b] = v;
        b += 1;
    }
    t
};

/// The 32 levels of a 4-bit block plus `offset`, with optional fifth bits.
#[inline]
fn nibble_levels(qs: &[u8; QK / 2], qh: Option<[u8; 4]>, offset: i8, levels: &mut [i8]) {
    let mut high = [0u8; QK];
    if let Some(qh) = qh {
        for (i, &byte) in qh.iter().enumerate() {
            high[i * 8..i * 8 + 8].copy_from_slice(&FIFTH_BITS[byte as usize].to_le_bytes());
        }
    }
    let levels: &mut [i8; QK] = levels.try_into().expect("32 levels");
    for j in 0..QK / 2 {
        levels[j] = ((qs[j] & 0x0f) | high[j]) as i8 + offset;
        levels[j + 16] = ((qs[j] >> 4) | high[j + 16]) as i8 + offset;
    }
}

/// Writes 32 levels with one scale `d` and offset `-m` for both 16-element halves.
#[inline]
fn unpack32(
    w: [i32; QK],
    d: f32,
    m: f32,
    levels: &mut [i8],
    scale16: &mut [f32],
    min16: &mut [f32],
) {
    for (l, v) in levels.iter_mut().zip(w) {
        *l = v as i8;
    }
    scale16[..2].fill(d);
    min16[..2].fill(-m);
}

/// Integer dot product of 32 weight levels with 32 activation quants.
#[inline]
fn dot_i32(w: &[i32; QK], a: &[i8; QK]) -> i32 {
    w.iter().zip(a).map(|(&w, &a)| w * i32::from(a)).sum()
}

impl WeightBlock for BlockQ4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    type Act = BlockQ8_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (j, lo, hi) in nibbles(&self.qs) {
            out[j] = (i32::from(lo) - 8) as f32 * d;
            out[j + 16] = (i32::from(hi) - 8) as f32 * d;
        }
    }
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            w[j] = i32::from(lo) - 8;
            w[j + 16] = i32::from(hi) - 8;
        }
        dot_i32(&w, &a.qs) as f32 * self.d.to_f32() * a.d.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        nibble_levels(&self.qs, None, -8, levels);
        scale16[..2].fill(self.d.to_f32());
        min16[..2].fill(0.0);
    }
}

impl WeightBlock for BlockQ4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    type Act = BlockQ8_1;
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (j, lo, hi) in nibbles(&self.qs) {
            out[j] = f32::from(lo) * d + m;
            out[j + 16] = f32::from(hi) * d + m;
        }
    }
    fn dot(&self, a: &BlockQ8_1) -> f32 {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            w[j] = lo.into();
            w[j + 16] = hi.into();
        }
        let sumi = dot_i32(&w, &a.qs) as f32;
        self.d.to_f32() * a.d.to_f32() * sumi + self.m.to_f32() * a.s.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        nibble_levels(&self.qs, None, 0, levels);
        scale16[..2].fill(self.d.to_f32());
        min16[..2].fill(-self.m.to_f32());
    }
}

impl BlockQ5_0 {
    fn levels(&self) -> [i32; QK] {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            let (h0, h1) = fifth_bits(self.qh, j);
            w[j] = i32::from(lo | h0) - 16;
            w[j + 16] = i32::from(hi | h1) - 16;
        }
        w
    }
}

impl WeightBlock for BlockQ5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    type Act = BlockQ8_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(self.levels()) {
            *o = q as f32 * d;
        }
    }
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        dot_i32(&self.levels(), &a.qs) as f32 * self.d.to_f32() * a.d.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        nibble_levels(&self.qs, Some(self.qh), -16, levels);
        scale16[..2].fill(self.d.to_f32());
        min16[..2].fill(0.0);
    }
}

impl BlockQ5_1 {
    fn levels(&self) -> [i32; QK] {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            let (h0, h1) = fifth_bits(self.qh, j);
            w[j] = (lo | h0).into();
            w[j + 16] = (hi | h1).into();
        }
        w
    }
}

impl WeightBlock for BlockQ5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    type Act = BlockQ8_1;
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for (o, q) in out.iter_mut().zip(self.levels()) {
            *o = q as f32 * d + m;
        }
    }
    fn dot(&self, a: &BlockQ8_1) -> f32 {
        let sumi = dot_i32(&self.levels(), &a.qs) as f32;
        self.d.to_f32() * a.d.to_f32() * sumi + self.m.to_f32() * a.s.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        nibble_levels(&self.qs, Some(self.qh), 0, levels);
        scale16[..2].fill(self.d.to_f32());
        min16[..2].fill(-self.m.to_f32());
    }
}

/// Q8_0 and Q8_1 weights: int8 values with one scale (Q8_1's stored sum is for its use as
/// an activation; as a weight it is not needed).
macro_rules! int8_weight {
    ($($block:ty => $ty:expr),*) => {$(
        impl WeightBlock for $block {
            const TYPE: GgmlType = $ty;
            type Act = $block;
            fn dequantize(&self, out: &mut [f32]) {
                let d = self.d.to_f32();
                for (o, &q) in out.iter_mut().zip(&self.qs) {
                    *o = f32::from(q) * d;
                }
            }
            fn dot(&self, a: &$block) -> f32 {
                let sumi: i32 = self.qs.iter().zip(&a.qs).map(|(&w, &x)| i32::from(w) * i32::from(x)).sum();
                sumi as f32 * self.d.to_f32() * a.d.to_f32()
            }
            fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
                levels.copy_from_slice(&self.qs);
                scale16[..2].fill(self.d.to_f32());
                min16[..2].fill(0.0);
            }
        }
    )*};
}

int8_weight!(BlockQ8_0 => GgmlType::Q8_0, BlockQ8_1 => GgmlType::Q8_1);

/// Round half away from zero, as C's `roundf` (ggml's activation quantizers use it).
#[inline]
fn round_away(x: f32) -> i32 {
    x.round() as i32
}

/// Quantizes 32 values to int8 with one scale: `d = max|x| / 127`.
fn quantize_q8(x: &[f32]) -> (f32, [i8; QK]) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        *q = round_away(v * id) as i8;
    }
    (d, qs)
}

impl ActBlock for BlockQ8_0 {
    fn quantize(x: &[f32]) -> BlockQ8_0 {
        let (d, qs) = quantize_q8(x);
        BlockQ8_0 {
            d: f16::from_f32(d),
            qs,
        }
    }
}

impl ActBlock for BlockQ8_1 {
    fn quantize(x: &[f32]) -> BlockQ8_1 {
        let (d, qs) = quantize_q8(x);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        BlockQ8_1 {
            d: f16::from_f32(d),
            s: f16::from_f32(sum as f32 * d),
            qs,
        }
    }
}

impl BlockIq4Nl {
    fn levels(&self) -> [i32; QK] {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            w[j] = IQ4NL_LEVELS[lo as usize].into();
            w[j + 16] = IQ4NL_LEVELS[hi as usize].into();
        }
        w
    }
}

impl WeightBlock for BlockIq4Nl {
    const TYPE: GgmlType = GgmlType::Iq4Nl;
    type Act = BlockQ8_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, q) in out.iter_mut().zip(self.levels()) {
            *o = q as f32 * d;
        }
    }
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        dot_i32(&self.levels(), &a.qs) as f32 * self.d.to_f32() * a.d.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        unpack32(self.levels(), self.d.to_f32(), 0.0, levels, scale16, min16);
    }
}

impl BlockMxfp4 {
    fn levels(&self) -> [i32; QK] {
        let mut w = [0i32; QK];
        for (j, lo, hi) in nibbles(&self.qs) {
            w[j] = MXFP4_LEVELS[lo as usize].into();
            w[j + 16] = MXFP4_LEVELS[hi as usize].into();
        }
        w
    }
}

impl WeightBlock for BlockMxfp4 {
    const TYPE: GgmlType = GgmlType::Mxfp4;
    type Act = BlockQ8_0;
    fn dequantize(&self, out: &mut [f32]) {
        let d = e8m0_to_f32_half(self.e);
        for (o, q) in out.iter_mut().zip(self.levels()) {
            *o = q as f32 * d;
        }
    }
    fn dot(&self, a: &BlockQ8_0) -> f32 {
        dot_i32(&self.levels(), &a.qs) as f32 * e8m0_to_f32_half(self.e) * a.d.to_f32()
    }
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
        unpack32(
            self.levels(),
            e8m0_to_f32_half(self.e),
            0.0,
            levels,
            scale16,
            min16,
        );
    }
}
