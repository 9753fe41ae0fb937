//! The mat-vec and tensor-core kernels' tests against the CPU's dequantized sums (they
//! need an NVIDIA GPU: run with `--ignored` on the device), and the helpers other
//! kernels' tests share (`lcg`, `random_weights`, `GPU_TYPES`).

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
pub(crate) fn random_weights(ty: GgmlType, ncols: usize, nrows: usize, seed: &mut u64) -> Vec<u8> {
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
        // 800 and 896 columns (the Qwen 0.5B's): Q8_0 rows that are not whole groups (the
        // plain layout); 4096: Q6_K regrouped, 256 and 2816 not.
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
