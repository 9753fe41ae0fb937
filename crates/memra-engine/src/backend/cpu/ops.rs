//! Element-wise, normalization, rotary and attention operations on the CPU, in f32.
//! These are the reference the GPU kernels are checked against, so they stay plain.

use rayon::prelude::*;

pub use crate::models::layers::AttentionShape;
use crate::models::rope::{Rope, RopeLayout};

/// Row-wise RMS norm of `x` (rows of `weight.len()`), times `weight`, in place.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for row in x.chunks_exact_mut(n) {
        let ms = row
            .iter()
            .map(|v| f64::from(*v) * f64::from(*v))
            .sum::<f64>()
            / n as f64;
        let scale = (1.0 / (ms + f64::from(eps)).sqrt()) as f32;
        for (v, w) in row.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

/// Rotary embedding of `x` in place: every head of `head_dim` in row `t` rotated for
/// position `positions[t]`.
pub fn rope(r: &Rope, x: &mut [f32], head_dim: usize, positions: &[usize]) {
    let half = r.n_dims / 2;
    let theta: Vec<f32> = (0..half)
        .map(|i| {
            let t = r.base.powf(-2.0 * i as f32 / r.n_dims as f32);
            match &r.freq_factors {
                Some(f) => t / f[i],
                None => t,
            }
        })
        .collect();
    let row_len = x.len() / positions.len();
    for (row, &pos) in x.chunks_exact_mut(row_len).zip(positions) {
        let p = pos as f32 * r.freq_scale;
        let (sin, cos): (Vec<f32>, Vec<f32>) = theta.iter().map(|t| (p * t).sin_cos()).unzip();
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match r.layout {
                    RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                    RopeLayout::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (ggml `ggml_gelu`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044715 * x * x)).tanh())
}

/// Softmax of a slice, in place.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Causal attention of `t` queries at positions `p0..p0+t` over the first `p0 + t` cached
/// keys and values. `q` is `t x n_head*head_dim_k`, the caches `positions x
/// n_head_kv*head_dim`, `out` is `t x n_head*head_dim_v`. (A contiguous cache is a paged
/// one of a single block.)
pub fn attention(
    s: &AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    p0: usize,
    out: &mut [f32],
) {
    let t = q.len() / (s.n_head * s.head_dim_k);
    let queries: Vec<PagedQuery> = (0..t)
        .map(|i| PagedQuery {
            pos: p0 + i,
            blocks: &[0],
        })
        .collect();
    attention_paged(s, q, k_cache, v_cache, p0 + t, &queries, out);
}

/// Where one query row finds its keys and values in a paged cache: its position, and its
/// sequence's blocks (position `j` is at slot `blocks[j / block_size] * block_size + j %
/// block_size`).
pub struct PagedQuery<'a> {
    pub pos: usize,
    pub blocks: &'a [u32],
}

/// Causal attention of the rows of `q` (`t x n_head*head_dim_k`), row `i` over positions
/// `0..=queries[i].pos` of its own sequence (less any window), in pools of `slots x
/// n_head_kv*head_dim` keys and values. `out` is `t x n_head*head_dim_v`.
pub fn attention_paged(
    s: &AttentionShape,
    q: &[f32],
    k_pool: &[f32],
    v_pool: &[f32],
    block_size: usize,
    queries: &[PagedQuery],
    out: &mut [f32],
) {
    let (dk, dv) = (s.head_dim_k, s.head_dim_v);
    let q_row = s.n_head * dk;
    let group = s.n_head / s.n_head_kv;
    let (k_row, v_row) = (s.n_head_kv * dk, s.n_head_kv * dv);
    // One task per (token, head): outputs are disjoint slices of `out`.
    out.par_chunks_mut(dv).enumerate().for_each(|(i, o)| {
        let (tok, h) = (i / s.n_head, i % s.n_head);
        let kvh = h / group;
        let PagedQuery { pos, blocks } = queries[tok];
        let slot = |j: usize| blocks[j / block_size] as usize * block_size + j % block_size;
        let first = s.window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let qh = &q[tok * q_row + h * dk..tok * q_row + (h + 1) * dk];
        let mut scores: Vec<f32> = (first..=pos)
            .map(|j| {
                let at = slot(j) * k_row + kvh * dk;
                super::matmul::dot_f32(qh, &k_pool[at..at + dk]) * s.scale
            })
            .collect();
        softmax(&mut scores);
        o.fill(0.0);
        for (j, &p) in (first..=pos).zip(&scores) {
            let at = slot(j) * v_row + kvh * dv;
            for (a, &b) in o.iter_mut().zip(&v_pool[at..at + dv]) {
                *a += p * b;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_a_known_row() {
        let mut x = vec![3.0, 4.0];
        rms_norm(&mut x, &[1.0, 2.0], 0.0);
        let rms = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / rms).abs() < 1e-6 && (x[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn rope_rotates_pairs_by_position_angle() {
        for layout in [RopeLayout::Interleaved, RopeLayout::Halves] {
            let rope = Rope {
                layout,
                n_dims: 4,
                base: 100.0,
                freq_scale: 1.0,
                freq_factors: None,
            };
            let mut x = vec![1.0, 0.0, 0.0, 0.0];
            if layout == RopeLayout::Halves {
                x = vec![1.0, 0.0, 0.0, 0.0];
            }
            super::rope(&rope, &mut x, 4, &[3]);
            // Dimension pair 0 rotates by 3 * base^0 = 3 radians.
            let (a, b) = match layout {
                RopeLayout::Interleaved => (x[0], x[1]),
                RopeLayout::Halves => (x[0], x[2]),
            };
            assert!(
                (a - 3f32.cos()).abs() < 1e-6 && (b - 3f32.sin()).abs() < 1e-6,
                "{layout:?} {x:?}"
            );
            // Norm is preserved.
            assert!((x.iter().map(|v| v * v).sum::<f32>() - 1.0).abs() < 1e-5);
        }
    }

    #[test]
    fn attention_equals_the_textbook_formula_with_a_window() {
        let s = AttentionShape {
            n_head: 2,
            n_head_kv: 1,
            head_dim_k: 2,
            head_dim_v: 2,
            scale: 0.5,
            window: Some(2),
        };
        let k = vec![1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
        let v = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let q = vec![1.0, 1.0, 2.0, 0.0]; // one token at position 2, two heads
        let mut out = vec![0.0; 4];
        attention(&s, &q, &k, &v, 2, &mut out);
        // Window 2 at position 2 sees keys 1 and 2.
        for (h, qh) in q.chunks(2).enumerate() {
            let sc: Vec<f32> = [1usize, 2]
                .iter()
                .map(|&j| 0.5 * (qh[0] * k[2 * j] + qh[1] * k[2 * j + 1]))
                .collect();
            let e: Vec<f32> = sc.iter().map(|x| x.exp()).collect();
            let z: f32 = e.iter().sum();
            for d in 0..2 {
                let want = (e[0] * v[2 + d] + e[1] * v[4 + d]) / z;
                assert!((out[h * 2 + d] - want).abs() < 1e-6);
            }
        }
    }
}
