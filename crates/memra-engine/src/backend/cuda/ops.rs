//! Launch wrappers of the kernels other than the matrix products: element-wise,
//! normalization, rotary, attention, dequantization and embedding, MoE routing, the greedy
//! pick. Each documents the shapes it needs; sizes are checked before launching.

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};
use half::f16;
use memra_gguf::GgmlType;

use super::matvec::{device_type_id, regrouped, DeviceActs};
use super::{CudaDevice, CudaError};

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

/// The shape of the attention of a layer.
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    /// Head dimension of keys and values (these kernels need them equal).
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window in positions, 0 for none.
    pub window: usize,
}

impl AttentionShape {
    /// The head dimensions the kernels are instantiated for.
    pub fn supported(&self) -> Result<(), CudaError> {
        if !matches!(self.head_dim, 32 | 64 | 128 | 256) {
            return Err(CudaError::Invalid(format!(
                "attention with head dimension {} (the kernels take 32, 64, 128 or 256)",
                self.head_dim
            )));
        }
        if self.n_head % self.n_head_kv != 0 || self.n_head / self.n_head_kv > MAX_GROUP {
            return Err(CudaError::Invalid(format!(
                "{} query heads over {} kv heads (at most {MAX_GROUP} per kv head)",
                self.n_head, self.n_head_kv
            )));
        }
        Ok(())
    }
}

/// Query heads per kv head the decode kernel handles (`MAX_GROUP` in attention.cu).
const MAX_GROUP: usize = 8;

/// RoPE on `q` (in place) and `k` for `n_tok` tokens at positions `*pos ..`, then `k` and
/// `v` into their f16 cache rows. `q`: n_tok x n_head x head_dim, `k`: n_tok x n_head_kv x
/// head_dim, `v` likewise; `pos` is one i32 on the device (a graph replays it).
#[allow(clippy::too_many_arguments)]
pub fn rope_qk_append(
    dev: &CudaDevice,
    q: &mut CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    k_cache: &mut CudaSlice<f16>,
    v_cache: &mut CudaSlice<f16>,
    shape: &AttentionShape,
    r: &DeviceRope,
    pos: &CudaView<i32>,
    n_tok: usize,
    max_pos: usize,
) -> Result<(), CudaError> {
    let (nh, nkv, dk) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    check(
        q.len() >= n_tok * nh * dk
            && k.len() >= n_tok * nkv * dk
            && v.len() >= n_tok * nkv * dk
            && k_cache.len() >= max_pos * nkv * dk
            && v_cache.len() >= max_pos * nkv * dk
            && r.n_dims <= dk
            && r.n_dims % 2 == 0
            && !pos.is_empty(),
        "rope_qk_append: shapes",
    )?;
    let f = dev.function("rope", "rope_qk_append")?;
    let half = r.n_dims / 2;
    let n = nh * half + nkv * half + nkv * (dk - r.n_dims) + nkv * dk;
    let ints = [nh, nkv, dk, dk, r.n_dims].map(|v| v as i32);
    let halves = i32::from(r.halves);
    let null: u64 = 0;
    let mut cfg = grid_1d(n);
    cfg.grid_dim.1 = n_tok as u32;
    // SAFETY: the caller keeps *pos + n_tok <= max_pos, the cache length checked above;
    // every other index is within the shapes checked.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q).arg(k).arg(v).arg(k_cache).arg(v_cache);
        for i in &ints {
            b.arg(i);
        }
        b.arg(pos).arg(&r.base).arg(&r.freq_scale);
        match &r.freq_factors {
            Some(ff) => b.arg(ff),
            None => b.arg(&null),
        };
        b.arg(&halves).launch(cfg)?;
    }
    Ok(())
}

/// Keys per split of the decode attention: one 32-key step per warp of the block's two
/// (enough work to hide the merge), and short contexts still spread over several blocks.
pub const KEYS_PER_SPLIT: usize = 64;
/// The most splits (the partial buffers hold this many): 64 x 8 kv heads fill the H200's
/// 132 SMs several times over at long contexts.
pub const MAX_SPLITS: usize = 64;

/// Splits for a decode step over `n_kv` visible positions.
pub fn decode_splits(n_kv: usize) -> usize {
    n_kv.div_ceil(KEYS_PER_SPLIT).clamp(1, MAX_SPLITS)
}

/// Decode attention, first half: block (kv head, split) writes its partial result for the
/// query heads of its group into `part_o` (splits x n_head x head_dim) and `part_ml`
/// (splits x n_head x 2). The query is at position `*pos`.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    dev: &CudaDevice,
    s: &AttentionShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f16>,
    v_cache: &CudaSlice<f16>,
    part_o: &mut CudaSlice<f32>,
    part_ml: &mut CudaSlice<f32>,
    pos: &CudaView<i32>,
    n_split: usize,
) -> Result<(), CudaError> {
    s.supported()?;
    check(
        q.len() >= s.n_head * s.head_dim
            && (1..=MAX_SPLITS).contains(&n_split)
            && part_o.len() >= MAX_SPLITS * s.n_head * s.head_dim
            && part_ml.len() >= MAX_SPLITS * s.n_head * 2
            && k_cache.len() == v_cache.len(),
        "attention_decode: shapes",
    )?;
    let f = dev.function("attention", decode_kernel(s.head_dim))?;
    // Two warps (DECODE_WARPS in attention.cu).
    let cfg = LaunchConfig {
        grid_dim: (s.n_head_kv as u32, n_split as u32, 1),
        block_dim: (64, 1, 1),
        shared_mem_bytes: 0,
    };
    let ints = [s.n_head, s.n_head_kv, s.window].map(|v| v as i32);
    let ns = n_split as i32;
    // SAFETY: shapes checked above; the caller keeps *pos below the cache's positions.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(part_o)
            .arg(part_ml)
            .arg(pos)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&s.scale)
            .arg(&ns)
            .launch(cfg)?;
    }
    Ok(())
}

pub fn decode_kernel(head_dim: usize) -> &'static str {
    match head_dim {
        32 => "attn_decode_d32",
        64 => "attn_decode_d64",
        128 => "attn_decode_d128",
        _ => "attn_decode_d256",
    }
}

/// Decode attention, second half: merges the splits into the attention output, quantized
/// for the output projection into `acts`.
pub fn attention_combine(
    dev: &CudaDevice,
    s: &AttentionShape,
    part_o: &CudaSlice<f32>,
    part_ml: &CudaSlice<f32>,
    acts: &mut DeviceActs,
    n_split: usize,
) -> Result<(), CudaError> {
    attention_combine_into(dev, s, part_o, part_ml, None, acts, n_split)
}

/// [`attention_combine`], also writing the f32 output into `out` when given.
pub fn attention_combine_into(
    dev: &CudaDevice,
    s: &AttentionShape,
    part_o: &CudaSlice<f32>,
    part_ml: &CudaSlice<f32>,
    out: Option<&mut CudaSlice<f32>>,
    acts: &mut DeviceActs,
    n_split: usize,
) -> Result<(), CudaError> {
    let len = s.n_head * s.head_dim;
    check(
        acts.q.len() >= len
            && (1..=MAX_SPLITS).contains(&n_split)
            && out.as_ref().is_none_or(|o| o.len() >= len),
        "attention_combine: shapes",
    )?;
    let f = dev.function("attention", "attn_combine")?;
    // SPLIT_GROUPS (4) threads per dimension (attention.cu).
    let cfg = blocks(s.n_head, 4 * s.head_dim as u32);
    let (nh, d, ns, null) = (s.n_head as i32, s.head_dim as i32, n_split as i32, 0u64);
    // SAFETY: n_split x n_head x head_dim partials (checked by attention_decode's sizes);
    // n_head x head_dim quantized outputs (checked above).
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(part_o).arg(part_ml);
        match out {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        b.arg(&mut acts.q)
            .arg(&mut acts.d)
            .arg(&mut acts.s)
            .arg(&nh)
            .arg(&d)
            .arg(&ns)
            .launch(cfg)?;
    }
    Ok(())
}

/// Prompt attention: `n_q` queries at positions `*pos ..` over the cache (which already
/// holds their keys and values); `out` is f16, n_q x n_head x head_dim.
#[allow(clippy::too_many_arguments)]
pub fn attention_prefill(
    dev: &CudaDevice,
    s: &AttentionShape,
    q: &CudaSlice<f32>,
    k_cache: &CudaSlice<f16>,
    v_cache: &CudaSlice<f16>,
    out: &mut CudaSlice<f16>,
    pos: &CudaView<i32>,
    n_q: usize,
) -> Result<(), CudaError> {
    s.supported()?;
    let d = s.head_dim;
    check(
        q.len() >= n_q * s.n_head * d && out.len() >= n_q * s.n_head * d,
        "attention_prefill: shapes",
    )?;
    let name = match d {
        32 => "attn_prefill_d32",
        64 => "attn_prefill_d64",
        128 => "attn_prefill_d128",
        _ => "attn_prefill_d256",
    };
    let f = dev.function("attention", name)?;
    // Shared memory: the query tile (32 x d f32), a key tile (32 rows of d/2 + 1 words) and
    // a value tile (32 x d/2 words); see attn_prefill.
    const QUERIES_PER_BLOCK: usize = 32;
    let smem = 4 * (QUERIES_PER_BLOCK * d + 32 * (d / 2 + 1) + 32 * d / 2);
    if smem > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )?;
    }
    let cfg = LaunchConfig {
        grid_dim: (n_q.div_ceil(QUERIES_PER_BLOCK) as u32, s.n_head as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let ints = [n_q, s.n_head, s.n_head_kv, s.window].map(|v| v as i32);
    // SAFETY: shapes checked above; the caller keeps *pos + n_q within the cache.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q).arg(k_cache).arg(v_cache).arg(out).arg(pos);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&s.scale).launch(cfg)?;
    }
    Ok(())
}

/// Prompt batches: `x += o` (when given), then the RMS norm of each of `rows` rows times
/// `w`, as f16 into `out`.
pub fn add_norm_f16(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    o: Option<&CudaSlice<f32>>,
    w: &CudaSlice<f32>,
    out: &mut CudaSlice<f16>,
    rows: usize,
    eps: f32,
) -> Result<(), CudaError> {
    let n = w.len();
    check(
        x.len() >= rows * n && o.is_none_or(|o| o.len() >= rows * n) && out.len() >= rows * n,
        "add_norm_f16: shapes",
    )?;
    let f = dev.function("norm", "add_norm_f16")?;
    let cfg = blocks(rows, THREADS);
    let (n_i, null) = (n as i32, 0u64);
    // SAFETY: rows x n elements of x, o and out; n of w (checked above).
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(x);
        match o {
            Some(o) => b.arg(o),
            None => b.arg(&null),
        };
        b.arg(w).arg(out).arg(&n_i).arg(&eps).launch(cfg)?;
    }
    Ok(())
}

/// Prompt batches: `out = act(g) * u` as f16 for `rows` rows of `n`; rows whose values
/// would overflow f16 are scaled down, and `inv_scale[row]` gets the factor to apply to
/// the down projection's output ([`scale_rows`]).
#[allow(clippy::too_many_arguments)]
pub fn gated_f16(
    dev: &CudaDevice,
    g: &CudaSlice<f32>,
    u: &CudaSlice<f32>,
    out: &mut CudaSlice<f16>,
    inv_scale: &mut CudaSlice<f32>,
    rows: usize,
    n: usize,
    gelu: bool,
) -> Result<(), CudaError> {
    let total = rows * n;
    check(
        g.len() >= total && u.len() >= total && out.len() >= total && inv_scale.len() >= rows,
        "gated_f16: shapes",
    )?;
    let f = dev.function("elementwise", "gated_f16")?;
    let cfg = blocks(rows, THREADS);
    let (n_i, gelu) = (n as i32, i32::from(gelu));
    // SAFETY: rows x n elements of each, rows of inv_scale (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(g)
            .arg(u)
            .arg(out)
            .arg(inv_scale)
            .arg(&n_i)
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
    let f = dev.function("moe", "moe_route")?;
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
    let cfg = blocks(n_tok, THREADS);
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
mod tests {
    use super::super::matvec::tests::{lcg, random_weights, GPU_TYPES};
    use super::super::matvec::upload_weights;
    use super::*;
    use memra_gguf::quant::dequantize_to_vec;

    /// Dequantization to f16 (the prompt GEMMs' weights) and embedding rows against the
    /// CPU decoders, for every type, on fresh random blocks.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_dequantize_and_embed_match_the_cpu_reference() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 21u64;
        // 2816 columns: Q8_0 regrouped, Q6_K not; 2048: both regrouped.
        for (ty, (ncols, nrows)) in GPU_TYPES
            .into_iter()
            .flat_map(|ty| [(ty, (2816usize, 37usize)), (ty, (2048, 5))])
        {
            let w = random_weights(ty, ncols, nrows, &mut seed);
            let want = dequantize_to_vec(ty, &w).unwrap();
            let wd = upload_weights(&dev, &w, ty, ncols).unwrap();
            if ty != GgmlType::F16 {
                let mut out = dev.stream.alloc_zeros::<f16>(ncols * nrows).unwrap();
                dequantize_f16(
                    &dev,
                    &wd.slice(..),
                    ty,
                    &mut out.slice_mut(..),
                    nrows,
                    ncols,
                )
                .unwrap();
                let got = dev.stream.clone_dtoh(&out).unwrap();
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let w16 = f16::from_f32(*w).to_f32();
                    assert!(
                        (g.to_f32() - w16).abs() <= 1e-3 * w16.abs() + 1e-7,
                        "{ty} element {i}: {g} vs {w}"
                    );
                }
            }
            let ids: Vec<i32> = (0..5)
                .map(|_| (lcg(&mut seed) % nrows as u64) as i32)
                .collect();
            let idd = dev.stream.clone_htod(&ids).unwrap();
            let mut rows = dev.stream.alloc_zeros::<f32>(5 * ncols).unwrap();
            embed_rows(&dev, &wd, ty, &idd.slice(..), &mut rows, ncols, 5, 0.5).unwrap();
            let got = dev.stream.clone_dtoh(&rows).unwrap();
            for (t, &id) in ids.iter().enumerate() {
                let r = id as usize * ncols;
                for c in 0..ncols {
                    let (g, w) = (got[t * ncols + c], 0.5 * want[r + c]);
                    assert!(
                        (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                        "{ty} row {id} col {c}: {g} vs {w}"
                    );
                }
            }
        }
    }

    /// Decode (split-K + combine) and prompt (flash) attention against the CPU reference,
    /// on random queries and an f16 cache (the CPU gets the same f16 values), for every
    /// head dimension, grouped heads, sliding windows, and split counts from 1 to 64.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_attention_matches_the_cpu_reference() {
        use crate::backend::cpu::ops as cpu;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 77u64;
        let mut rnd = |scale: f32| ((lcg(&mut seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
        // (n_head, n_head_kv, head_dim, positions before the batch, batch, window)
        for (nh, nkv, d, p0, n_q, window) in [
            (32usize, 8usize, 128usize, 4090usize, 7usize, 0usize),
            (14, 2, 64, 60, 77, 0),
            (4, 1, 256, 250, 50, 16),
            (8, 8, 32, 0, 33, 0),
            (32, 8, 128, 0, 1, 0),
            (6, 2, 128, 1000, 40, 100),
        ] {
            let n_kv = p0 + n_q;
            let kv_len = n_kv * nkv * d;
            let k16: Vec<f16> = (0..kv_len).map(|_| f16::from_f32(rnd(2.0))).collect();
            let v16: Vec<f16> = (0..kv_len).map(|_| f16::from_f32(rnd(2.0))).collect();
            let q: Vec<f32> = (0..n_q * nh * d).map(|_| rnd(1.0)).collect();
            let shape = AttentionShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim: d,
                scale: 1.0 / (d as f32).sqrt(),
                window,
            };
            let cpu_shape = cpu::AttentionShape {
                n_head: nh,
                n_head_kv: nkv,
                head_dim_k: d,
                head_dim_v: d,
                scale: shape.scale,
                window: (window > 0).then_some(window),
            };
            let kf: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
            let vf: Vec<f32> = v16.iter().map(|v| v.to_f32()).collect();
            let mut want = vec![0f32; n_q * nh * d];
            cpu::attention(&cpu_shape, &q, &kf, &vf, p0, &mut want);
            let kd = dev.stream.clone_htod(&k16).unwrap();
            let vd = dev.stream.clone_htod(&v16).unwrap();
            let close = |got: &[f32], want: &[f32], what: &str| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    assert!(
                        (g - w).abs() <= 2e-3 * w.abs().max(0.1),
                        "{what} {nh}/{nkv} d{d} p0 {p0} n {n_q} w {window}: element {i}: {g} vs {w}"
                    );
                }
            };
            // Prompt attention over the whole batch.
            let qd = dev.stream.clone_htod(&q).unwrap();
            let pos = dev.stream.clone_htod(&[p0 as i32]).unwrap();
            let mut out = dev.stream.alloc_zeros::<f16>(n_q * nh * d).unwrap();
            attention_prefill(&dev, &shape, &qd, &kd, &vd, &mut out, &pos.slice(..), n_q).unwrap();
            let got: Vec<f32> = dev
                .stream
                .clone_dtoh(&out)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            close(&got, &want, "prefill");
            // Decode of the batch's last query, at every split count it could get.
            let last = (n_q - 1) * nh * d;
            let ql = dev.stream.clone_htod(&q[last..]).unwrap();
            let pos = dev.stream.clone_htod(&[(n_kv - 1) as i32]).unwrap();
            let mut part_o = dev.stream.alloc_zeros::<f32>(MAX_SPLITS * nh * d).unwrap();
            let mut part_ml = dev.stream.alloc_zeros::<f32>(MAX_SPLITS * nh * 2).unwrap();
            let mut acts = DeviceActs::new(&dev, nh * d).unwrap();
            let mut outd = dev.stream.alloc_zeros::<f32>(nh * d).unwrap();
            for n_split in [1, decode_splits(n_kv), MAX_SPLITS] {
                attention_decode(
                    &dev,
                    &shape,
                    &ql,
                    &kd,
                    &vd,
                    &mut part_o,
                    &mut part_ml,
                    &pos.slice(..),
                    n_split,
                )
                .unwrap();
                attention_combine_into(
                    &dev,
                    &shape,
                    &part_o,
                    &part_ml,
                    Some(&mut outd),
                    &mut acts,
                    n_split,
                )
                .unwrap();
                let got = dev.stream.clone_dtoh(&outd).unwrap();
                close(&got, &want[last..], &format!("decode, {n_split} splits"));
            }
        }
    }
}
