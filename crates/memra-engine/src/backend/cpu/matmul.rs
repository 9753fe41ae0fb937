//! Matrix products on quantized weights, on the CPU.
//!
//! Activations are quantized to int8 the way llama.cpp's CPU backend does for the weight's
//! type (Q8_0-style blocks of 32 for the 32-element formats, Q8_K-style blocks of 256 for
//! the k-quants), and each weight row is unpacked once into int8 levels with an affine map
//! per 16 elements (`memra_gguf::quant::unpack_row`). One integer kernel then serves every
//! weight type: per 32 elements an int8 dot product (AVX2 `maddubs` where available),
//! scaled in f32. F32/F16/BF16 weights take an f32 path.

use memra_gguf::quant::{activation_type, dequantize};

use super::unpack::unpack;
use crate::models::weights::WeightRows;
use memra_gguf::GgmlType;
use rayon::prelude::*;

/// How activations are quantized for a weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActFormat {
    /// ggml Q8_0/Q8_1: a scale per 32 values, `roundf` rounding.
    Block32,
    /// ggml Q8_K: a scale per 256 values, the largest magnitude at -127, ties to even.
    Block256,
    /// No quantization: f32 weights paths.
    F32,
}

impl ActFormat {
    pub fn for_weight(ty: GgmlType) -> ActFormat {
        // A diagnostic: `MEMRA_CPU_F32_ACTIVATIONS=1` multiplies dequantized weights with
        // unrounded f32 activations, the most precise reference the engine offers (slow);
        // it tells rounding sensitivity from bugs (docs/cuda.md).
        static F32_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        if *F32_ONLY
            .get_or_init(|| std::env::var("MEMRA_CPU_F32_ACTIVATIONS").is_ok_and(|v| v == "1"))
        {
            return ActFormat::F32;
        }
        match activation_type(ty) {
            Some(GgmlType::Q8_0 | GgmlType::Q8_1) => ActFormat::Block32,
            Some(GgmlType::Q8K) => ActFormat::Block256,
            _ => ActFormat::F32,
        }
    }
}

/// `t` rows of `k` activations quantized to int8.
pub struct QuantizedActs {
    pub format: ActFormat,
    pub k: usize,
    pub qs: Vec<i8>,
    /// Scale of each 32 values (for 256-blocks, repeated 8 times).
    pub d32: Vec<f32>,
    /// `scale * sum(q)` of each 16 values, to apply weight minimums.
    pub sum16: Vec<f32>,
}

impl QuantizedActs {
    pub fn new(x: &[f32], k: usize, format: ActFormat) -> QuantizedActs {
        assert!(k % 256 == 0 || (k % 32 == 0 && format == ActFormat::Block32));
        let t = x.len() / k;
        let mut qs = vec![0i8; t * k];
        let mut d32 = vec![0f32; t * k / 32];
        let mut sum16 = vec![0f32; t * k / 16];
        let block = if format == ActFormat::Block256 {
            256
        } else {
            32
        };
        qs.par_chunks_mut(block)
            .zip(d32.par_chunks_mut(block / 32))
            .zip(sum16.par_chunks_mut(block / 16))
            .zip(x.par_chunks(block))
            .with_min_len(64)
            .for_each(|(((q, d), s), x)| {
                let scale = match format {
                    ActFormat::Block256 => quantize_256(x, q),
                    _ => quantize_32(x, q),
                };
                d.fill(scale);
                for (s, q16) in s.iter_mut().zip(q.chunks_exact(16)) {
                    *s = scale * q16.iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
                }
            });
        QuantizedActs {
            format,
            k,
            qs,
            d32,
            sum16,
        }
    }
}

/// ggml `quantize_row_q8_0_ref`; the scale is rounded through f16 as the block stores it.
fn quantize_32(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    half::f16::from_f32(d).to_f32()
}

/// ggml `quantize_row_q8_K_ref`.
fn quantize_256(x: &[f32], q: &mut [i8]) -> f32 {
    let (mut max, mut amax) = (0f32, 0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        q.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
    }
    1.0 / iscale
}

/// Per-thread unpacking buffers.
struct Unpacked {
    levels: Vec<i8>,
    scale16: Vec<f32>,
    min16: Vec<f32>,
    floats: Vec<f32>,
}

impl Unpacked {
    fn new(k: usize) -> Unpacked {
        Unpacked {
            levels: vec![0; k],
            scale16: vec![0.0; k / 16],
            min16: vec![0.0; k / 16],
            floats: Vec::new(),
        }
    }
}

/// Rows per parallel task: enough work to amortize scheduling, enough tasks to balance.
fn rows_per_task(n_out: usize, t: usize) -> usize {
    let threads = rayon::current_num_threads().max(1);
    let by_balance = n_out.div_ceil(threads * 8);
    let by_work = (4096 / t.max(1)).max(1);
    by_balance.clamp(1, by_work.max(16))
}

/// `out[t][r] = x[t] . w[r]` for every token `t` and row `r` (`out` is `t x n_out`).
/// `acts` are `x` already quantized for this weight type (ignored for float weights).
pub fn matmul(w: &dyn WeightRows, x: &[f32], acts: Option<&QuantizedActs>, out: &mut [f32]) {
    matmul_with(w, x, acts, out, false)
}

/// [`matmul`], or with `exact` the dequantized weights times unrounded f32 activations:
/// slower, and the most precise reference the engine has (it tells rounding sensitivity
/// from bugs; docs/cuda.md).
pub fn matmul_with(
    w: &dyn WeightRows,
    x: &[f32],
    acts: Option<&QuantizedActs>,
    out: &mut [f32],
    exact: bool,
) {
    let (k, n) = (w.n_in(), w.n_out());
    let t = x.len() / k;
    assert_eq!(out.len(), t * n);
    let format = if exact {
        ActFormat::F32
    } else {
        ActFormat::for_weight(w.ty())
    };
    let owned;
    let acts = match (format, acts) {
        (ActFormat::F32, _) => None,
        (_, Some(a)) if a.format == format && a.k == k => Some(a),
        _ => {
            owned = QuantizedActs::new(x, k, format);
            Some(&owned)
        }
    };
    // Rows are computed into `row_major[r][t]`, then transposed when there are several tokens.
    let mut row_major = if t == 1 {
        Vec::new()
    } else {
        vec![0f32; n * t]
    };
    let target: &mut [f32] = if t == 1 { out } else { &mut row_major };
    let chunk = rows_per_task(n, t);
    target.par_chunks_mut(chunk * t).enumerate().for_each_init(
        || Unpacked::new(k),
        |buf, (c, dst)| {
            for (i, dst_row) in dst.chunks_exact_mut(t).enumerate() {
                let r = c * chunk + i;
                let bytes = w.row(r);
                match acts {
                    None => {
                        buf.floats.resize(k, 0.0);
                        dequantize(w.ty(), bytes, &mut buf.floats).expect("checked at load");
                        for (tok, o) in dst_row.iter_mut().enumerate() {
                            *o = dot_f32(&buf.floats, &x[tok * k..(tok + 1) * k]);
                        }
                    }
                    Some(a) => {
                        unpack(
                            w.ty(),
                            bytes,
                            &mut buf.levels,
                            &mut buf.scale16,
                            &mut buf.min16,
                        )
                        .expect("checked at load");
                        let has_min = buf.min16.iter().any(|&m| m != 0.0);
                        for (tok, o) in dst_row.iter_mut().enumerate() {
                            let qs = &a.qs[tok * k..(tok + 1) * k];
                            let d32 = &a.d32[tok * k / 32..(tok + 1) * k / 32];
                            let mut v = dot_levels(&buf.levels, &buf.scale16, qs, d32);
                            if has_min {
                                let s16 = &a.sum16[tok * k / 16..(tok + 1) * k / 16];
                                v -= dot_f32(&buf.min16, s16);
                            }
                            *o = v;
                        }
                    }
                }
            }
        },
    );
    if t > 1 {
        for r in 0..n {
            for tok in 0..t {
                out[tok * n + r] = row_major[r * t + tok];
            }
        }
    }
}

/// Dot product of two f32 slices, in 8 lanes so the compiler can vectorize it.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + tail
}

/// `sum_i scale16[i/16] * d32[i/32] * levels[i] * qs[i]`.
fn dot_levels(levels: &[i8], scale16: &[f32], qs: &[i8], d32: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
            // SAFETY: the features were just detected.
            return unsafe { dot_levels_avx2(levels, scale16, qs, d32) };
        }
    }
    dot_levels_scalar(levels, scale16, qs, d32)
}

fn dot_levels_scalar(levels: &[i8], scale16: &[f32], qs: &[i8], d32: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (g, (w, a)) in levels.chunks_exact(16).zip(qs.chunks_exact(16)).enumerate() {
        let s: i32 = w
            .iter()
            .zip(a)
            .map(|(&w, &a)| i32::from(w) * i32::from(a))
            .sum();
        acc += scale16[g] * d32[g / 2] * s as f32;
    }
    acc
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_levels_avx2(levels: &[i8], scale16: &[f32], qs: &[i8], d32: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = levels.len() / 32;
    debug_assert!(qs.len() >= n * 32 && scale16.len() >= 2 * n && d32.len() >= n);
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm256_setzero_ps();
    for c in 0..n {
        // SAFETY: c * 32 + 32 <= len for both slices (checked above).
        let (w, a) = unsafe {
            (
                _mm256_loadu_si256(levels.as_ptr().add(c * 32) as *const __m256i),
                _mm256_loadu_si256(qs.as_ptr().add(c * 32) as *const __m256i),
            )
        };
        // |w| * (a * sign(w)) = w * a, with the unsigned x signed form maddubs needs.
        // Activations never hold -128, so the sign flip cannot overflow.
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(a, w));
        let quads = _mm256_madd_epi16(pairs, ones); // lanes 0-3: elements 0-15, 4-7: 16-31
        let d = d32[c];
        let scale = _mm256_set_m128(
            _mm_set1_ps(scale16[2 * c + 1] * d),
            _mm_set1_ps(scale16[2 * c] * d),
        );
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quads), scale, acc);
    }
    let hi = _mm256_extractf128_ps(acc, 1);
    let s = _mm_add_ps(_mm256_castps256_ps128(acc), hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::quant::{dequantize_to_vec, quantize_activations};

    struct Rows {
        ty: GgmlType,
        k: usize,
        data: Vec<u8>,
    }

    impl WeightRows for Rows {
        fn ty(&self) -> GgmlType {
            self.ty
        }
        fn n_in(&self) -> usize {
            self.k
        }
        fn n_out(&self) -> usize {
            self.data.len() / self.ty.row_bytes(self.k as u64).unwrap() as usize
        }
        fn row(&self, r: usize) -> &[u8] {
            let rb = self.ty.row_bytes(self.k as u64).unwrap() as usize;
            &self.data[r * rb..(r + 1) * rb]
        }
    }

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// Random rows of a type with sane f16 scales (the matmul oracle below is memra-gguf's
    /// reference `vec_dot`, which computes llama.cpp's integer dot product).
    fn random_rows(ty: GgmlType, k: usize, n: usize, seed: &mut u64) -> Rows {
        let mut data: Vec<u8> = (0..n * ty.row_bytes(k as u64).unwrap() as usize)
            .map(|_| lcg(seed) as u8)
            .collect();
        let fields = memra_gguf::quant::f16_scale_fields(ty);
        let bs = ty.type_size();
        for b in data.chunks_exact_mut(bs) {
            for &f in fields {
                let v = half::f16::from_f32((lcg(seed) % 1000) as f32 * 1e-5 + 1e-4);
                b[f..f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        if ty == GgmlType::F16 {
            for c in data.chunks_exact_mut(2) {
                let v = half::f16::from_f32((lcg(seed) % 2001) as f32 / 1000.0 - 1.0);
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        Rows { ty, k, data }
    }

    #[test]
    fn matmul_matches_the_reference_dot_product_for_every_type() {
        let mut seed = 42u64;
        for ty in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q5_0,
            GgmlType::Q5_1,
            GgmlType::Q8_0,
            GgmlType::Q2K,
            GgmlType::Q3K,
            GgmlType::Q4K,
            GgmlType::Q5K,
            GgmlType::Q6K,
            GgmlType::Iq4Nl,
            GgmlType::Iq4Xs,
            GgmlType::F16,
        ] {
            let (k, n) = (512, 37);
            let w = random_rows(ty, k, n, &mut seed);
            for t in [1usize, 3] {
                let x: Vec<f32> = (0..t * k)
                    .map(|_| (lcg(&mut seed) % 2001) as f32 / 500.0 - 2.0)
                    .collect();
                let mut out = vec![f32::NAN; t * n];
                matmul(&w, &x, None, &mut out);
                for tok in 0..t {
                    let xt = &x[tok * k..(tok + 1) * k];
                    for r in 0..n {
                        let want = match activation_type(ty) {
                            Some(act) => {
                                let mut q = Vec::new();
                                quantize_activations(act, xt, &mut q).unwrap();
                                memra_gguf::quant::vec_dot(ty, k, w.row(r), &q).unwrap()
                            }
                            None => {
                                let wf = dequantize_to_vec(ty, w.row(r)).unwrap();
                                wf.iter().zip(xt).map(|(a, b)| a * b).sum()
                            }
                        };
                        let got = out[tok * n + r];
                        let mag: f32 = dequantize_to_vec(ty, w.row(r))
                            .unwrap()
                            .iter()
                            .zip(xt)
                            .map(|(a, b)| (a * b).abs())
                            .sum();
                        assert!(
                            (got - want).abs() <= 2e-3 * mag + 1e-5,
                            "{ty} t={t} token {tok} row {r}: {got} vs reference {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn avx2_and_scalar_kernels_agree() {
        let mut seed = 7u64;
        let k = 1024;
        let levels: Vec<i8> = (0..k).map(|_| lcg(&mut seed) as i8).collect();
        let qs: Vec<i8> = (0..k)
            .map(|_| (lcg(&mut seed) % 255) as i8 as i16 as i8)
            .map(|v| v.max(-127))
            .collect();
        let s16: Vec<f32> = (0..k / 16)
            .map(|_| (lcg(&mut seed) % 100) as f32 / 50.0 - 1.0)
            .collect();
        let d32: Vec<f32> = (0..k / 32)
            .map(|_| (lcg(&mut seed) % 100) as f32 / 100.0)
            .collect();
        let scalar = dot_levels_scalar(&levels, &s16, &qs, &d32);
        let fast = dot_levels(&levels, &s16, &qs, &d32);
        assert!(
            (scalar - fast).abs() <= 1e-3 * scalar.abs().max(1.0),
            "{scalar} vs {fast}"
        );
    }
}
