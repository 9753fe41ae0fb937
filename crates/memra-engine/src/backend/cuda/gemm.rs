//! Prompt GEMMs: cuBLAS multiplies f16 weights (dequantized into a scratch buffer, or F16
//! weights as they are) with f16 activations on tensor cores, accumulating and writing f32.
//!
//! Why not int8 tiles on the quantized weights (llama.cpp's MMQ): dequantizing a matrix
//! reads it once and writes f16 once, small against the GEMM for batches of hundreds of
//! tokens, and cuBLAS's f16 tensor-core GEMM runs near the H200's peak. The numbers are in
//! docs/cuda.md.

use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use half::f16;

use super::{CudaDevice, CudaError};

pub struct Gemm {
    blas: CudaBlas,
    /// cuBLAS's workspace, ours: without one set, a captured GEMM takes memory of its own
    /// inside each graph.
    _workspace: CudaSlice<u8>,
}

/// The workspace cuBLAS asks for on Hopper (its documentation's 32 MiB).
const WORKSPACE_BYTES: usize = 32 << 20;

fn blas_err(e: blas::CublasError) -> CudaError {
    CudaError::Invalid(format!("cuBLAS: {e:?}"))
}

impl Gemm {
    /// A cuBLAS handle on the device's stream; a clear error where libcublas is missing.
    pub fn new(dev: &CudaDevice) -> Result<Gemm, CudaError> {
        // cudarc panics when it cannot load the library; ask first.
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(CudaError::NoCublas);
        }
        let blas = CudaBlas::new(dev.stream.clone()).map_err(blas_err)?;
        let mut workspace = dev.stream.alloc_zeros::<u8>(WORKSPACE_BYTES)?;
        {
            let (wp, _w) = workspace.device_ptr_mut(&dev.stream);
            // SAFETY: the buffer lives as long as the handle (both are Gemm's; the handle
            // drops first, fields in order) and is only used on the handle's stream.
            unsafe {
                sys::cublasSetWorkspace_v2(*blas.handle(), wp as *mut _, WORKSPACE_BYTES)
                    .result()
                    .map_err(blas_err)?;
            }
        }
        Ok(Gemm {
            blas,
            _workspace: workspace,
        })
    }

    /// `y[t][r] = sum_i w[r][i] * x[t][i]` for `t < n`, `r < m`, `i < k`: `w` is `m x k`
    /// f16 (row-major), `x` is `n x k` f16, `y` holds `n` rows of `ldc` f32 (`ldc >= m`).
    #[allow(clippy::too_many_arguments)]
    pub fn f16_f32<W: DeviceRepr, X: DeviceRepr>(
        &self,
        dev: &CudaDevice,
        w: &CudaView<W>,
        x: &CudaView<X>,
        y: &mut CudaSlice<f32>,
        y_offset: usize,
        m: usize,
        n: usize,
        k: usize,
        ldc: usize,
    ) -> Result<(), CudaError> {
        let bytes = |v: usize| v * std::mem::size_of::<f16>();
        if w.len() * std::mem::size_of::<W>() < bytes(m * k)
            || x.len() * std::mem::size_of::<X>() < bytes(n * k)
            || ldc < m
            || y.len() < y_offset + (n - 1) * ldc + m
            || n == 0
        {
            return Err(CudaError::Invalid(
                "gemm: buffers smaller than the shapes".into(),
            ));
        }
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (wp, _rw) = w.device_ptr(&dev.stream);
        let (xp, _rx) = x.device_ptr(&dev.stream);
        let (yp, _ry) = y.device_ptr_mut(&dev.stream);
        let yp = yp + (y_offset * 4) as u64;
        // Row-major y (n x ldc) is column-major m x n with leading dimension ldc:
        // y = w^T(k x m, column-major) ^T * x(k x n, column-major).
        // SAFETY: the pointers cover the shapes (checked above) and live across the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                m as i32,
                n as i32,
                k as i32,
                (&alpha) as *const f32 as *const _,
                wp as *const _,
                sys::cudaDataType_t::CUDA_R_16F,
                k as i32,
                xp as *const _,
                sys::cudaDataType_t::CUDA_R_16F,
                k as i32,
                (&beta) as *const f32 as *const _,
                yp as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                ldc as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(blas_err)?;
        }
        Ok(())
    }
}
