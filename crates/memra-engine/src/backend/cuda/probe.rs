//! `memra probe`: what the GPU is, what this build targets, and the memory bandwidth the
//! device actually delivers (measured with device events, median of repeats).

use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{built_arch, nvcc_release, CudaDevice, CudaError};

pub struct ProbeReport {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_memory: usize,
    pub free_memory: usize,
    pub built_arch: &'static str,
    pub nvcc_release: &'static str,
    /// Device-to-device copy, bytes read plus written per second.
    pub copy_bandwidth: f64,
    /// Streaming read, bytes per second.
    pub read_bandwidth: f64,
}

/// Bytes moved per measurement: large enough to leave every cache far behind.
const PROBE_BYTES: usize = 1 << 30;
const REPEATS: usize = 10;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn probe(ordinal: usize) -> Result<ProbeReport, CudaError> {
    let dev = CudaDevice::new(ordinal)?;
    let (free_memory, total_memory) = dev.ctx.mem_get_info()?;
    let s = &dev.stream;
    let words = PROBE_BYTES / 16;
    let src = s.alloc_zeros::<u8>(PROBE_BYTES)?;
    let mut dst = s.alloc_zeros::<u8>(PROBE_BYTES)?;
    let mut sink = s.alloc_zeros::<u32>(4096)?;
    let timing = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
    // Warm-up, then timed repeats of each transfer.
    let mut copy = Vec::new();
    let mut read = Vec::new();
    let read_kernel = dev.function("probe", "probe_read")?;
    let sms = dev.ctx.attribute(
        cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    let cfg = LaunchConfig {
        grid_dim: (sms as u32 * 8, 1, 1),
        block_dim: (512, 1, 1),
        shared_mem_bytes: 0,
    };
    for i in 0..=REPEATS {
        let start = s.record_event(timing)?;
        s.memcpy_dtod(&src, &mut dst)?;
        let end = s.record_event(timing)?;
        let ms = f64::from(start.elapsed_ms(&end)?);
        if i > 0 {
            copy.push(2.0 * PROBE_BYTES as f64 / (ms / 1e3));
        }
        let start = s.record_event(timing)?;
        let n = words;
        // SAFETY: the kernel reads `n` 16-byte words of `src` (PROBE_BYTES long) and writes
        // at most gridDim.x words of `sink` (4096 >= 8 * SM count on current GPUs).
        unsafe {
            s.launch_builder(&read_kernel)
                .arg(&src)
                .arg(&n)
                .arg(&mut sink)
                .launch(cfg)?;
        }
        let end = s.record_event(timing)?;
        let ms = f64::from(start.elapsed_ms(&end)?);
        if i > 0 {
            read.push(PROBE_BYTES as f64 / (ms / 1e3));
        }
    }
    Ok(ProbeReport {
        name: dev.name.clone(),
        compute_capability: dev.compute_capability,
        total_memory,
        free_memory,
        built_arch: built_arch().unwrap_or("none"),
        nvcc_release: nvcc_release().unwrap_or("none"),
        copy_bandwidth: median(copy),
        read_bandwidth: median(read),
    })
}
