//! The codebook i-quants: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S and IQ1_M.
//! Groups of 4 or 8 weights are an index into a grid of points (`iq_grids.rs`), with signs
//! and a small odd scale per 16 or 32 weights. Layouts follow ggml's `block_iq2_xxs` ...
//! `block_iq1_m` (ggml-common.h), values its `dequantize_row_iq*`.
//!
//! Each block decodes to integer levels with integer scales (the shared `Decoded` form of
//! `kquants.rs`): the fractional factors of ggml's formulas (`(0.5 + s) * 0.25`, the IQ1
//! deltas of 1/8) become powers of two folded into the block scale.

use bytemuck::{Pod, Zeroable};
use half::f16;

use super::iq_grids::*;
use super::kquants::{BlockQ8K, Decoded};
use super::WeightBlock;
use crate::types::{GgmlType, QK_K};

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2Xxs {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2Xs {
    pub d: f16,
    pub qs: [u16; QK_K / 8],
    pub scales: [u8; QK_K / 32],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq2S {
    pub d: f16,
    /// Grid index low bits (32 bytes), then one sign byte per 8 weights (32 bytes).
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub scales: [u8; QK_K / 32],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq3Xxs {
    pub d: f16,
    /// 64 grid indices, then 8 little-endian u32 of signs and scales.
    pub qs: [u8; 3 * QK_K / 8],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq3S {
    pub d: f16,
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub signs: [u8; QK_K / 8],
    pub scales: [u8; QK_K / 64],
}

#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq1S {
    pub d: f16,
    pub qs: [u8; QK_K / 8],
    pub qh: [u16; QK_K / 32],
}

/// IQ1_M keeps its f16 scale in the top nibbles of `scales`.
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
#[repr(C)]
pub struct BlockIq1M {
    pub qs: [u8; QK_K / 8],
    pub qh: [u8; QK_K / 16],
    pub scales: [u8; QK_K / 32],
}

const _: () = {
    assert!(size_of::<BlockIq2Xxs>() == 66);
    assert!(size_of::<BlockIq2Xs>() == 74);
    assert!(size_of::<BlockIq2S>() == 82);
    assert!(size_of::<BlockIq3Xxs>() == 98);
    assert!(size_of::<BlockIq3S>() == 110);
    assert!(size_of::<BlockIq1S>() == 50);
    assert!(size_of::<BlockIq1M>() == 56);
};

/// Eight signs from a 7-bit index: the eighth sign makes the count of minus signs even
/// (ggml `ksigns_iq2xs`).
fn signs_from_7_bits(index: u32) -> u8 {
    let i = (index & 0x7f) as u8;
    i | (((i.count_ones() & 1) as u8) << 7)
}

/// Writes `n` grid values (bytes of `entry`) times their signs to `out`.
fn put(out: &mut [i32], entry: u64, signs: u8, n: usize) {
    for (j, o) in out.iter_mut().enumerate().take(n) {
        let v = i32::from((entry >> (8 * j)) as u8 as i8);
        *o = if signs & (1 << j) != 0 { -v } else { v };
    }
}

impl BlockIq2Xxs {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        for ib in 0..8 {
            let q = &self.qs[4 * ib..4 * ib + 4];
            let indices = u32::from(q[0]) | (u32::from(q[1]) << 16);
            let aux = u32::from(q[2]) | (u32::from(q[3]) << 16);
            let s = 2 * (aux >> 28) as i32 + 1;
            scales[2 * ib] = s;
            scales[2 * ib + 1] = s;
            for l in 0..4 {
                let grid = IQ2XXS_GRID[((indices >> (8 * l)) & 0xff) as usize];
                let signs = signs_from_7_bits(aux >> (7 * l));
                put(&mut levels[32 * ib + 8 * l..], grid, signs, 8);
            }
        }
        Decoded::new(levels, scales, self.d.to_f32() / 8.0)
    }
}

impl BlockIq2Xs {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        for (k, s) in scales.iter_mut().enumerate() {
            *s = 2 * i32::from((self.scales[k / 2] >> (4 * (k % 2))) & 0x0f) + 1;
        }
        for (g, &q) in self.qs.iter().enumerate() {
            let grid = IQ2XS_GRID[(q & 511) as usize];
            put(
                &mut levels[8 * g..],
                grid,
                signs_from_7_bits(u32::from(q >> 9)),
                8,
            );
        }
        Decoded::new(levels, scales, self.d.to_f32() / 8.0)
    }
}

impl BlockIq2S {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        for (k, s) in scales.iter_mut().enumerate() {
            *s = 2 * i32::from((self.scales[k / 2] >> (4 * (k % 2))) & 0x0f) + 1;
        }
        let (low, signs) = self.qs.split_at(QK_K / 8);
        for g in 0..QK_K / 8 {
            let high = u16::from((self.qh[g / 4] >> (2 * (g % 4))) & 3);
            let grid = IQ2S_GRID[(u16::from(low[g]) | (high << 8)) as usize];
            put(&mut levels[8 * g..], grid, signs[g], 8);
        }
        Decoded::new(levels, scales, self.d.to_f32() / 8.0)
    }
}

impl BlockIq3Xxs {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        let (indices, aux) = self.qs.split_at(QK_K / 4);
        for ib in 0..8 {
            let a = u32::from_le_bytes(aux[4 * ib..4 * ib + 4].try_into().expect("4 bytes"));
            let s = 2 * (a >> 28) as i32 + 1;
            scales[2 * ib] = s;
            scales[2 * ib + 1] = s;
            for l in 0..4 {
                let signs = signs_from_7_bits(a >> (7 * l));
                let g1 = u64::from(IQ3XXS_GRID[indices[8 * ib + 2 * l] as usize]);
                let g2 = u64::from(IQ3XXS_GRID[indices[8 * ib + 2 * l + 1] as usize]);
                put(&mut levels[32 * ib + 8 * l..], g1 | (g2 << 32), signs, 8);
            }
        }
        Decoded::new(levels, scales, self.d.to_f32() / 4.0)
    }
}

impl BlockIq3S {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        for (k, s) in scales.iter_mut().enumerate() {
            let ib = k / 2; // one 4-bit scale per 32 weights
            *s = 2 * i32::from((self.scales[ib / 2] >> (4 * (ib % 2))) & 0x0f) + 1;
        }
        for g in 0..QK_K / 8 {
            let index = |i: usize| {
                let high = u16::from((self.qh[i / 8] >> (i % 8)) & 1);
                u64::from(IQ3S_GRID[(u16::from(self.qs[i]) | (high << 8)) as usize])
            };
            let entry = index(2 * g) | (index(2 * g + 1) << 32);
            put(&mut levels[8 * g..], entry, self.signs[g], 8);
        }
        Decoded::new(levels, scales, self.d.to_f32())
    }
}

/// IQ1 values are `grid ± 1/8`: as integers `8 * grid ± 1` with the scale divided by 8.
fn put_iq1(out: &mut [i32], entry: u64, negative_delta: bool) {
    let delta = if negative_delta { -1 } else { 1 };
    for (j, o) in out.iter_mut().enumerate().take(8) {
        *o = 8 * i32::from((entry >> (8 * j)) as u8 as i8) + delta;
    }
}

impl BlockIq1S {
    fn decode(&self) -> Decoded<16> {
        let mut levels = [0i32; QK_K];
        let mut scales = [0i32; 16];
        for (ib, &qh) in self.qh.iter().enumerate() {
            let s = 2 * i32::from((qh >> 12) & 7) + 1;
            scales[2 * ib] = s;
            scales[2 * ib + 1] = s;
            for l in 0..4 {
                let index = u16::from(self.qs[4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8);
                put_iq1(
                    &mut levels[32 * ib + 8 * l..],
                    IQ1S_GRID[index as usize],
                    qh & 0x8000 != 0,
                );
            }
        }
        Decoded::new(levels, scales, self.d.to_f32() / 8.0)
    }
}

impl BlockIq1M {
    fn decode(&self) -> Decoded<16> {
        let sc: [u16; 4] = std::array::from_fn(|i| {
            u16::from_le_bytes([self.scales[2 * i], self.scales[2 * i + 1]])
        });
        let d_bits =
            (sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000);
        let mut scales = [0i32; 16];
        for (k, s) in scales.iter_mut().enumerate() {
            *s = 2 * i32::from((sc[k / 4] >> (3 * (k % 4))) & 7) + 1;
        }
        let mut levels = [0i32; QK_K];
        for g in 0..QK_K / 8 {
            let bits = (self.qh[g / 2] >> (4 * (g % 2))) & 0x0f;
            let index = u16::from(self.qs[g]) | (u16::from(bits & 7) << 8);
            put_iq1(
                &mut levels[8 * g..],
                IQ1S_GRID[index as usize],
                bits & 8 != 0,
            );
        }
        Decoded::new(levels, scales, f16::from_bits(d_bits).to_f32() / 8.0)
    }
}

weight_via_decode! {
    BlockIq2Xxs => GgmlType::Iq2Xxs,
    BlockIq2Xs => GgmlType::Iq2Xs,
    BlockIq2S => GgmlType::Iq2S,
    BlockIq3Xxs => GgmlType::Iq3Xxs,
    BlockIq3S => GgmlType::Iq3S,
    BlockIq1S => GgmlType::Iq1S,
    BlockIq1M => GgmlType::Iq1M,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_table_matches_ggml() {
        // ggml's ksigns_iq2xs starts 0x00, 0x81, 0x82, 0x03 and ends 0x7e, 0xff.
        let t: Vec<u8> = (0..128).map(signs_from_7_bits).collect();
        assert_eq!(&t[..4], &[0x00, 0x81, 0x82, 0x03]);
        assert_eq!(&t[126..], &[0x7e, 0xff]);
        assert!(t.iter().all(|s| s.count_ones() % 2 == 0));
    }
}
