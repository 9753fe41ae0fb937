//! Fast unpacking of the most common 32-element formats (Q4_0, Q5_0, Q8_0) into int8
//! levels with per-16 scales, for the CPU matmul. Every other format takes memra-gguf's
//! reference `unpack_row`, which these must match exactly (tested below).
//!
//! Why: decoding one token reads each weight once, so unpacking is half the work of a
//! decode step. The reference Q5_0 unpacker took 52% of `memra run` time on Qwen2.5 0.5B
//! (perf, 2026-11-30); the AVX2 one below spreads the fifth bits with one shuffle.

use half::f16;
use memra_gguf::quant::{unpack_row, QuantError};
use memra_gguf::GgmlType;

/// Unpacks a row of `ty`: `value[i] = scale16[i/16] * levels[i] - min16[i/16]`.
pub fn unpack(
    ty: GgmlType,
    src: &[u8],
    levels: &mut [i8],
    scale16: &mut [f32],
    min16: &mut [f32],
) -> Result<(), QuantError> {
    #[cfg(target_arch = "x86_64")]
    {
        let fast = matches!(ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0);
        if fast
            && std::is_x86_feature_detected!("avx2")
            && src.len() == levels.len() / 32 * ty.type_size()
            && levels.len() % 32 == 0
        {
            // SAFETY: AVX2 was detected; lengths were checked above.
            unsafe { unpack_avx2(ty, src, levels, scale16, min16) };
            return Ok(());
        }
    }
    unpack_row(ty, src, levels, scale16, min16)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn unpack_avx2(
    ty: GgmlType,
    src: &[u8],
    levels: &mut [i8],
    scale16: &mut [f32],
    min16: &mut [f32],
) {
    use std::arch::x86_64::*;
    let size = ty.type_size();
    min16.fill(0.0);
    let low_nibbles = _mm_set1_epi8(0x0f);
    // Byte i of the 32 takes bit i of the block's 32-bit `qh` (llama.cpp `bytes_from_bits_32`).
    let spread = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bit_select = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let all_ones = _mm256_set1_epi64x(-1);
    let fifth = _mm256_set1_epi8(0x10);
    for (b, block) in src.chunks_exact(size).enumerate() {
        let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
        scale16[2 * b] = d;
        scale16[2 * b + 1] = d;
        let out = levels.as_mut_ptr().add(32 * b) as *mut __m256i;
        match ty {
            GgmlType::Q8_0 => {
                let q = _mm256_loadu_si256(block.as_ptr().add(2) as *const __m256i);
                _mm256_storeu_si256(out, q);
            }
            _ => {
                let qs_at = if ty == GgmlType::Q5_0 { 6 } else { 2 };
                let qs = _mm_loadu_si128(block.as_ptr().add(qs_at) as *const __m128i);
                let lo = _mm_and_si128(qs, low_nibbles);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles);
                let nibbles = _mm256_set_m128i(hi, lo);
                let v = if ty == GgmlType::Q5_0 {
                    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), spread);
                    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit_select), all_ones);
                    let v = _mm256_or_si256(nibbles, _mm256_and_si256(set, fifth));
                    _mm256_sub_epi8(v, _mm256_set1_epi8(16))
                } else {
                    _mm256_sub_epi8(nibbles, _mm256_set1_epi8(8))
                };
                _mm256_storeu_si256(out, v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_unpacking_equals_the_reference() {
        let mut seed = 99u64;
        let mut next = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as u8
        };
        for ty in [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0] {
            let k = 512;
            let mut src: Vec<u8> = (0..k / 32 * ty.type_size()).map(|_| next()).collect();
            for b in src.chunks_exact_mut(ty.type_size()) {
                b[..2].copy_from_slice(&f16::from_f32(0.01 + next() as f32 * 1e-4).to_le_bytes());
            }
            let mut want = (vec![0i8; k], vec![0f32; k / 16], vec![0f32; k / 16]);
            unpack_row(ty, &src, &mut want.0, &mut want.1, &mut want.2).unwrap();
            let mut got = (vec![1i8; k], vec![1f32; k / 16], vec![1f32; k / 16]);
            unpack(ty, &src, &mut got.0, &mut got.1, &mut got.2).unwrap();
            assert_eq!(got, want, "{ty}");
        }
    }
}
