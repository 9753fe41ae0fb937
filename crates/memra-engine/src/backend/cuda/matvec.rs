//! Decode-time matrix-vector products on quantized weights (`cu/quant_matvec.cu`): the
//! activations are quantized to int8 on the device, then multiplied with `dp4a`.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use memra_gguf::GgmlType;

use super::ops::grid_1d;
use super::{CudaDevice, CudaError};

/// Tokens one call handles (the kernels keep one accumulator per token in registers).
pub const MAX_TOKENS: usize = 8;
/// Warps (rows) per thread block, as the kernels are written.
const ROWS_PER_BLOCK: u32 = 4;

/// The kernel for a weight type; `None` where there is none yet.
pub fn kernel_for(ty: GgmlType) -> Option<&'static str> {
    match ty {
        GgmlType::Q4K => Some("mmvq_q4_k"),
        GgmlType::Q6K => Some("mmvq_q6_k"),
        GgmlType::Q8_0 => Some("mmvq_q8_0"),
        GgmlType::Q4_0 => Some("mmvq_q4_0"),
        GgmlType::Q5_0 => Some("mmvq_q5_0"),
        _ => None,
    }
}

/// Activations quantized on the device for the integer kernels: int8 values, and per 32
/// values the scale and the scaled sum.
pub struct DeviceActs {
    pub q: CudaSlice<i8>,
    pub d: CudaSlice<f32>,
    pub s: CudaSlice<f32>,
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
        })
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

    /// `x += o` (when given), then quantizes `rms_norm(x) * w` into this buffer: the
    /// residual add, the norm and the quantization of a decode step in one launch.
    pub fn add_norm_quantize(
        &mut self,
        dev: &CudaDevice,
        x: &mut CudaSlice<f32>,
        o: Option<&CudaSlice<f32>>,
        w: &CudaSlice<f32>,
        eps: f32,
    ) -> Result<(), CudaError> {
        let n = w.len();
        if n % 32 != 0 || x.len() < n || o.is_some_and(|o| o.len() < n) || self.q.len() < n {
            return Err(CudaError::Invalid(format!(
                "add_norm_quantize: {n} elements"
            )));
        }
        let f = dev.function("quant_matvec", "add_norm_quantize")?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n_i, null) = (n as i32, 0u64);
        // SAFETY: n elements of x, o and w; n of q and n / 32 of d and s (checked above).
        unsafe {
            let mut b = dev.stream.launch_builder(&f);
            b.arg(x);
            match o {
                Some(o) => b.arg(o),
                None => b.arg(&null),
            };
            b.arg(w)
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
/// type `ty` (16-byte aligned, as device allocations are), `x` holds `ntok x ncols`
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
    let name = kernel_for(ty).ok_or(CudaError::Unsupported { op: "matvec", ty })?;
    let row_bytes = ty
        .row_bytes(ncols as u64)
        .ok_or_else(|| CudaError::Invalid(format!("{ncols} columns are not whole {ty} blocks")))?;
    if !(1..=MAX_TOKENS).contains(&ntok) {
        return Err(CudaError::Invalid(format!(
            "{ntok} tokens (1 to {MAX_TOKENS})"
        )));
    }
    if w.len() < row_bytes as usize * nrows || x.q.len() < ntok * ncols || y.len() < ntok * nrows {
        return Err(CudaError::Invalid("buffers smaller than the shapes".into()));
    }
    let f = dev.function("quant_matvec", name)?;
    // Rows each warp computes (the Q4_K kernel takes two; `Q4_K_ROWS_PER_WARP` in the .cu).
    let rows_per_warp = if ty == GgmlType::Q4K { 2 } else { 1 };
    let cfg = LaunchConfig {
        grid_dim: (
            (nrows as u32).div_ceil(ROWS_PER_BLOCK * rows_per_warp),
            1,
            1,
        ),
        block_dim: (32 * ROWS_PER_BLOCK, 1, 1),
        shared_mem_bytes: 0,
    };
    let (c, r, t) = (ncols as i32, nrows as i32, ntok as i32);
    // SAFETY: sizes were checked against the shapes; the kernel reads `nrows` rows of `w`,
    // `ntok x ncols` activations and writes `ntok x nrows` of `y`.
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(w)
            .arg(&x.q)
            .arg(&x.d)
            .arg(&x.s)
            .arg(y)
            .arg(&c)
            .arg(&r)
            .arg(&t)
            .launch(cfg)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use memra_gguf::quant::{dequantize_to_vec, f16_scale_fields};

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn random_weights(ty: GgmlType, ncols: usize, nrows: usize, seed: &mut u64) -> Vec<u8> {
        let n = nrows * ty.row_bytes(ncols as u64).unwrap() as usize;
        let mut w: Vec<u8> = (0..n).map(|_| lcg(seed) as u8).collect();
        for b in w.chunks_exact_mut(ty.type_size()) {
            for &f in f16_scale_fields(ty) {
                let v = half::f16::from_f32((lcg(seed) % 1000) as f32 * 1e-5 + 1e-4);
                b[f..f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        w
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_matvec_matches_the_cpu_reference() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 11u64;
        for ty in [
            GgmlType::Q4K,
            GgmlType::Q6K,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q5_0,
        ] {
            for (ncols, nrows) in [(256usize, 1usize), (2816, 37), (4096, 130)] {
                let w = random_weights(ty, ncols, nrows, &mut seed);
                for ntok in [1usize, 3, 8] {
                    let x: Vec<f32> = (0..ntok * ncols)
                        .map(|_| (lcg(&mut seed) % 2001) as f32 / 1000.0 - 1.0)
                        .collect();
                    let wd = dev.stream.clone_htod(&w).unwrap();
                    let xd = dev.stream.clone_htod(&x).unwrap();
                    let mut yd = dev
                        .stream
                        .clone_htod(&vec![f32::NAN; ntok * nrows])
                        .unwrap();
                    let mut acts = DeviceActs::new(&dev, ntok * ncols).unwrap();
                    acts.quantize(&dev, &xd, ntok * ncols).unwrap();
                    mmvq(&dev, ty, &wd, &acts, &mut yd, ncols, nrows, ntok).unwrap();
                    let y = dev.stream.clone_dtoh(&yd).unwrap();
                    // The activations as the kernel sees them: int8 per 32, scale amax/127.
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
                            let got = f64::from(y[t * nrows + r]);
                            assert!(
                                (got - want).abs() <= 1e-5 * mag + 1e-6,
                                "{ty} {ncols}x{nrows} t{t} row {r}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
        let none = mmvq(
            &dev,
            GgmlType::Q5_1,
            &dev.stream.alloc_zeros(24).unwrap(),
            &DeviceActs::new(&dev, 32).unwrap(),
            &mut dev.stream.alloc_zeros(1).unwrap(),
            32,
            1,
            1,
        );
        assert!(matches!(none, Err(CudaError::Unsupported { .. })));
    }

    /// Effective bandwidth on the llama3-8b shapes: `--ignored gpu_matvec_bandwidth --nocapture`.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_matvec_bandwidth() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 3u64;
        let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        for (ty, ncols, nrows) in [
            (GgmlType::Q4K, 4096usize, 14336usize),
            (GgmlType::Q6K, 14336, 4096),
            (GgmlType::Q4K, 4096, 4096),
            (GgmlType::Q8_0, 4096, 14336),
        ] {
            let w = random_weights(ty, ncols, nrows, &mut seed);
            let wd = dev.stream.clone_htod(&w).unwrap();
            for ntok in [1usize, 4] {
                let xd = dev.stream.clone_htod(&vec![0.5f32; ntok * ncols]).unwrap();
                let mut acts = DeviceActs::new(&dev, ntok * ncols).unwrap();
                acts.quantize(&dev, &xd, ntok * ncols).unwrap();
                let mut yd = dev.stream.alloc_zeros::<f32>(ntok * nrows).unwrap();
                let mut times = Vec::new();
                for i in 0..30 {
                    let start = dev.stream.record_event(timing).unwrap();
                    mmvq(&dev, ty, &wd, &acts, &mut yd, ncols, nrows, ntok).unwrap();
                    let end = dev.stream.record_event(timing).unwrap();
                    if i >= 5 {
                        times.push(f64::from(start.elapsed_ms(&end).unwrap()));
                    }
                }
                times.sort_by(f64::total_cmp);
                let ms = times[times.len() / 2];
                eprintln!(
                    "mmvq {ty} {ncols}x{nrows} x{ntok}: {:.1} us, {:.2} TB/s of weights",
                    ms * 1e3,
                    w.len() as f64 / (ms / 1e3) / 1e12
                );
            }
        }
    }
}
