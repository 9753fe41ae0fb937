//! Launch wrappers of the element-wise, normalization, rotary and attention kernels. Each
//! documents the shapes it needs; sizes are checked before launching.

use cudarc::driver::{CudaSlice, CudaView, LaunchConfig, PushKernelArg};

use super::{CudaDevice, CudaError};

const THREADS: u32 = 256;

/// One thread per element, in blocks of 256.
pub(super) fn grid_1d(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((n as u32).div_ceil(THREADS).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn check(ok: bool, what: &str) -> Result<(), CudaError> {
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
    let cfg = LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
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

/// Decode step: RoPE on `q` (in place) and `k`, then `k` and `v` into their cache rows at
/// `pos`. `q`: n_head x dk, `k`: n_head_kv x dk, `v`: n_head_kv x dv; the caches hold
/// n_head_kv x dk (dv) per position.
#[allow(clippy::too_many_arguments)]
pub fn rope_qk_append(
    dev: &CudaDevice,
    q: &mut CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    k_cache: &mut CudaSlice<f32>,
    v_cache: &mut CudaSlice<f32>,
    shape: &DecodeAttention,
    r: &DeviceRope,
    pos: usize,
) -> Result<(), CudaError> {
    let (nh, nkv, dk, dv) = (shape.n_head, shape.n_head_kv, shape.dk, shape.dv);
    check(
        q.len() >= nh * dk
            && k.len() >= nkv * dk
            && v.len() >= nkv * dv
            && k_cache.len() >= (pos + 1) * nkv * dk
            && v_cache.len() >= (pos + 1) * nkv * dv
            && r.n_dims <= dk
            && r.n_dims % 2 == 0,
        "rope_qk_append: shapes",
    )?;
    let f = dev.function("rope", "rope_qk_append_f32")?;
    let half = r.n_dims / 2;
    let n = nh * half + nkv * half + nkv * (dk - r.n_dims) + nkv * dv;
    let ints = [nh, nkv, dk, dv, r.n_dims, pos].map(|v| v as i32);
    let halves = i32::from(r.halves);
    let null: u64 = 0;
    // SAFETY: every index the kernel writes is within the shapes checked above.
    unsafe {
        let mut b = dev.stream.launch_builder(&f);
        b.arg(q).arg(k).arg(v).arg(k_cache).arg(v_cache);
        for i in &ints {
            b.arg(i);
        }
        b.arg(&r.base).arg(&r.freq_scale);
        match &r.freq_factors {
            Some(ff) => b.arg(ff),
            None => b.arg(&null),
        };
        b.arg(&halves).launch(grid_1d(n))?;
    }
    Ok(())
}

/// Shape of a decode attention call.
pub struct DecodeAttention {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub dk: usize,
    pub dv: usize,
    pub scale: f32,
}

/// One query token over cached positions `first..n_kv`; `out` is `n_head x dv`.
#[allow(clippy::too_many_arguments)]
pub fn attention_decode(
    dev: &CudaDevice,
    s: &DecodeAttention,
    q: &CudaSlice<f32>,
    k_cache: &CudaView<f32>,
    v_cache: &CudaView<f32>,
    out: &mut CudaSlice<f32>,
    first: usize,
    n_kv: usize,
) -> Result<(), CudaError> {
    check(
        q.len() >= s.n_head * s.dk
            && out.len() >= s.n_head * s.dv
            && k_cache.len() >= n_kv * s.n_head_kv * s.dk
            && v_cache.len() >= n_kv * s.n_head_kv * s.dv
            && first < n_kv,
        "attention: shapes",
    )?;
    let scores = (n_kv - first) * 4;
    check(
        scores <= 160 * 1024,
        "attention: context longer than this kernel's shared memory",
    )?;
    let f = dev.function("attention", "attn_decode_f32")?;
    if scores > 48 * 1024 {
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            scores as i32,
        )?;
    }
    let cfg = LaunchConfig {
        grid_dim: (s.n_head as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: scores as u32,
    };
    let (nh, nkv, dk, dv, fi, n) = (
        s.n_head as i32,
        s.n_head_kv as i32,
        s.dk as i32,
        s.dv as i32,
        first as i32,
        n_kv as i32,
    );
    // SAFETY: shapes checked above; scores fit the dynamic shared memory requested.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(q)
            .arg(k_cache)
            .arg(v_cache)
            .arg(out)
            .arg(&nh)
            .arg(&nkv)
            .arg(&dk)
            .arg(&dv)
            .arg(&fi)
            .arg(&n)
            .arg(&s.scale)
            .launch(cfg)?;
    }
    Ok(())
}
