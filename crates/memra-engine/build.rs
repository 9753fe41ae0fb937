//! Compiles the CUDA kernels (`cu/*.cu`, one file per op family) with nvcc into fatbins
//! that the engine embeds, for one GPU architecture.
//!
//! nvcc: `MEMRA_NVCC` wins, then `$CUDA_HOME`/`$CUDA_PATH`/`$CUDA_ROOT` + `bin/nvcc`; else every
//! nvcc on `PATH`, in `/usr/local/cuda/bin` and `/usr/local/cuda-*/bin` is asked its
//! release and the newest wins, so a stale distribution nvcc never shadows a real toolkit.
//! The choice is echoed as a cargo warning. Without any nvcc the crate builds without
//! kernels (CPU only) and says how to get them (`scripts/setup-cuda.sh`).
//!
//! Arch: `MEMRA_CUDA_ARCH` wins; else the first GPU's compute capability from nvidia-smi;
//! else (no GPU: developer machines, CI) 90a, the H200 we measure on.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Kernel families, one fatbin each.
const KERNELS: [&str; 11] = [
    "attention",
    "dequant",
    "elementwise",
    "moe",
    "norm",
    "probe",
    "quant_gemm",
    "quant_matvec",
    "quant_mmq",
    "rope",
    "sampling",
];
/// Architectures the kernels are written for.
const ARCHES: [&str; 5] = ["120a", "100a", "90a", "89", "80"];
const DEFAULT_ARCH: &str = "90a";

/// `nvcc --version`'s release, from its last line: `Cuda compilation tools, release 13.0, V13.0.88`.
fn nvcc_release(nvcc: &Path) -> Option<(u32, u32)> {
    let out = Command::new(nvcc).arg("--version").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let release = text.split("release ").nth(1)?.split(',').next()?.trim();
    let (major, minor) = release.split_once('.')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

fn resolve_nvcc() -> Option<PathBuf> {
    for var in ["MEMRA_NVCC", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    if let Ok(p) = std::env::var("MEMRA_NVCC") {
        println!("cargo:warning=nvcc from MEMRA_NVCC: {p}");
        return Some(PathBuf::from(p));
    }
    for var in ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"] {
        if let Ok(root) = std::env::var(var) {
            let nvcc = Path::new(&root).join("bin/nvcc");
            if nvcc.is_file() {
                println!("cargo:warning=nvcc from ${var}: {}", nvcc.display());
                return Some(nvcc);
            }
        }
    }
    let mut candidates: Vec<PathBuf> = std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join("nvcc"))
        .collect();
    candidates.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    if let Ok(dir) = std::fs::read_dir("/usr/local") {
        for e in dir.flatten() {
            if e.file_name().to_string_lossy().starts_with("cuda-") {
                candidates.push(e.path().join("bin/nvcc"));
            }
        }
    }
    let mut seen = Vec::new();
    let mut ranked = Vec::new();
    for c in candidates.into_iter().filter(|c| c.is_file()) {
        let real = c.canonicalize().unwrap_or(c);
        if seen.contains(&real) {
            continue;
        }
        seen.push(real.clone());
        if let Some(v) = nvcc_release(&real) {
            ranked.push((v, real));
        }
    }
    // Newest first; equal releases keep discovery order (sort_by is stable).
    ranked.sort_by_key(|r| std::cmp::Reverse(r.0));
    let ((major, minor), nvcc) = ranked.first()?.clone();
    println!(
        "cargo:warning=nvcc auto-detected: CUDA {major}.{minor} at {} (newest of {})",
        nvcc.display(),
        ranked.len()
    );
    Some(nvcc)
}

fn choose_arch() -> String {
    println!("cargo:rerun-if-env-changed=MEMRA_CUDA_ARCH");
    if let Ok(a) = std::env::var("MEMRA_CUDA_ARCH") {
        return a;
    }
    let cap = Command::new("nvidia-smi")
        .args(["--query-gpu=compute_cap", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(|l| l.trim().to_string()));
    let arch = match cap.as_deref() {
        Some("12.0" | "12.1") => "120a",
        Some("10.0") => "100a",
        Some("9.0") => "90a",
        Some("8.9") => "89",
        Some("8.0" | "8.6" | "8.7") => "80",
        _ => DEFAULT_ARCH,
    };
    match cap {
        Some(c) => println!("cargo:warning=CUDA arch {arch} for the GPU's compute capability {c} (MEMRA_CUDA_ARCH overrides)"),
        None => println!("cargo:warning=no GPU visible: building kernels for {arch} (MEMRA_CUDA_ARCH overrides)"),
    }
    arch.to_string()
}

/// Writes `const FATBINS: &[(&str, &[u8])]` naming each family's fatbin.
fn write_table(path: &Path, fatbins: &[(&str, PathBuf)]) {
    let mut src = String::from("const FATBINS: &[(&str, &[u8])] = &[\n");
    for (name, file) in fatbins {
        src += &format!(
            "    ({name:?}, include_bytes!({:?})),\n",
            file.display().to_string()
        );
    }
    src += "];\n";
    std::fs::write(path, src).expect("write the fatbin table");
}

fn main() {
    println!("cargo:rustc-check-cfg=cfg(memra_cuda_kernels)");
    println!("cargo:rerun-if-changed=cu");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    // The table of embedded fatbins the engine includes; empty until kernels are built.
    let table = out.join("fatbins.rs");
    write_table(&table, &[]);
    let Some(nvcc) = resolve_nvcc() else {
        println!(
            "cargo:warning=no nvcc found: building without CUDA kernels (CPU only). \
             Run `export MEMRA_NVCC=$(scripts/setup-cuda.sh)` and rebuild for GPU support."
        );
        return;
    };
    let arch = choose_arch();
    assert!(
        ARCHES.contains(&arch.as_str()),
        "MEMRA_CUDA_ARCH={arch} is not one of {ARCHES:?}"
    );
    let (major, minor) = nvcc_release(&nvcc)
        .unwrap_or_else(|| panic!("{} does not run (`nvcc --version` failed)", nvcc.display()));
    let gencode = format!("arch=compute_{arch},code=sm_{arch}");
    let mut built = Vec::new();
    for k in KERNELS {
        let src = format!("cu/{k}.cu");
        let fatbin = out.join(format!("{k}.fatbin"));
        let status = Command::new(&nvcc)
            .args([
                "-gencode",
                &gencode,
                "-O3",
                "-std=c++17",
                "--fatbin",
                "-Icu",
                "-o",
            ])
            .arg(&fatbin)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        assert!(status.success(), "nvcc failed on {src} for sm_{arch}");
        built.push((k, fatbin));
    }
    write_table(&table, &built);
    println!("cargo:rustc-cfg=memra_cuda_kernels");
    println!("cargo:rustc-env=MEMRA_BUILT_CUDA_ARCH={arch}");
    println!("cargo:rustc-env=MEMRA_NVCC_RELEASE={major}.{minor}");
}
