//! Decode-time matrix products on quantized weights: the activations are quantized to
//! int8 on the device, then multiplied with `dp4a` for up to [`MAX_TOKENS`] tokens
//! (`cu/quant_matvec.cu`) or on the int8 tensor cores for up to [`MAX_MMQ_TOKENS`]
//! (`cu/quant_mmq.cu`, for the formats of nearly all decode bytes).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg};
use memra_gguf::GgmlType;

use super::ops::{blocks, grid_1d};
use super::{env_usize, CudaDevice, CudaError};

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
    *N.get_or_init(|| env_usize("MEMRA_PREFETCH_MAX_BYTES").unwrap_or(PREFETCH_MAX_BYTES))
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
#[path = "matvec_tests.rs"]
pub(crate) mod tests;
