//! Decode-time matrix products on quantized weights: the activations are quantized to
//! int8 on the device, then multiplied with `dp4a` for up to [`MAX_TOKENS`] tokens
//! (`cu/quant_matvec.cu`) or on the int8 tensor cores for up to [`MAX_MMQ_TOKENS`]
//! (`cu/quant_mmq.cu`, for the formats of nearly all decode bytes).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use memra_gguf::GgmlType;

use super::ops::{blocks, grid_1d};
use super::{CudaDevice, CudaError};

/// Tokens one call of the dp4a kernels handles (they keep one accumulator per token in
/// registers); from here to [`MAX_MMQ_TOKENS`], the tensor-core kernels.
pub const MAX_TOKENS: usize = 8;

/// Tokens one call of the tensor-core kernels handles (they read the activations of 16
/// tokens, the last one repeated). Kernels for 32 and 64 were measured and removed: they lost
/// to the GEMM path on f16 copies (docs/cuda.md).
pub const MAX_MMQ_TOKENS: usize = 16;

/// The tensor-core kernel for weights of `ty` in rows of `ncols`, where the format has one:
/// Q4_K and the regrouped Q6_K and Q8_0 (whose chunks of 256 weights the kernels stage).
fn mmq_kernel(ty: GgmlType, ncols: usize) -> Option<&'static str> {
    if ncols % 256 != 0 {
        return None;
    }
    match (ty, regrouped(ty, ncols)) {
        (GgmlType::Q4K, _) => Some("mmq_q4_k_16"),
        (GgmlType::Q6K, true) => Some("mmq_q6_k_r_16"),
        (GgmlType::Q8_0, true) => Some("mmq_q8_0_r_16"),
        _ => None,
    }
}

/// Whether [`mmvq_set`] takes up to [`MAX_MMQ_TOKENS`] tokens of weights of `ty` in rows
/// of `ncols` (else up to [`MAX_TOKENS`]).
pub fn mmq_supported(ty: GgmlType, ncols: usize) -> bool {
    mmq_kernel(ty, ncols).is_some()
}

/// Weight rows a block of the tensor-core kernels takes (MMQ_TILE in quant_mmq.cu).
const MMQ_TILE: usize = 64;
/// Blocks a tensor-core launch aims at (two per SM of an H200): a launch of fewer row tiles
/// splits each row into parts, at most `MMQ_MAX_SPLIT`, over that many blocks. Chosen by the
/// matrix's shape only, so that a token's sums do not depend on the step's other tokens.
const MMQ_TARGET_BLOCKS: usize = 264;
const MMQ_MAX_SPLIT: usize = 8;

/// The row parts of a tensor-core launch over `tiles` row tiles of rows of `ncols`:
/// (parts, chunks of 256 weights a part), every part non-empty.
fn mmq_split(tiles: usize, ncols: usize) -> (usize, usize) {
    let chunks = ncols / 256;
    let want = MMQ_TARGET_BLOCKS
        .div_ceil(tiles.max(1))
        .clamp(1, MMQ_MAX_SPLIT.min(chunks));
    let per = chunks.div_ceil(want);
    (chunks.div_ceil(per), per)
}

/// Floats of the tensor-core kernels' work buffer: the most any launch's split rows need
/// (parts x tokens x rows, over the launch's matrices; a launch splits only when its row
/// tiles are fewer than MMQ_TARGET_BLOCKS, so parts x tiles stay below twice that).
const MMQ_WORK: usize = 2 * MMQ_TARGET_BLOCKS * MMQ_TILE * MAX_MMQ_TOKENS;

/// The tensor-core kernels' work buffers: split rows' partial sums, and a counter per row
/// tile (zero between launches: the last part of a tile resets it).
pub struct MmqWork {
    part: CudaSlice<f32>,
    counters: CudaSlice<u32>,
}

impl MmqWork {
    pub fn new(dev: &CudaDevice) -> Result<MmqWork, CudaError> {
        Ok(MmqWork {
            part: dev.stream.alloc_zeros(MMQ_WORK)?,
            counters: dev.stream.alloc_zeros(MMQ_TARGET_BLOCKS)?,
        })
    }

    pub fn bytes(&self) -> usize {
        4 * (self.part.len() + self.counters.len())
    }
}

/// Whether weights of `ty` in rows of `ncols` live on the device regrouped: Q8_0 and Q6_K,
/// whose blocks leave every field misaligned, in groups of 8 blocks with each field
/// together, so that the kernels load 16 aligned bytes at a time (`cu/quant_blocks.cuh`).
/// Rows must be whole groups; every weight upload goes through [`upload_weights`].
pub fn regrouped(ty: GgmlType, ncols: usize) -> bool {
    matches!(ty, GgmlType::Q8_0 | GgmlType::Q6K) && ncols % (8 * ty.block_size()) == 0
}

/// The kernels' id of weights of `ty` in rows of `ncols` (`T_*` in quant_blocks.cuh: the
/// ggml id, plus 100 for a regrouped layout); `None` for a type without kernels.
pub fn device_type_id(ty: GgmlType, ncols: usize) -> Option<i32> {
    if !supported(ty) {
        return None;
    }
    let id = ty as u32 as i32;
    Some(if regrouped(ty, ncols) { id + 100 } else { id })
}

/// Copies weights (`ty`, rows of `ncols`) to the device in the layout the kernels read.
pub fn upload_weights(
    dev: &CudaDevice,
    bytes: &[u8],
    ty: GgmlType,
    ncols: usize,
) -> Result<CudaSlice<u8>, CudaError> {
    let mut w = dev.stream.clone_htod(bytes)?;
    if regrouped(ty, ncols) {
        let group = 8 * ty.type_size();
        if bytes.len() % group != 0 {
            return Err(CudaError::Invalid(format!(
                "{} bytes of {ty} are not whole rows",
                bytes.len()
            )));
        }
        let name = if ty == GgmlType::Q8_0 {
            "regroup_q8_0"
        } else {
            "regroup_q6_k"
        };
        let f = dev.function("dequant", name)?;
        let groups = bytes.len() / group;
        // Grids of at most 2^31 - 1 blocks: a 16 GiB tensor of Q8_0 has 63 M groups.
        for start in (0..groups).step_by(1 << 30) {
            let n = (groups - start).min(1 << 30);
            let mut part = w.slice_mut(start * group..(start + n) * group);
            // SAFETY: n whole groups of the buffer, each rewritten by its own block.
            unsafe {
                dev.stream
                    .launch_builder(&f)
                    .arg(&mut part)
                    .launch(blocks(n, 128))?;
            }
        }
    }
    Ok(w)
}

/// Activations quantized on the device for the integer kernels: int8 values, and per 32
/// values the scale and the scaled sum.
pub struct DeviceActs {
    pub q: CudaSlice<i8>,
    pub d: CudaSlice<f32>,
    pub s: CudaSlice<f32>,
    /// The tensor-core kernels' work buffers, for products of more than MAX_TOKENS tokens
    /// ([`DeviceActs::with_mmq`]).
    pub mmq: Option<MmqWork>,
}

impl DeviceActs {
    /// Room for `n` activations (a multiple of 32).
    pub fn new(dev: &CudaDevice, n: usize) -> Result<DeviceActs, CudaError> {
        if n % 32 != 0 {
            return Err(CudaError::Invalid(format!(
                "{n} activations are not whole blocks of 32"
            )));
        }
        Ok(DeviceActs {
            q: dev.stream.alloc_zeros(n)?,
            d: dev.stream.alloc_zeros(n / 32)?,
            s: dev.stream.alloc_zeros(n / 32)?,
            mmq: None,
        })
    }

    /// Room for `n` activations, with the work buffers for products of up to
    /// [`MAX_MMQ_TOKENS`] tokens.
    pub fn with_mmq(dev: &CudaDevice, n: usize) -> Result<DeviceActs, CudaError> {
        let mut a = DeviceActs::new(dev, n)?;
        a.mmq = Some(MmqWork::new(dev)?);
        Ok(a)
    }

    /// Device bytes held.
    pub fn bytes(&self) -> usize {
        self.q.len() + 8 * self.d.len() + self.mmq.as_ref().map_or(0, MmqWork::bytes)
    }

    /// Quantizes the first `n` values of `x` into this buffer.
    pub fn quantize(
        &mut self,
        dev: &CudaDevice,
        x: &CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        if n % 32 != 0 || n > self.q.len() || n > x.len() {
            return Err(CudaError::Invalid(format!(
                "cannot quantize {n} activations here"
            )));
        }
        let f = dev.function("quant_matvec", "quantize_act_q8")?;
        let cfg = grid_1d(n);
        let n_i = n as i32;
        // SAFETY: n <= the lengths of x and q, n / 32 <= those of d and s.
        unsafe {
            dev.stream
                .launch_builder(&f)
                .arg(x)
                .arg(&mut self.q)
                .arg(&mut self.d)
                .arg(&mut self.s)
                .arg(&n_i)
                .launch(cfg)?;
        }
        Ok(())
    }
}

impl DeviceActs {
    /// Quantizes `act(g) * u` over `n` elements (SiLU, or GELU with `gelu`): the gated FFN
    /// activation and the down projection's input quantization in one launch.
    pub fn gated_quantize(
        &mut self,
        dev: &CudaDevice,
        g: &CudaSlice<f32>,
        u: &CudaSlice<f32>,
        n: usize,
        gelu: bool,
    ) -> Result<(), CudaError> {
        if n % 32 != 0 || g.len() < n || u.len() < n || self.q.len() < n {
            return Err(CudaError::Invalid(format!("gated_quantize: {n} elements")));
        }
        let f = dev.function("quant_matvec", "gated_quantize")?;
        let cfg = grid_1d(n);
        let (n_i, gelu_i) = (n as i32, i32::from(gelu));
        // SAFETY: n elements of g, u and q; n / 32 of d and s (checked above).
        unsafe {
            dev.stream
                .launch_builder(&f)
                .arg(g)
                .arg(u)
                .arg(&mut self.q)
                .arg(&mut self.d)
                .arg(&mut self.s)
                .arg(&n_i)
                .arg(&gelu_i)
                .launch(cfg)?;
        }
        Ok(())
    }

    /// `x_out = x + o` (`o` when given), then quantizes `rms_norm(x_out) * w` into this
    /// buffer, for `rows` rows of `w.len()`: the residual add, the norm and the
    /// quantization of a decode step in one launch (`x_out` must not be `x`: blocks read
    /// all of a row of `x` while others write).
    #[allow(clippy::too_many_arguments)]
    pub fn add_norm_quantize(
        &mut self,
        dev: &CudaDevice,
        x: &CudaSlice<f32>,
        o: Option<&CudaSlice<f32>>,
        x_out: &mut CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let n = w.len();
        let total = rows * n;
        if n % 32 != 0
            || x.len() < total
            || x_out.len() < total
            || o.is_some_and(|o| o.len() < total)
            || self.q.len() < total
        {
            return Err(CudaError::Invalid(format!(
                "add_norm_quantize: {n} elements"
            )));
        }
        let f = dev.function("quant_matvec", "add_norm_quantize")?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(256) as u32, rows as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, null) = (n as i32, 0u64);
        // SAFETY: rows x n elements of x, o, x_out and q, n of w, rows x n / 32 of d and s
        // (checked).
        unsafe {
            let mut b = dev.stream.launch_builder(&f);
            b.arg(x);
            match o {
                Some(o) => b.arg(o),
                None => b.arg(&null),
            };
            b.arg(x_out)
                .arg(w)
                .arg(&mut self.q)
                .arg(&mut self.d)
                .arg(&mut self.s)
                .arg(&n_i)
                .arg(&eps);
            b.launch(cfg)?;
        }
        Ok(())
    }
}

/// `y[t][r] = w[r] . x[t]` for `ntok` tokens: `w` is `nrows` rows of `ncols` weights of
/// type `ty` as [`upload_weights`] lays them out (16-byte aligned), `x` holds `ntok x ncols`
/// quantized activations, `y` is `ntok x nrows` f32.
#[allow(clippy::too_many_arguments)]
pub fn mmvq(
    dev: &CudaDevice,
    ty: GgmlType,
    w: &CudaSlice<u8>,
    x: &DeviceActs,
    y: &mut CudaSlice<f32>,
    ncols: usize,
    nrows: usize,
    ntok: usize,
) -> Result<(), CudaError> {
    mmvq_set(dev, ty, &mut [(w, y, nrows, None)], x, ncols, ntok)
}

/// The matvec kernels of one weight layout (`cu/quant_matvec.cu`): for one token, for up
/// to [`MAX_TOKENS`], and for experts (one token per expert row), with the rows one thread
/// block of [`THREADS`] computes in each.
struct Kernels {
    one: (&'static str, u32),
    batch: (&'static str, u32),
    experts: &'static str,
}

/// Threads per block of every matvec kernel (and of the tensor-core kernels: MMQ_THREADS
/// in quant_mmq.cu).
const THREADS: u32 = 128;

/// The kernels for weights of `ty` in rows of `ncols`; `None` for the types without any
/// (the codebook i-quants, ternary and MXFP4 formats).
fn kernels(ty: GgmlType, ncols: usize) -> Option<Kernels> {
    use GgmlType as G;
    // Q4_K and the regrouped Q6_K / Q8_0: block-cooperative kernels, rows per block as
    // measured (docs/cuda.md); every other format one warp per row.
    let coop = |one: &'static str, rows, batch: &'static str, experts| Kernels {
        one: (one, rows),
        batch: (batch, 2),
        experts,
    };
    let warp = |one: &'static str, experts| Kernels {
        one: (one, THREADS / 32),
        batch: (one, THREADS / 32),
        experts,
    };
    Some(match (ty, regrouped(ty, ncols)) {
        (G::Q4K, _) => coop("mmvq_q4_k", 8, "mmvq_q4_k_batch", "mmvq_moe_q4_k"),
        (G::Q6K, true) => coop("mmvq_q6_k_r", 8, "mmvq_q6_k_r_batch", "mmvq_moe_q6_k_r"),
        (G::Q8_0, true) => coop("mmvq_q8_0_r", 2, "mmvq_q8_0_r_batch", "mmvq_moe_q8_0_r"),
        (G::Q6K, false) => warp("mmvq_q6_k", "mmvq_moe_q6_k"),
        (G::Q8_0, false) => warp("mmvq_q8_0", "mmvq_moe_q8_0"),
        (G::F32, _) => Kernels {
            one: ("mmvq_f32_coop", 2),
            ..warp("mmvq_f32", "mmvq_moe_f32")
        },
        (G::F16, _) => warp("mmvq_f16", "mmvq_moe_f16"),
        (G::Bf16, _) => warp("mmvq_bf16", "mmvq_moe_bf16"),
        (G::Q4_0, _) => warp("mmvq_q4_0", "mmvq_moe_q4_0"),
        (G::Q4_1, _) => warp("mmvq_q4_1", "mmvq_moe_q4_1"),
        (G::Q5_0, _) => warp("mmvq_q5_0", "mmvq_moe_q5_0"),
        (G::Q5_1, _) => warp("mmvq_q5_1", "mmvq_moe_q5_1"),
        (G::Q2K, _) => warp("mmvq_q2_k", "mmvq_moe_q2_k"),
        (G::Q3K, _) => warp("mmvq_q3_k", "mmvq_moe_q3_k"),
        (G::Q5K, _) => warp("mmvq_q5_k", "mmvq_moe_q5_k"),
        (G::Iq4Nl, _) => warp("mmvq_iq4_nl", "mmvq_moe_iq4_nl"),
        (G::Iq4Xs, _) => warp("mmvq_iq4_xs", "mmvq_moe_iq4_xs"),
        _ => return None,
    })
}

/// Whether the GPU has kernels for weights of `ty`.
pub fn supported(ty: GgmlType) -> bool {
    kernels(ty, 0).is_some()
}

/// The kernel's description of up to three matrices (`MatvecSet` in quant_matvec.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct MatvecSet {
    w: [u64; 3],
    y: [u64; 3],
    bias: [u64; 3],
    nrows: [i32; 3],
    first: [i32; 4],
    prefetch: i32,
}

// SAFETY: plain data, laid out as the kernel's struct.
unsafe impl DeviceRepr for MatvecSet {}

/// One product of a set: weights, output, rows, and a bias added to every token's row
/// (`rows` long) where the model has one.
pub type Product<'a> = (
    &'a CudaSlice<u8>,
    &'a mut CudaSlice<f32>,
    usize,
    Option<&'a CudaSlice<f32>>,
);

/// The largest launch (its matrices' bytes together) whose blocks prefetch their weights
/// into L2 before the wait for the previous kernel (`prefetch_block_rows` in
/// quant_matvec.cu). Small launches are where it should pay (their blocks are resident
/// early, while the previous kernel runs; not profiled yet). Measured on the
/// H100 (docs/cuda.md), every launch prefetching (and the decode attention its cache rows,
/// since removed): synthetic qwen2.5-0.5b tg128 1,290 / 1,314 -> 1,377 / 1,379 t/s,
/// qwen3-30b-a3b 414 -> 440, but llama3-8b 376 -> 347. The 8B's launches are 9-66 MB, so
/// under this bound it runs as before; the bound itself is not measured yet.
/// `MEMRA_PREFETCH_MAX_BYTES` sets it, to measure.
const PREFETCH_MAX_BYTES: usize = 8 << 20;

fn prefetch_max_bytes() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("MEMRA_PREFETCH_MAX_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(PREFETCH_MAX_BYTES)
    })
}

/// The smallest launch (its matrices' bytes together) of plain Q8_0 or Q5_0 rows that takes
/// the staged kernels (`mmvq_staged` in quant_matvec.cu: each 32 blocks of a row copied to
/// shared memory with 8-byte loads, then unpacked from there; the same sums, bit for bit, as
/// `mmvq_generic`'s unpacking from global memory with 2-byte loads). Written for the small
/// models' tied Q8_0 heads (Qwen2.5 0.5B: 896 columns, 28 blocks a row, which are not whole
/// regroups of 8; Gemma 3 270M: 640), which Nsight Compute showed read at about 2 TB/s. Off
/// until a lease measures it (no GPU was lent when it was written, docs/cuda.md): the next
/// one runs `MEMRA_STAGED_MIN_BYTES` at 0 (every such launch) and 33554432 (the heads only)
/// beside this default, and `gpu_staged_rows_match_the_generic_kernel`.
const STAGED_MIN_BYTES: usize = usize::MAX;

fn staged_min_bytes() -> usize {
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        std::env::var("MEMRA_STAGED_MIN_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(STAGED_MIN_BYTES)
    })
}

/// The staged kernel for plain rows of `ty` of `row_bytes` in a launch of `bytes`, where
/// it applies: rows of whole 8-byte words (the uploads are 16-byte aligned, so every row
/// then starts at an 8-byte boundary).
fn staged_kernel(ty: GgmlType, row_bytes: usize, bytes: usize) -> Option<&'static str> {
    if row_bytes % 8 != 0 || bytes < staged_min_bytes() {
        return None;
    }
    match ty {
        GgmlType::Q8_0 if row_bytes % (8 * 34) != 0 => Some("mmvq_q8_0_s"),
        GgmlType::Q5_0 => Some("mmvq_q5_0_s"),
        _ => None,
    }
}

/// The kernels' description of `mats` (`ntok` tokens), matrix i in rows of `shape(i).0`
/// bytes taking `shape(i).1` rows a block, and the blocks in all.
fn matvec_set(
    dev: &CudaDevice,
    mats: &mut [Product],
    ntok: usize,
    shape: impl Fn(usize) -> (usize, usize),
) -> Result<(MatvecSet, usize), CudaError> {
    let mut set = MatvecSet {
        w: [0; 3],
        y: [0; 3],
        bias: [0; 3],
        nrows: [0; 3],
        first: [0; 4],
        prefetch: 0,
    };
    let mut blocks = 0usize;
    let mut bytes = 0usize;
    for (i, (w, y, nrows, bias)) in mats.iter_mut().enumerate() {
        let (row_bytes, rows_per_block) = shape(i);
        if *nrows == 0
            || w.len() < row_bytes * *nrows
            || y.len() < ntok * *nrows
            || bias.is_some_and(|b| b.len() < *nrows)
        {
            return Err(CudaError::Invalid("buffers smaller than the shapes".into()));
        }
        set.w[i] = w.device_ptr(&dev.stream).0;
        set.y[i] = y.device_ptr_mut(&dev.stream).0;
        set.bias[i] = bias.map_or(0, |b| b.device_ptr(&dev.stream).0);
        set.nrows[i] = *nrows as i32;
        set.first[i] = blocks as i32;
        blocks += nrows.div_ceil(rows_per_block);
        bytes += row_bytes * *nrows;
    }
    for i in mats.len()..4 {
        set.first[i] = blocks as i32;
    }
    set.prefetch = (bytes <= prefetch_max_bytes()) as i32;
    Ok((set, blocks))
}

/// [`mmvq`] for one to three matrices of type `ty` with the same input, in one launch,
/// each with its bias where it has one.
pub fn mmvq_set(
    dev: &CudaDevice,
    ty: GgmlType,
    mats: &mut [Product],
    x: &DeviceActs,
    ncols: usize,
    ntok: usize,
) -> Result<(), CudaError> {
    let k = kernels(ty, ncols).ok_or(CudaError::Unsupported { op: "matvec", ty })?;
    if ntok > MAX_TOKENS {
        return mmq_set(dev, ty, mats, x, ncols, ntok);
    }
    let (name, rows_per_block) = if ntok == 1 { k.one } else { k.batch };
    let row_bytes = ty
        .row_bytes(ncols as u64)
        .ok_or_else(|| CudaError::Invalid(format!("{ncols} columns are not whole {ty} blocks")))?
        as usize;
    if ntok == 0 {
        return Err(CudaError::Invalid("0 tokens".into()));
    }
    if mats.is_empty() || mats.len() > 3 || x.q.len() < ntok * ncols || ncols % 32 != 0 {
        return Err(CudaError::Invalid("matvec: shapes".into()));
    }
    let (set, blocks) = matvec_set(dev, mats, ntok, |_| (row_bytes, rows_per_block as usize))?;
    let bytes = row_bytes * mats.iter().map(|m| m.2).sum::<usize>();
    let name = staged_kernel(ty, row_bytes, bytes).unwrap_or(name);
    launch_set(dev, name, &set, blocks, x, ncols, ntok)
}

/// The one-token q, k and v products in one launch where v's type differs from q's and
/// k's (Q4_K layers with a Q6_K v, as llama.cpp's Q4_K_M mixes them in half the layers;
/// Q5_0 with Q8_0): a kernel for the pair (`MMVQ_PAIR` in quant_matvec.cu) runs the
/// set's last matrix by the second type's code. `false` where there is none for the
/// pair, the caller then launches by type.
pub fn mmvq_qkv_pair(
    dev: &CudaDevice,
    (qk, v): (GgmlType, GgmlType),
    mats: &mut [Product; 3],
    x: &DeviceActs,
    ncols: usize,
) -> Result<bool, CudaError> {
    use GgmlType as G;
    let name = match (qk, v, regrouped(v, ncols)) {
        (G::Q4K, G::Q6K, true) => "mmvq_q4_k_v_q6_k_r",
        (G::Q4K, G::Q6K, false) => "mmvq_q4_k_v_q6_k",
        (G::Q5_0, G::Q8_0, false) => "mmvq_q5_0_v_q8_0",
        _ => return Ok(false),
    };
    let (ka, kb) = match (kernels(qk, ncols), kernels(v, ncols)) {
        (Some(a), Some(b)) => (a.one.1 as usize, b.one.1 as usize),
        _ => return Ok(false),
    };
    let bytes = |ty: GgmlType| {
        ty.row_bytes(ncols as u64)
            .ok_or_else(|| CudaError::Invalid(format!("{ncols} columns are not whole {ty} blocks")))
    };
    let (ra, rb) = (bytes(qk)? as usize, bytes(v)? as usize);
    if x.q.len() < ncols || ncols % 32 != 0 {
        return Err(CudaError::Invalid("matvec: shapes".into()));
    }
    let (set, blocks) = matvec_set(dev, mats, 1, |i| if i == 2 { (rb, kb) } else { (ra, ka) })?;
    launch_set(dev, name, &set, blocks, x, ncols, 1)?;
    Ok(true)
}

/// Launches the mat-vec kernel `name` over `set`.
fn launch_set(
    dev: &CudaDevice,
    name: &'static str,
    set: &MatvecSet,
    blocks: usize,
    x: &DeviceActs,
    ncols: usize,
    ntok: usize,
) -> Result<(), CudaError> {
    let blocks = blocks as u32;
    let f = dev.function("quant_matvec", name)?;
    let cfg = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (c, t) = (ncols as i32, ntok as i32);
    // SAFETY: every matrix and output was checked against its shape; the kernel reads
    // `nrows` rows of each `w`, `ntok x ncols` activations, and writes `ntok x nrows` of
    // each `y`. The buffers outlive the launch (the caller holds them).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(set)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(&c)
            .arg(&t)
            .launch(cfg)?;
    }
    Ok(())
}

/// The tensor-core kernels' description of up to three matrices (`MmqSet` in quant_mmq.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct MmqSet {
    /// The same fields as the mat-vec kernels' (C lays `part` out after them at the same
    /// offset: both structs align to 8).
    mats: MatvecSet,
    part: [i64; 3],
}

// SAFETY: plain data, laid out as the kernel's struct.
unsafe impl DeviceRepr for MmqSet {}

/// [`mmvq_set`] for 9 to [`MAX_MMQ_TOKENS`] tokens, on the int8 tensor cores.
fn mmq_set(
    dev: &CudaDevice,
    ty: GgmlType,
    mats: &mut [Product],
    x: &DeviceActs,
    ncols: usize,
    ntok: usize,
) -> Result<(), CudaError> {
    let name = mmq_kernel(ty, ncols).ok_or_else(|| {
        CudaError::Invalid(format!(
            "{ntok} tokens of {ty} in rows of {ncols} (at most {MAX_TOKENS})"
        ))
    })?;
    if ntok > MAX_MMQ_TOKENS {
        return Err(CudaError::Invalid(format!(
            "{ntok} tokens (at most {MAX_MMQ_TOKENS})"
        )));
    }
    let work = x.mmq.as_ref().ok_or_else(|| {
        CudaError::Invalid("activations without the tensor-core work buffers".into())
    })?;
    if mats.is_empty() || mats.len() > 3 || x.q.len() < ntok * ncols {
        return Err(CudaError::Invalid("matvec: shapes".into()));
    }
    let row_bytes = ty.row_bytes(ncols as u64).expect("whole blocks") as usize;
    let (mats_set, tiles) = matvec_set(dev, mats, ntok, |_| (row_bytes, MMQ_TILE))?;
    let mut set = MmqSet {
        mats: mats_set,
        part: [0; 3],
    };
    let (parts, _) = mmq_split(tiles, ncols);
    if parts > 1 {
        let mut at = 0usize;
        for (i, (_, _, nrows, _)) in mats.iter().enumerate() {
            set.part[i] = at as i64;
            at += parts * ntok * *nrows;
        }
        if at > work.part.len() || tiles > work.counters.len() {
            return Err(CudaError::Invalid(format!(
                "tensor-core work of {at} floats and {tiles} tiles (room for {} and {})",
                work.part.len(),
                work.counters.len()
            )));
        }
    }
    let f = dev.function("quant_mmq", name)?;
    // Two stages of the weights' rows and 16 tokens' activations (Stage in quant_mmq.cu).
    let staged_row = match ty {
        GgmlType::Q4K => 160,
        GgmlType::Q6K => 240,
        _ => 288,
    };
    let smem = 2 * (MMQ_TILE * staged_row + MAX_MMQ_TOKENS * (288 + 2 * 32));
    // Within the 48 KiB a launch may ask without raising the function's limit.
    debug_assert!(smem <= 48 << 10);
    let cfg = LaunchConfig {
        grid_dim: (tiles as u32, parts as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let (c, t) = (ncols as i32, ntok as i32);
    let (part, counters) = (
        work.part.device_ptr(&dev.stream).0,
        work.counters.device_ptr(&dev.stream).0,
    );
    // SAFETY: every matrix and output was checked against its shape and the work buffer
    // against the split rows' sums; the kernel reads `nrows` rows of each `w` and `ntok x
    // ncols` activations, writes `ntok x nrows` of each `y`, its parts' sums and the tile
    // counters (which it leaves at zero). The work buffers are written through a shared
    // reference: only the launches of this stream use them, one after another.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(&set)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(&c)
            .arg(&t)
            .arg(&part)
            .arg(&counters)
            .launch(cfg)?;
    }
    Ok(())
}

/// One token's F32 MoE router (`w`: `n_exp x ncols`) into `logits` and its routing into
/// `ids` and `weights` (`n_used` each, as [`super::ops::moe_route`] writes them) in one
/// launch: the last of its blocks routes (`moe_router_f32`), counting in `counter` (zero
/// before, zero after). `false` for routers of other types or shapes, which the caller
/// runs as a product and a routing launch.
#[allow(clippy::too_many_arguments)]
pub fn moe_router_route(
    dev: &CudaDevice,
    w: &CudaSlice<u8>,
    ty: GgmlType,
    (ncols, n_exp): (usize, usize),
    x: &DeviceActs,
    logits: &mut CudaSlice<f32>,
    counter: &mut CudaSlice<u32>,
    (ids, weights): (&mut CudaSlice<i32>, &mut CudaSlice<f32>),
    n_used: usize,
    normalize: bool,
) -> Result<bool, CudaError> {
    if ty != GgmlType::F32 || !(1..=16).contains(&n_used) || n_used > n_exp || n_exp > 1024 {
        return Ok(false);
    }
    if ncols % 32 != 0
        || w.len() < 4 * ncols * n_exp
        || x.q.len() < ncols
        || logits.len() < n_exp
        || counter.is_empty()
        || ids.len() < n_used
        || weights.len() < n_used
    {
        return Err(CudaError::Invalid("router: shapes".into()));
    }
    let f = dev.function("quant_matvec", "moe_router_f32")?;
    let cfg = LaunchConfig {
        grid_dim: (n_exp.div_ceil(2) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (c, e, k, norm) = (
        ncols as i32,
        n_exp as i32,
        n_used as i32,
        i32::from(normalize),
    );
    // SAFETY: shapes checked above; the kernel reads n_exp rows of ncols floats and the
    // token's activations, writes n_exp logits and n_used ids and weights, and leaves the
    // counter at zero.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(w)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(logits)
            .arg(&c)
            .arg(&e)
            .arg(counter)
            .arg(ids)
            .arg(weights)
            .arg(&k)
            .arg(&norm)
            .launch(cfg)?;
    }
    Ok(true)
}

/// Expert weights of one projection: `n_expert` matrices of `n_out x n_in`, one after the
/// other (`stride` bytes apart).
pub struct ExpertWeights<'a> {
    pub w: &'a CudaSlice<u8>,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    pub n_expert: usize,
}

/// The chosen experts' products for `n_tok` tokens: `ids` (`n_tok x n_used`, on the
/// device) name the experts; the input is each token's row of `x` (`per_slot` false) or
/// each (token, slot) row (`per_slot` true); `y` gets `n_tok x n_used x n_out`.
#[allow(clippy::too_many_arguments)]
pub fn mmvq_moe(
    dev: &CudaDevice,
    e: &ExpertWeights,
    ids: &CudaSlice<i32>,
    n_used: usize,
    x: &DeviceActs,
    y: &mut CudaSlice<f32>,
    n_tok: usize,
    per_slot: bool,
) -> Result<(), CudaError> {
    let k = kernels(e.ty, e.n_in).ok_or(CudaError::Unsupported {
        op: "expert matvec",
        ty: e.ty,
    })?;
    let (name, rows_per_block) = (k.experts, k.one.1);
    let stride = expert_stride(e)?;
    let rows_in = if per_slot { n_tok * n_used } else { n_tok };
    if e.w.len() < stride * e.n_expert
        || ids.len() < n_tok * n_used
        || x.q.len() < rows_in * e.n_in
        || y.len() < n_tok * n_used * e.n_out
        || e.n_in % 32 != 0
    {
        return Err(CudaError::Invalid("expert matvec: shapes".into()));
    }
    let f = dev.function("quant_matvec", name)?;
    let cfg = LaunchConfig {
        grid_dim: (
            (e.n_out as u32).div_ceil(rows_per_block),
            n_used as u32,
            n_tok as u32,
        ),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (st, nu, c, r, ps) = (
        stride as i64,
        n_used as i32,
        e.n_in as i32,
        e.n_out as i32,
        i32::from(per_slot),
    );
    // SAFETY: shapes checked above; the ids are expert indices below n_expert (written by
    // moe_route from n_expert router logits).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(e.w)
            .arg(&st)
            .arg(ids)
            .arg(&nu)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(y)
            .arg(&c)
            .arg(&r)
            .arg(&ps)
            .launch(cfg)?;
    }
    Ok(())
}

/// The fused expert kernels (`MOE_FUSED` in quant_matvec.cu) for weights of `ty` in rows
/// of `ncols`, the block-cooperative formats: gate/up, down, and the down kernel's rows
/// per block.
fn moe_fused(ty: GgmlType, ncols: usize) -> Option<(&'static str, &'static str, usize)> {
    use GgmlType as G;
    ty.row_bytes(ncols as u64)?;
    Some(match (ty, regrouped(ty, ncols)) {
        (G::Q4K, _) => ("moe_gate_up_q4_k", "moe_down_q4_k", 8),
        (G::Q6K, true) => ("moe_gate_up_q6_k_r", "moe_down_q6_k_r", 8),
        (G::Q6K, false) => ("moe_gate_up_q6_k", "moe_down_q6_k", 8),
        (G::Q8_0, true) => ("moe_gate_up_q8_0_r", "moe_down_q8_0_r", 4),
        _ => return None,
    })
}

/// Whether an expert FFN of these projections runs as two fused launches
/// ([`moe_gate_up`], [`moe_down`]) rather than five.
pub fn moe_fused_supported(gate: &ExpertWeights, up: &ExpertWeights, down: &ExpertWeights) -> bool {
    gate.ty == up.ty
        && (gate.n_in, gate.n_out) == (up.n_in, up.n_out)
        && down.n_in == gate.n_out
        && gate.n_out % 32 == 0
        && moe_fused(gate.ty, gate.n_in).is_some()
        && moe_fused(down.ty, down.n_in).is_some()
}

/// Bytes between consecutive experts of `e`.
fn expert_stride(e: &ExpertWeights) -> Result<usize, CudaError> {
    Ok(e.ty.row_bytes(e.n_in as u64).ok_or_else(|| {
        CudaError::Invalid(format!("{} columns are not whole {} blocks", e.n_in, e.ty))
    })? as usize
        * e.n_out)
}

/// The chosen experts' gate and up products for `n_tok` tokens (input: each token's row
/// of `x`), and the gated activation, quantized into `out` as the down products' input
/// (`n_tok x n_used` rows of `gate.n_out`). Needs [`moe_fused_supported`].
#[allow(clippy::too_many_arguments)]
pub fn moe_gate_up(
    dev: &CudaDevice,
    gate: &ExpertWeights,
    up: &ExpertWeights,
    ids: &CudaSlice<i32>,
    n_used: usize,
    x: &DeviceActs,
    out: &mut DeviceActs,
    n_tok: usize,
    gelu: bool,
) -> Result<(), CudaError> {
    let (name, _, _) = moe_fused(gate.ty, gate.n_in)
        .filter(|_| gate.ty == up.ty && (gate.n_in, gate.n_out) == (up.n_in, up.n_out))
        .ok_or(CudaError::Unsupported {
            op: "fused expert gate/up",
            ty: gate.ty,
        })?;
    let stride = expert_stride(gate)?;
    let rows_out = n_tok * n_used * gate.n_out;
    if gate.w.len() < stride * gate.n_expert
        || up.w.len() < stride * up.n_expert
        || ids.len() < n_tok * n_used
        || x.q.len() < n_tok * gate.n_in
        || out.q.len() < rows_out
        || gate.n_out % 32 != 0
    {
        return Err(CudaError::Invalid("fused expert gate/up: shapes".into()));
    }
    let f = dev.function("quant_matvec", name)?;
    let cfg = LaunchConfig {
        grid_dim: ((gate.n_out / 32) as u32, n_used as u32, n_tok as u32),
        block_dim: (MOE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (st, nu, c, r, g) = (
        stride as i64,
        n_used as i32,
        gate.n_in as i32,
        gate.n_out as i32,
        i32::from(gelu),
    );
    // SAFETY: shapes checked above; the ids are expert indices below n_expert (written by
    // moe_route from n_expert router logits).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(gate.w)
            .arg(up.w)
            .arg(&st)
            .arg(ids)
            .arg(&nu)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(&mut out.q)
            .arg(&mut out.d)
            .arg(&mut out.s)
            .arg(&c)
            .arg(&r)
            .arg(&g)
            .launch(cfg)?;
    }
    Ok(())
}

/// The chosen experts' down products of each (token, slot) row of `x` and their sum
/// weighted by `weights` (`n_tok x n_used`) into `y` (`n_tok x down.n_out`).
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    dev: &CudaDevice,
    down: &ExpertWeights,
    ids: &CudaSlice<i32>,
    weights: &CudaSlice<f32>,
    n_used: usize,
    x: &DeviceActs,
    y: &mut CudaSlice<f32>,
    n_tok: usize,
) -> Result<(), CudaError> {
    let (_, name, rows_per_block) =
        moe_fused(down.ty, down.n_in).ok_or(CudaError::Unsupported {
            op: "fused expert down",
            ty: down.ty,
        })?;
    let stride = expert_stride(down)?;
    if down.w.len() < stride * down.n_expert
        || ids.len() < n_tok * n_used
        || weights.len() < n_tok * n_used
        || x.q.len() < n_tok * n_used * down.n_in
        || y.len() < n_tok * down.n_out
    {
        return Err(CudaError::Invalid("fused expert down: shapes".into()));
    }
    let f = dev.function("quant_matvec", name)?;
    let cfg = LaunchConfig {
        grid_dim: (down.n_out.div_ceil(rows_per_block) as u32, n_tok as u32, 1),
        block_dim: (MOE_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (st, nu, c, r) = (
        stride as i64,
        n_used as i32,
        down.n_in as i32,
        down.n_out as i32,
    );
    // SAFETY: shapes checked above; the ids are expert indices below n_expert.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(down.w)
            .arg(&st)
            .arg(ids)
            .arg(weights)
            .arg(&nu)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(y)
            .arg(&c)
            .arg(&r)
            .launch(cfg)?;
    }
    Ok(())
}

/// Threads per block of the fused expert kernels (MOE_WARPS warps).
const MOE_THREADS: u32 = 512;

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use memra_gguf::quant::{dequantize_to_vec, f16_scale_fields};

    pub(crate) fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    /// Random blocks with small positive f16 scales; random values in [-1, 1] for the
    /// float types.
    pub(crate) fn random_weights(
        ty: GgmlType,
        ncols: usize,
        nrows: usize,
        seed: &mut u64,
    ) -> Vec<u8> {
        let n = nrows * ty.row_bytes(ncols as u64).unwrap() as usize;
        let mut float = || (lcg(seed) % 20001) as f32 / 10000.0 - 1.0;
        match ty {
            GgmlType::F32 => return (0..n / 4).flat_map(|_| float().to_le_bytes()).collect(),
            GgmlType::F16 => {
                return (0..n / 2)
                    .flat_map(|_| half::f16::from_f32(float()).to_le_bytes())
                    .collect()
            }
            GgmlType::Bf16 => {
                return (0..n / 2)
                    .flat_map(|_| half::bf16::from_f32(float()).to_le_bytes())
                    .collect()
            }
            _ => {}
        }
        let mut w: Vec<u8> = (0..n).map(|_| lcg(seed) as u8).collect();
        for b in w.chunks_exact_mut(ty.type_size()) {
            for &f in f16_scale_fields(ty) {
                let v = half::f16::from_f32((lcg(seed) % 1000) as f32 * 1e-5 + 1e-4);
                b[f..f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    /// Every weight type the GPU kernels take.
    pub(crate) const GPU_TYPES: [GgmlType; 15] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Bf16,
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
    ];

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_matvec_matches_the_cpu_reference() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 11u64;
        for ty in GPU_TYPES {
            // 800 columns: Q8_0 rows that are not whole groups (the plain layout); 896: nor
            // those, but whole 8-byte words (the staged kernels above their bound); 4096:
            // Q6_K regrouped, 256 and 2816 not.
            for (ncols, nrows) in [
                (256usize, 1usize),
                (2816, 37),
                (4096, 130),
                (800, 5),
                (896, 9),
            ] {
                if ncols % ty.block_size() != 0 {
                    continue;
                }
                let w = random_weights(ty, ncols, nrows, &mut seed);
                for ntok in [1usize, 3, 8] {
                    check_products(&dev, ty, &w, ncols, nrows, ntok, &mut seed);
                }
            }
        }
        let none = mmvq(
            &dev,
            GgmlType::Iq2Xxs,
            &dev.stream.alloc_zeros(66).unwrap(),
            &DeviceActs::new(&dev, 256).unwrap(),
            &mut dev.stream.alloc_zeros(1).unwrap(),
            256,
            1,
            1,
        );
        assert!(matches!(none, Err(CudaError::Unsupported { .. })));
    }

    /// The staged kernels (plain Q8_0 and Q5_0 rows of whole 8-byte words, copied to shared
    /// memory before unpacking) give the generic kernels' sums bit for bit: rows of fewer
    /// than 32 blocks, of a chunk and a part, of several whole chunks; 1, 3 and 8 tokens;
    /// and the chooser takes them only for such rows, above its bound.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_staged_rows_match_the_generic_kernel() {
        use GgmlType as G;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 23u64;
        for (ty, generic, staged) in [
            (G::Q8_0, "mmvq_q8_0", "mmvq_q8_0_s"),
            (G::Q5_0, "mmvq_q5_0", "mmvq_q5_0_s"),
        ] {
            for (ncols, nrows) in [(896usize, 9usize), (640, 13), (1152, 7), (4096, 5)] {
                let row_bytes = ty.row_bytes(ncols as u64).unwrap() as usize;
                let bytes = random_weights(ty, ncols, nrows, &mut seed);
                let w = upload_weights(&dev, &bytes, ty, ncols).unwrap();
                if ty == G::Q8_0 && regrouped(ty, ncols) {
                    assert_eq!(staged_kernel(ty, row_bytes, usize::MAX), None);
                    continue;
                }
                assert_eq!(staged_kernel(ty, row_bytes, usize::MAX), Some(staged));
                assert_eq!(
                    staged_kernel(ty, row_bytes, 0).is_some(),
                    staged_min_bytes() == 0
                );
                for ntok in [1usize, 3, 8] {
                    let x: Vec<f32> = (0..ntok * ncols)
                        .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                        .collect();
                    let mut acts = DeviceActs::new(&dev, ntok * ncols).unwrap();
                    acts.quantize(&dev, &dev.stream.clone_htod(&x).unwrap(), ntok * ncols)
                        .unwrap();
                    let bias: Vec<f32> = (0..nrows).map(|i| i as f32 / 10.0 - 0.5).collect();
                    let bias = dev.stream.clone_htod(&bias).unwrap();
                    let run = |name: &'static str| {
                        let mut y = dev
                            .stream
                            .clone_htod(&vec![f32::NAN; ntok * nrows])
                            .unwrap();
                        let mut m = [(&w, &mut y, nrows, Some(&bias))];
                        let (set, blocks) =
                            matvec_set(&dev, &mut m, ntok, |_| (row_bytes, 4)).unwrap();
                        launch_set(&dev, name, &set, blocks, &acts, ncols, ntok).unwrap();
                        dev.stream.clone_dtoh(&y).unwrap()
                    };
                    let (a, b) = (run(generic), run(staged));
                    assert!(a.iter().all(|v| v.is_finite()) && a.iter().any(|v| *v != 0.0));
                    assert_eq!(
                        a.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        b.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty} at {ncols} columns, {ntok} tokens"
                    );
                }
            }
        }
        // Rows that are not whole 8-byte words (25 Q8_0 blocks) stay on the generic kernel.
        assert_eq!(staged_kernel(G::Q8_0, 25 * 34, usize::MAX), None);
        assert_eq!(staged_kernel(G::Q4K, 4 * 144, usize::MAX), None);
    }

    /// Multiplies `w` (`nrows` rows of `ncols` weights of `ty`) with `ntok` random tokens on
    /// the device and checks each product against f64 sums of the dequantized weights and
    /// the activations as the kernels round them (int8 per 32, scale amax / 127); with an
    /// odd number of tokens, plus a random bias per row.
    fn check_products(
        dev: &CudaDevice,
        ty: GgmlType,
        w: &[u8],
        ncols: usize,
        nrows: usize,
        ntok: usize,
        seed: &mut u64,
    ) {
        let x: Vec<f32> = (0..ntok * ncols)
            .map(|_| (lcg(seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let wd = upload_weights(dev, w, ty, ncols).unwrap();
        let xd = dev.stream.clone_htod(&x).unwrap();
        let mut yd = dev
            .stream
            .clone_htod(&vec![f32::NAN; ntok * nrows])
            .unwrap();
        let mut acts = DeviceActs::with_mmq(dev, ntok * ncols).unwrap();
        acts.quantize(dev, &xd, ntok * ncols).unwrap();
        let bias: Vec<f32> = (0..nrows)
            .map(|_| {
                if ntok % 2 == 1 {
                    (lcg(seed) % 2001) as f32 / 100.0 - 10.0
                } else {
                    0.0
                }
            })
            .collect();
        let bd = dev.stream.clone_htod(&bias).unwrap();
        let b = (ntok % 2 == 1).then_some(&bd);
        mmvq_set(dev, ty, &mut [(&wd, &mut yd, nrows, b)], &acts, ncols, ntok).unwrap();
        let y = dev.stream.clone_dtoh(&yd).unwrap();
        let x: Vec<f32> = x
            .chunks_exact(32)
            .flat_map(|c| {
                let d = c.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                c.iter()
                    .map(move |v| if d == 0.0 { 0.0 } else { (v / d).round() * d })
                    .collect::<Vec<_>>()
            })
            .collect();
        let rb = ty.row_bytes(ncols as u64).unwrap() as usize;
        for r in 0..nrows {
            let wr = dequantize_to_vec(ty, &w[r * rb..(r + 1) * rb]).unwrap();
            for t in 0..ntok {
                let xt = &x[t * ncols..(t + 1) * ncols];
                let want: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(a, b)| f64::from(*a) * f64::from(*b))
                    .sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xt)
                    .map(|(a, b)| f64::from((a * b).abs()))
                    .sum();
                let got = f64::from(y[t * nrows + r]) - f64::from(bias[r]);
                assert!(
                    (got - want).abs() <= 1e-5 * mag + 1e-5,
                    "{ty} {ncols}x{nrows} {ntok} tokens, t{t} row {r}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn mmq_splits_cover_the_row_in_non_empty_parts() {
        for ncols in (256..=16384).step_by(256) {
            let chunks = ncols / 256;
            for tiles in [1usize, 2, 3, 16, 64, 96, 263, 264, 2004] {
                let (parts, per) = mmq_split(tiles, ncols);
                assert!((1..=MMQ_MAX_SPLIT.min(chunks)).contains(&parts));
                // The kernel's parts: ceil(chunks / parts) each, the last one not empty.
                let per_k = chunks.div_ceil(parts);
                assert!(per_k <= per && (parts - 1) * per_k < chunks && parts * per_k >= chunks);
                if tiles >= MMQ_TARGET_BLOCKS {
                    assert_eq!(parts, 1, "{tiles} tiles");
                } else {
                    assert!(parts * tiles * MMQ_TILE * MAX_MMQ_TOKENS <= MMQ_WORK);
                }
            }
        }
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_mmq_matches_the_cpu_reference() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 29u64;
        for ty in [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q8_0] {
            // Rows that fill no tile of 64, one, and several; rows split in 4 to 8 parts
            // (few tiles) and not split (one chunk of 256 columns; enough tiles).
            let shapes = [
                (256usize, 5usize),
                (4096, 130),
                (2048, 64),
                (1024, 37),
                (6144, 21),
                (2048, 16900),
            ];
            for (ncols, nrows) in shapes {
                if !mmq_supported(ty, ncols) {
                    // Q6_K rows that are not whole groups of 8 blocks (not regrouped).
                    assert!(ty == GgmlType::Q6K && ncols % 2048 != 0, "{ty} {ncols}");
                    continue;
                }
                let w = random_weights(ty, ncols, nrows, &mut seed);
                let toks: &[usize] = match nrows {
                    16900 => &[16],
                    _ => &[9, 12, 16],
                };
                for &ntok in toks {
                    check_products(&dev, ty, &w, ncols, nrows, ntok, &mut seed);
                }
            }
        }
        // Too many tokens, a format without tensor-core kernels, activations without the
        // work buffers, too few activations.
        let w = dev.stream.alloc_zeros::<u8>(176 * 16).unwrap();
        let mut y = dev.stream.alloc_zeros::<f32>(65 * 16).unwrap();
        let acts = DeviceActs::with_mmq(&dev, 65 * 256).unwrap();
        assert!(mmvq(&dev, GgmlType::Q4K, &w, &acts, &mut y, 256, 16, 17).is_err());
        assert!(mmvq(&dev, GgmlType::Q5K, &w, &acts, &mut y, 256, 16, 9).is_err());
        let plain = DeviceActs::new(&dev, 12 * 256).unwrap();
        assert!(mmvq(&dev, GgmlType::Q4K, &w, &plain, &mut y, 256, 16, 12).is_err());
        let short = DeviceActs::with_mmq(&dev, 11 * 256).unwrap();
        assert!(mmvq(&dev, GgmlType::Q4K, &w, &short, &mut y, 256, 16, 12).is_err());
    }

    /// The tensor-core kernels' 16 tokens against the dp4a kernels' 8 on the llama3-8b shapes:
    /// `--ignored gpu_mmq_bandwidth --nocapture`.
    /// The fused expert kernels against the separate ones (gate, up, activation, down,
    /// weighted sum; each checked against the CPU by the tests above and the MoE model
    /// tests): random weights of every fused format, plain and regrouped, random routing.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_fused_experts_match_the_separate_kernels() {
        use super::super::ops::moe_combine;
        use GgmlType as G;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 23u64;
        let (n_exp, n_used) = (6usize, 3usize);
        // (gate/up type, down type, n_embd, expert width): the 30B's shape with Q4_K and
        // plain Q6_K downs, regrouped Q6_K and Q8_0, plain Q6_K gate/up rows.
        for (gty, dty, e, f) in [
            (G::Q4K, G::Q4K, 2048, 768),
            (G::Q4K, G::Q6K, 2048, 768),
            (G::Q6K, G::Q6K, 2048, 2048),
            (G::Q8_0, G::Q8_0, 512, 256),
            (G::Q6K, G::Q4K, 768, 512),
        ] {
            for n_tok in [1usize, 5] {
                let up_w = |ty, n_in, n_out, seed: &mut u64| {
                    let b = random_weights(ty, n_in, n_out * n_exp, seed);
                    upload_weights(&dev, &b, ty, n_in).unwrap()
                };
                let (gw, uw, dw) = (
                    up_w(gty, e, f, &mut seed),
                    up_w(gty, e, f, &mut seed),
                    up_w(dty, f, e, &mut seed),
                );
                let ew = |w, ty, n_in, n_out| ExpertWeights {
                    w,
                    ty,
                    n_in,
                    n_out,
                    n_expert: n_exp,
                };
                let (gate, up, down) = (ew(&gw, gty, e, f), ew(&uw, gty, e, f), ew(&dw, dty, f, e));
                assert!(moe_fused_supported(&gate, &up, &down), "{gty} {dty}");
                let mut ids = Vec::new();
                let mut wts = Vec::new();
                for _ in 0..n_tok {
                    let mut chosen: Vec<i32> = Vec::new();
                    while chosen.len() < n_used {
                        let id = (lcg(&mut seed) % n_exp as u64) as i32;
                        if !chosen.contains(&id) {
                            chosen.push(id);
                        }
                    }
                    ids.extend(chosen);
                    wts.extend((0..n_used).map(|_| (lcg(&mut seed) % 1000) as f32 / 1000.0));
                }
                let x: Vec<f32> = (0..n_tok * e)
                    .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let (idd, wd) = (
                    dev.stream.clone_htod(&ids).unwrap(),
                    dev.stream.clone_htod(&wts).unwrap(),
                );
                let mut acts = DeviceActs::new(&dev, n_tok * e).unwrap();
                acts.quantize(&dev, &dev.stream.clone_htod(&x).unwrap(), n_tok * e)
                    .unwrap();
                let mut gated = DeviceActs::new(&dev, n_tok * n_used * f).unwrap();
                let mut fused = dev.stream.alloc_zeros::<f32>(n_tok * e).unwrap();
                moe_gate_up(
                    &dev, &gate, &up, &idd, n_used, &acts, &mut gated, n_tok, false,
                )
                .unwrap();
                moe_down(&dev, &down, &idd, &wd, n_used, &gated, &mut fused, n_tok).unwrap();
                let mut g = dev.stream.alloc_zeros::<f32>(n_tok * n_used * f).unwrap();
                let mut u = dev.stream.alloc_zeros::<f32>(n_tok * n_used * f).unwrap();
                mmvq_moe(&dev, &gate, &idd, n_used, &acts, &mut g, n_tok, false).unwrap();
                mmvq_moe(&dev, &up, &idd, n_used, &acts, &mut u, n_tok, false).unwrap();
                let mut acts2 = DeviceActs::new(&dev, n_tok * n_used * f).unwrap();
                acts2
                    .gated_quantize(&dev, &g, &u, n_tok * n_used * f, false)
                    .unwrap();
                let mut y = dev.stream.alloc_zeros::<f32>(n_tok * n_used * e).unwrap();
                mmvq_moe(&dev, &down, &idd, n_used, &acts2, &mut y, n_tok, true).unwrap();
                let mut sep = dev.stream.alloc_zeros::<f32>(n_tok * e).unwrap();
                moe_combine(&dev, &y, &wd, &mut sep, n_tok, n_used, e).unwrap();
                let (a, b) = (
                    dev.stream.clone_dtoh(&fused).unwrap(),
                    dev.stream.clone_dtoh(&sep).unwrap(),
                );
                let big = b.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert!(big > 0.0 && big.is_finite());
                for (i, (p, q)) in a.iter().zip(&b).enumerate() {
                    // The gated activations are rounded to int8 after sums taken in another
                    // order: a level may flip here and there.
                    assert!(
                        (p - q).abs() <= 2e-3 * big,
                        "{gty}/{dty} {n_tok} tokens, element {i}: {p} vs {q} (max {big})"
                    );
                }
            }
        }
        let q5 = ExpertWeights {
            w: &dev.stream.alloc_zeros(22 * 8 * 2).unwrap(),
            ty: G::Q5_0,
            n_in: 32,
            n_out: 32,
            n_expert: 1,
        };
        assert!(!moe_fused_supported(&q5, &q5, &q5));
    }

    /// The router that routes in its last block against the router product and
    /// `moe_route` apart (the same device code: the same bits), twice in a row (its counter
    /// back at zero); routers of other types declined.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_router_routes_as_the_two_launches() {
        use super::super::ops::moe_route;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 43u64;
        for (ncols, n_exp, n_used) in [
            (2048usize, 128usize, 8usize),
            (256, 8, 2),
            (512, 60, 4),
            (1024, 1000, 16),
        ] {
            let bytes = random_weights(GgmlType::F32, ncols, n_exp, &mut seed);
            let w = upload_weights(&dev, &bytes, GgmlType::F32, ncols).unwrap();
            let mut counter = dev.stream.alloc_zeros::<u32>(1).unwrap();
            for rep in 0..2 {
                let x: Vec<f32> = (0..ncols)
                    .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                    .collect();
                let mut acts = DeviceActs::new(&dev, ncols).unwrap();
                acts.quantize(&dev, &dev.stream.clone_htod(&x).unwrap(), ncols)
                    .unwrap();
                let mut l1 = dev.stream.alloc_zeros::<f32>(n_exp).unwrap();
                let (mut i1, mut w1) = (
                    dev.stream.alloc_zeros::<i32>(n_used).unwrap(),
                    dev.stream.alloc_zeros::<f32>(n_used).unwrap(),
                );
                let fused = moe_router_route(
                    &dev,
                    &w,
                    GgmlType::F32,
                    (ncols, n_exp),
                    &acts,
                    &mut l1,
                    &mut counter,
                    (&mut i1, &mut w1),
                    n_used,
                    true,
                )
                .unwrap();
                assert!(fused);
                let mut l2 = dev.stream.alloc_zeros::<f32>(n_exp).unwrap();
                let (mut i2, mut w2) = (
                    dev.stream.alloc_zeros::<i32>(n_used).unwrap(),
                    dev.stream.alloc_zeros::<f32>(n_used).unwrap(),
                );
                mmvq(&dev, GgmlType::F32, &w, &acts, &mut l2, ncols, n_exp, 1).unwrap();
                moe_route(&dev, &l2, &mut i2, &mut w2, 1, n_exp, n_used, true).unwrap();
                let what = format!("{n_exp} experts of {ncols}, {n_used} used, run {rep}");
                let h = |d: &CudaSlice<f32>| dev.stream.clone_dtoh(d).unwrap();
                let ids = |d: &CudaSlice<i32>| dev.stream.clone_dtoh(d).unwrap();
                assert_eq!(h(&l1), h(&l2), "{what}: logits");
                assert_eq!(ids(&i1), ids(&i2), "{what}: ids");
                assert_eq!(h(&w1), h(&w2), "{what}: weights");
                assert_eq!(dev.stream.clone_dtoh(&counter).unwrap(), [0], "{what}");
            }
        }
        let w = dev.stream.alloc_zeros::<u8>(1 << 16).unwrap();
        let acts = DeviceActs::new(&dev, 256).unwrap();
        let mut l = dev.stream.alloc_zeros::<f32>(64).unwrap();
        let mut c = dev.stream.alloc_zeros::<u32>(1).unwrap();
        let (mut i, mut wt) = (
            dev.stream.alloc_zeros::<i32>(8).unwrap(),
            dev.stream.alloc_zeros::<f32>(8).unwrap(),
        );
        let q8 = moe_router_route(
            &dev,
            &w,
            GgmlType::Q8_0,
            (256, 64),
            &acts,
            &mut l,
            &mut c,
            (&mut i, &mut wt),
            8,
            true,
        );
        assert!(!q8.unwrap());
        let short = moe_router_route(
            &dev,
            &w,
            GgmlType::F32,
            (256, 128),
            &acts,
            &mut l,
            &mut c,
            (&mut i, &mut wt),
            8,
            true,
        );
        assert!(short.is_err());
    }

    /// The q/k/v pair kernels against one launch per matrix (the same device code, so the
    /// same bits): Q4_K with regrouped and plain Q6_K, Q5_0 with Q8_0, biases on some;
    /// pairs without a kernel are declined.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_qkv_pair_matches_one_launch_per_matrix() {
        use GgmlType as G;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 41u64;
        for (a, b, ncols) in [
            (G::Q4K, G::Q6K, 2048usize),
            (G::Q4K, G::Q6K, 2816),
            (G::Q5_0, G::Q8_0, 896),
        ] {
            let rows = [ncols, 256, 256 + 8 * 3];
            let tys = [a, a, b];
            let w: Vec<_> = (0..3)
                .map(|i| {
                    let bytes = random_weights(tys[i], ncols, rows[i], &mut seed);
                    upload_weights(&dev, &bytes, tys[i], ncols).unwrap()
                })
                .collect();
            let bias: Vec<f32> = (0..rows[2]).map(|i| i as f32 / 100.0 - 1.0).collect();
            let bias = dev.stream.clone_htod(&bias).unwrap();
            let x: Vec<f32> = (0..ncols)
                .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let mut acts = DeviceActs::new(&dev, ncols).unwrap();
            acts.quantize(&dev, &dev.stream.clone_htod(&x).unwrap(), ncols)
                .unwrap();
            let out = |dev: &CudaDevice| -> Vec<CudaSlice<f32>> {
                rows.iter()
                    .map(|&r| dev.stream.alloc_zeros::<f32>(r).unwrap())
                    .collect()
            };
            let (mut one, mut each) = (out(&dev), out(&dev));
            {
                let [y0, y1, y2] = &mut one[..] else {
                    unreachable!()
                };
                let mut set = [
                    (&w[0], y0, rows[0], None),
                    (&w[1], y1, rows[1], None),
                    (&w[2], y2, rows[2], Some(&bias)),
                ];
                assert!(mmvq_qkv_pair(&dev, (a, b), &mut set, &acts, ncols).unwrap());
            }
            for i in 0..3 {
                let bi = (i == 2).then_some(&bias);
                let mut m = [(&w[i], &mut each[i], rows[i], bi)];
                mmvq_set(&dev, tys[i], &mut m, &acts, ncols, 1).unwrap();
            }
            for i in 0..3 {
                let (p, q) = (
                    dev.stream.clone_dtoh(&one[i]).unwrap(),
                    dev.stream.clone_dtoh(&each[i]).unwrap(),
                );
                assert!(q.iter().any(|v| *v != 0.0));
                assert_eq!(p, q, "{a}/{b} at {ncols} columns, matrix {i}");
            }
        }
        let w = dev.stream.alloc_zeros::<u8>(1 << 16).unwrap();
        let acts = DeviceActs::new(&dev, 256).unwrap();
        let mut ys: Vec<_> = (0..3)
            .map(|_| dev.stream.alloc_zeros::<f32>(32).unwrap())
            .collect();
        let [y0, y1, y2] = &mut ys[..] else {
            unreachable!()
        };
        let mut set = [(&w, y0, 32, None), (&w, y1, 32, None), (&w, y2, 32, None)];
        assert!(!mmvq_qkv_pair(&dev, (G::Q4_0, G::Q8_0), &mut set, &acts, 256).unwrap());
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_mmq_bandwidth() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 5u64;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let shapes = [
            (GgmlType::Q4K, 4096usize, 14336usize),
            (GgmlType::Q4K, 4096, 4096),
            (GgmlType::Q4K, 4096, 1024),
            (GgmlType::Q4K, 14336, 4096),
            (GgmlType::Q6K, 14336, 4096),
            (GgmlType::Q6K, 4096, 128256),
            (GgmlType::Q8_0, 4096, 14336),
        ];
        for (ty, ncols, nrows) in shapes {
            let w = random_weights(ty, ncols, nrows, &mut seed);
            let copies = (256_000_000 / w.len()).clamp(1, 16);
            let wd: Vec<_> = (0..copies)
                .map(|_| upload_weights(&dev, &w, ty, ncols).unwrap())
                .collect();
            let xd = dev.stream.clone_htod(&vec![0.5f32; 16 * ncols]).unwrap();
            let mut acts = DeviceActs::with_mmq(&dev, 16 * ncols).unwrap();
            acts.quantize(&dev, &xd, 16 * ncols).unwrap();
            let mut yd = dev.stream.alloc_zeros::<f32>(16 * nrows).unwrap();
            for ntok in [8usize, 16] {
                let mut times = Vec::new();
                let mut i = 0;
                for rep in 0..12 {
                    let start = dev.stream.record_event(timing).unwrap();
                    for _ in 0..20 {
                        i = (i + 1) % copies;
                        mmvq(&dev, ty, &wd[i], &acts, &mut yd, ncols, nrows, ntok).unwrap();
                    }
                    let end = dev.stream.record_event(timing).unwrap();
                    if rep >= 2 {
                        times.push(f64::from(start.elapsed_ms(&end).unwrap()) / 20.0);
                    }
                }
                times.sort_by(f64::total_cmp);
                let ms = times[times.len() / 2];
                eprintln!(
                    "{ty} {ncols}x{nrows}, {ntok} tokens: {:.1} us, {:.2} TB/s of weights",
                    ms * 1e3,
                    w.len() as f64 / (ms / 1e3) / 1e12
                );
            }
        }
    }

    /// Effective bandwidth on the llama3-8b shapes: `--ignored gpu_matvec_bandwidth --nocapture`.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_matvec_bandwidth() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 3u64;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        // Median time of 20 back-to-back launches (launch latency overlaps, as in a graph).
        let time = |run: &mut dyn FnMut()| {
            let mut times = Vec::new();
            for i in 0..12 {
                let start = dev.stream.record_event(timing).unwrap();
                for _ in 0..20 {
                    run();
                }
                let end = dev.stream.record_event(timing).unwrap();
                if i >= 2 {
                    times.push(f64::from(start.elapsed_ms(&end).unwrap()) / 20.0);
                }
            }
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        };
        let shapes = [
            (GgmlType::Q4K, 4096usize, 14336usize),
            (GgmlType::Q4K, 4096, 4096),
            (GgmlType::Q4K, 4096, 1024),
            (GgmlType::Q4K, 14336, 4096),
            (GgmlType::Q6K, 14336, 4096),
            (GgmlType::Q6K, 4096, 1024),
            (GgmlType::Q6K, 4096, 128256),
            (GgmlType::Q8_0, 4096, 14336),
            (GgmlType::Q8_0, 14336, 4096),
            (GgmlType::Q8_0, 4096, 4096),
        ];
        let mut ws = Vec::new();
        for (ty, ncols, nrows) in shapes {
            // Copies enough to pass through the 60 MB L2 between launches, as in a decode step.
            let w = random_weights(ty, ncols, nrows, &mut seed);
            let copies = (256_000_000 / w.len()).clamp(1, 16);
            let wd: Vec<_> = (0..copies)
                .map(|_| upload_weights(&dev, &w, ty, ncols).unwrap())
                .collect();
            let xd = dev.stream.clone_htod(&vec![0.5f32; ncols]).unwrap();
            let mut acts = DeviceActs::new(&dev, ncols).unwrap();
            acts.quantize(&dev, &xd, ncols).unwrap();
            let mut yd = dev.stream.alloc_zeros::<f32>(nrows).unwrap();
            let mut i = 0;
            let ms = time(&mut || {
                i = (i + 1) % copies;
                mmvq(&dev, ty, &wd[i], &acts, &mut yd, ncols, nrows, 1).unwrap()
            });
            eprintln!(
                "mmvq {ty} {ncols}x{nrows}: {:.1} us, {:.2} TB/s of weights",
                ms * 1e3,
                w.len() as f64 / (ms / 1e3) / 1e12
            );
            ws.push((wd.into_iter().next().unwrap(), w.len()));
        }
        // q, k and v of llama3-8b (4096 x 4096, 1024, 1024) in one launch and in three.
        let xd = dev.stream.clone_htod(&vec![0.5f32; 4096]).unwrap();
        let mut acts = DeviceActs::new(&dev, 4096).unwrap();
        acts.quantize(&dev, &xd, 4096).unwrap();
        let (q, k) = (&ws[1].0, &ws[2].0);
        let mut ys: Vec<CudaSlice<f32>> = (0..3)
            .map(|_| dev.stream.alloc_zeros(4096).unwrap())
            .collect();
        let [y0, y1, y2] = &mut ys[..] else {
            unreachable!()
        };
        let bytes = (ws[1].1 + 2 * ws[2].1) as f64;
        let ms = time(&mut || {
            mmvq_set(
                &dev,
                GgmlType::Q4K,
                &mut [
                    (q, &mut *y0, 4096, None),
                    (k, &mut *y1, 1024, None),
                    (k, &mut *y2, 1024, None),
                ],
                &acts,
                4096,
                1,
            )
            .unwrap()
        });
        eprintln!(
            "mmvq Q4_K q+k+v in one launch: {:.1} us, {:.2} TB/s",
            ms * 1e3,
            bytes / (ms / 1e3) / 1e12
        );
        let ms = time(&mut || {
            mmvq(&dev, GgmlType::Q4K, q, &acts, y0, 4096, 4096, 1).unwrap();
            mmvq(&dev, GgmlType::Q4K, k, &acts, y1, 4096, 1024, 1).unwrap();
            mmvq(&dev, GgmlType::Q4K, k, &acts, y2, 4096, 1024, 1).unwrap();
        });
        eprintln!(
            "mmvq Q4_K q, k, v in three launches: {:.1} us, {:.2} TB/s",
            ms * 1e3,
            bytes / (ms / 1e3) / 1e12
        );
    }
}
