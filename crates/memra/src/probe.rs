//! `memra probe`: the GPU, the build's kernel architecture and nvcc, measured bandwidth.

use anyhow::Result;
use memra_engine::backend::cuda::probe::probe;

use crate::inspect::human_bytes;

pub fn run(ordinal: usize) -> Result<()> {
    let r = probe(ordinal)?;
    let gb = |b: f64| format!("{:.2} TB/s", b / 1e12);
    println!("{:<22}{}", "gpu", r.name);
    println!(
        "{:<22}{}.{}",
        "compute capability", r.compute_capability.0, r.compute_capability.1
    );
    println!(
        "{:<22}{} total, {} free",
        "memory",
        human_bytes(r.total_memory as u64),
        human_bytes(r.free_memory as u64)
    );
    println!("{:<22}sm_{}", "kernels built for", r.built_arch);
    println!("{:<22}{}", "nvcc release", r.nvcc_release);
    println!(
        "{:<22}{} (read + write, 1 GiB, median of 10)",
        "device copy",
        gb(r.copy_bandwidth)
    );
    println!(
        "{:<22}{} (1 GiB, median of 10)",
        "streaming read",
        gb(r.read_bandwidth)
    );
    Ok(())
}
