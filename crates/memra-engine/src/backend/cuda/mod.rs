//! The CUDA backend: the device, the kernels built into this binary, and checks that they
//! fit the GPU. Kernels are compiled by `build.rs` (one fatbin per `cu/*.cu` family) for
//! one architecture; the engine refuses a GPU of another architecture with a clear message
//! rather than failing at the first launch.
//!
//! Model execution is `decoder`; its parts: `weights` (the upload), `buffers` (the step's
//! device buffers), `matvec` (decode products on quantized weights), `gemm` (prompt
//! products through cuBLAS), `ops` (the other kernels' launches), `graph` (the captured
//! decode step).

mod buffers;
mod decode;
pub mod decoder;
mod experts;
pub mod gemm;
pub mod graph;
pub mod matvec;
pub mod ops;
pub mod probe;
mod prompt;
mod qgemm;
pub mod sampling;
mod weights;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream, DriverError};
use cudarc::nvrtc::Ptx;

// `FATBINS`: the kernel families embedded in this binary, by name, as build.rs compiled
// them (empty when it found no nvcc).
include!(concat!(env!("OUT_DIR"), "/fatbins.rs"));

/// The architecture the kernels were built for (`90a`), if they were built.
pub fn built_arch() -> Option<&'static str> {
    #[cfg(memra_cuda_kernels)]
    return Some(env!("MEMRA_BUILT_CUDA_ARCH"));
    #[cfg(not(memra_cuda_kernels))]
    None
}

/// The nvcc release that built the kernels (`13.0`).
pub fn nvcc_release() -> Option<&'static str> {
    #[cfg(memra_cuda_kernels)]
    return Some(env!("MEMRA_NVCC_RELEASE"));
    #[cfg(not(memra_cuda_kernels))]
    None
}

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error(
        "this memra was built without CUDA kernels (no nvcc at build time); run \
         `export MEMRA_NVCC=$(scripts/setup-cuda.sh)` and rebuild, or use --device cpu"
    )]
    NoKernels,
    #[error("no NVIDIA driver found (libcuda.so.1 cannot be loaded); use --device cpu")]
    NoDriver,
    #[error(
        "cuBLAS (libcublas.so.13) cannot be loaded: install the CUDA 13 toolkit's libraries or \
         add their folder (e.g. /usr/local/cuda/lib64) to LD_LIBRARY_PATH; or use --device cpu"
    )]
    NoCublas,
    #[error("cannot use the CUDA driver: {0} (is a GPU visible? otherwise use --device cpu)")]
    Driver(#[from] DriverError),
    #[error(
        "the kernels were built for sm_{built} but GPU {ordinal} ({name}) is compute capability \
         {major}.{minor}; rebuild with MEMRA_CUDA_ARCH={wanted}"
    )]
    ArchMismatch {
        built: &'static str,
        ordinal: usize,
        name: String,
        major: i32,
        minor: i32,
        wanted: String,
    },
    #[error("kernel {0} is not in this build")]
    MissingKernel(String),
    #[error("no GPU kernel for {op} on {ty} weights yet")]
    Unsupported {
        op: &'static str,
        ty: memra_gguf::GgmlType,
    },
    #[error("invalid kernel arguments: {0}")]
    Invalid(String),
}

/// A variable's value as a count (unset or not a number: None): the named thresholds'
/// overrides, for measuring them.
fn env_usize(name: &str) -> Option<usize> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Whether this build can run on GPU 0: kernels built, a driver, and a GPU of the built
/// architecture (what `--device` defaults to).
pub fn usable_gpu() -> bool {
    built_arch().is_some() && CudaDevice::new(0).is_ok()
}

/// GPUs the driver sees (0 without a driver), whatever their architecture.
pub fn gpu_count() -> Result<usize, CudaError> {
    // SAFETY: only probes whether the library can be opened (cudarc panics otherwise).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Ok(0);
    }
    match CudaContext::device_count() {
        Ok(n) => Ok(n.max(0) as usize),
        // A driver with no GPU to drive (cuInit says so).
        Err(DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE)) => Ok(0),
        Err(e) => Err(e.into()),
    }
}

/// The build architecture that runs on a compute capability (as build.rs picks it).
pub fn arch_for(major: i32, minor: i32) -> String {
    match (major, minor) {
        (12, _) => "120a".into(),
        (10, 0) => "100a".into(),
        (9, 0) => "90a".into(),
        (8, 9) => "89".into(),
        (8, _) => "80".into(),
        (a, b) => format!("{a}{b}"),
    }
}

/// One GPU with the kernels loaded.
pub struct CudaDevice {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    functions:
        std::sync::Mutex<std::collections::HashMap<(&'static str, &'static str), CudaFunction>>,
}

impl CudaDevice {
    /// Opens GPU `ordinal` and loads the kernels, after checking they were built for it.
    pub fn new(ordinal: usize) -> Result<CudaDevice, CudaError> {
        let built = built_arch().ok_or(CudaError::NoKernels)?;
        // cudarc panics when it cannot load the driver library; ask first.
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaError::NoDriver);
        }
        let ctx = CudaContext::new(ordinal)?;
        let name = ctx.name()?;
        let (major, minor) = ctx.compute_capability()?;
        let wanted = arch_for(major, minor);
        if wanted != built {
            return Err(CudaError::ArchMismatch {
                built,
                ordinal,
                name,
                major,
                minor,
                wanted,
            });
        }
        // The driver reserves each thread's stack for every thread the GPU can hold (1 KiB
        // by default: 264 MiB on the H200). Our kernels need at most 128 bytes, and the
        // driver grows the limit for a kernel that needs more, so start from none.
        ctx.set_limit(cudarc::driver::sys::CUlimit::CU_LIMIT_STACK_SIZE, 0)?;
        let modules = FATBINS
            .iter()
            .map(|&(family, image)| {
                Ok((family, ctx.load_module(Ptx::from_binary(image.to_vec()))?))
            })
            .collect::<Result<Vec<_>, DriverError>>()?;
        // Buffers are only shared within this one stream, so cudarc's per-buffer events
        // (which would also land in captured graphs) are not needed.
        // SAFETY: every launch and copy of this device goes through `stream`.
        unsafe { ctx.disable_event_tracking() };
        Ok(CudaDevice {
            // A stream of our own: the legacy default stream cannot be captured into a graph.
            stream: ctx.new_stream()?,
            ctx,
            name,
            compute_capability: (major, minor),
            modules,
            functions: Default::default(),
        })
    }

    /// A kernel of a family (`norm`, `rms_norm_f32`).
    /// Looked up once and cached: `cuModuleGetFunction` on every launch was a large share
    /// of the decode step's host time.
    pub fn function(
        &self,
        family: &'static str,
        kernel: &'static str,
    ) -> Result<CudaFunction, CudaError> {
        let key = (family, kernel);
        let mut cache = self.functions.lock().expect("function cache lock");
        if let Some(f) = cache.get(&key) {
            return Ok(f.clone());
        }
        let module = self
            .modules
            .iter()
            .find(|(f, _)| *f == family)
            .map(|(_, m)| m)
            .ok_or_else(|| CudaError::MissingKernel(format!("{family}/{kernel}")))?;
        let f = module
            .load_function(kernel)
            .map_err(|e| CudaError::MissingKernel(format!("{family}/{kernel} ({e})")))?;
        cache.insert(key, f.clone());
        Ok(f)
    }

    /// The kernels of our families looked up so far (every one a step launches, once it
    /// has run eagerly): the ones a captured graph may launch programmatically.
    pub fn loaded_functions(&self) -> std::collections::HashSet<cudarc::driver::sys::CUfunction> {
        let cache = self.functions.lock().expect("function cache lock");
        cache.values().map(|f| f.cu_function()).collect()
    }
}

impl Drop for CudaDevice {
    /// Hands the memory this device's buffers returned to the stream-ordered pool back to
    /// the driver (owners drop their buffers before the device: `dev` is the decoder's
    /// last field), so the process holds no more GPU memory than its live decoders. (It
    /// did not, by itself, explain decode running slower after prompt tests in one
    /// process; the early launch trigger in PDL_WAIT did: docs/cuda.md.)
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        let mut pool: cudarc::driver::sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: queries and trims the device's default pool; nothing of ours is in use.
        unsafe {
            let dev = self.ctx.cu_device();
            if cudarc::driver::sys::cuDeviceGetDefaultMemPool(&mut pool, dev)
                .result()
                .is_ok()
            {
                let _ = cudarc::driver::sys::cuMemPoolTrimTo(pool, 0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_names_follow_compute_capability() {
        assert_eq!(arch_for(9, 0), "90a");
        assert_eq!(arch_for(12, 0), "120a");
        assert_eq!(arch_for(10, 0), "100a");
        assert_eq!(arch_for(8, 9), "89");
        assert_eq!(arch_for(8, 0), "80");
        assert_eq!(arch_for(7, 5), "75");
    }

    /// On a machine with a GPU: `cargo test -- --ignored gpu_`.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_rms_norm_matches_the_cpu_reference() {
        use cudarc::driver::{LaunchConfig, PushKernelArg};
        let dev = CudaDevice::new(0).expect("GPU");
        let f = dev.function("norm", "rms_norm_inplace_f32").unwrap();
        let mut seed = 5u64;
        let mut rnd = || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((seed >> 33) % 20001) as f32 / 10000.0 - 1.0
        };
        for (rows, n) in [(1usize, 896usize), (7, 4096), (3, 1000), (129, 17)] {
            let x: Vec<f32> = (0..rows * n).map(|_| rnd() * 3.0).collect();
            let w: Vec<f32> = (0..n).map(|_| 1.0 + rnd() * 0.1).collect();
            let mut xd = dev.stream.clone_htod(&x).unwrap();
            let wd = dev.stream.clone_htod(&w).unwrap();
            let (n_i, eps) = (n as i32, 1e-6f32);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            unsafe {
                dev.stream
                    .launch_builder(&f)
                    .arg(&mut xd)
                    .arg(&wd)
                    .arg(&n_i)
                    .arg(&eps)
                    .launch(cfg)
                    .unwrap();
            }
            let y = dev.stream.clone_dtoh(&xd).unwrap();
            let mut want = x.clone();
            crate::backend::cpu::ops::rms_norm(&mut want, &w, eps);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-5 * b.abs().max(1.0),
                    "rows {rows} n {n} element {i}: {a} vs {b}"
                );
            }
        }
    }
}
