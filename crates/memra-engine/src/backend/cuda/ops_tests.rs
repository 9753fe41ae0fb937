//! The element-wise, norm, RoPE and attention kernels' tests against CPU references (they
//! need an NVIDIA GPU: run with `--ignored` on the device).

use super::super::matvec::tests::{lcg, random_weights, GPU_TYPES};
use super::super::matvec::upload_weights;
use super::*;
use memra_gguf::quant::dequantize_to_vec;

/// The prompt path's gated activation and residual-add norm against a host reference,
/// on fresh random rows: widths that are not whole chunks, one row, many rows, a row
/// past the f16 range (scaled down by a power of two, its factor returned), and a
/// `scales` buffer too small refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_gated_and_add_norm_match_a_host_reference() {
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 0x9a7ed ^ std::process::id() as u64;
    let mut rnd = |scale: f32| ((lcg(&mut seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
    let act = |x: f32, gelu: bool| match gelu {
        true => 0.5 * x * (1.0 + (0.797_884_6 * x * (1.0 + 0.044715 * x * x)).tanh()),
        false => x / (1.0 + (-x).exp()),
    };
    for (rows, n, gelu) in [(1, 1000, false), (3, 2048, true), (37, 4864, false)] {
        let mut g: Vec<f32> = (0..rows * n).map(|_| rnd(4.0)).collect();
        let u: Vec<f32> = (0..rows * n).map(|_| rnd(4.0)).collect();
        // The last row's one large product: 120,000, 7.3 times 2^14, so a factor of 8.
        g[rows * n - 7] = 300.0;
        let u_big = 400.0;
        let mut u = u;
        u[rows * n - 7] = u_big;
        let (gd, ud) = (
            dev.stream.clone_htod(&g).unwrap(),
            dev.stream.clone_htod(&u).unwrap(),
        );
        let mut out = dev.stream.alloc_zeros::<f16>(rows * n).unwrap();
        let mut scales = dev
            .stream
            .alloc_zeros::<f32>(gated_scales_len(rows, n))
            .unwrap();
        let (gv, uv) = (gd.slice(..), ud.slice(..));
        gated_f16(&dev, &gv, &uv, n, &mut out, &mut scales, rows, n, gelu).unwrap();
        let got = dev.stream.clone_dtoh(&out).unwrap();
        let factors = dev.stream.clone_dtoh(&scales).unwrap();
        // The same rows as one fused gate/up product's (each row g then u): the same
        // values and factors.
        let fused: Vec<f32> = (0..rows)
            .flat_map(|r| g[r * n..][..n].iter().chain(&u[r * n..][..n]).copied())
            .collect();
        let fd = dev.stream.clone_htod(&fused).unwrap();
        let (fg, fu) = (fd.slice(..), fd.slice(n..));
        let mut out2 = dev.stream.alloc_zeros::<f16>(rows * n).unwrap();
        gated_f16(&dev, &fg, &fu, 2 * n, &mut out2, &mut scales, rows, n, gelu).unwrap();
        assert_eq!(
            dev.stream.clone_dtoh(&out2).unwrap(),
            got,
            "fused rows {rows} {n}"
        );
        assert_eq!(dev.stream.clone_dtoh(&scales).unwrap(), factors);
        // Rows closer than n, and a u too short for the stride.
        assert!(gated_f16(&dev, &fg, &fu, n - 1, &mut out2, &mut scales, rows, n, gelu).is_err());
        let fu_short = fd.slice(n + 1..);
        assert!(gated_f16(
            &dev,
            &fg,
            &fu_short,
            2 * n,
            &mut out2,
            &mut scales,
            rows,
            n,
            gelu
        )
        .is_err());
        for r in 0..rows {
            let row: Vec<f32> = (0..n)
                .map(|i| act(g[r * n + i], gelu) * u[r * n + i])
                .collect();
            let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let want_factor = if amax > 16384.0 {
                (amax / 16384.0).log2().ceil().exp2()
            } else {
                1.0
            };
            assert_eq!(
                factors[r], want_factor,
                "rows {rows} n {n}: row {r}'s factor"
            );
            for (i, v) in row.iter().enumerate() {
                let want = f16::from_f32(v / want_factor).to_f32();
                let have = got[r * n + i].to_f32();
                assert!(
                    (have - want).abs() <= 1e-3 * want.abs() + 1e-5,
                    "row {r} column {i}: {have} vs {want}"
                );
            }
        }
        assert_eq!(factors[rows - 1], 8.0, "the last row is scaled");
        let mut short = dev.stream.alloc_zeros::<f32>(rows).unwrap();
        assert!(gated_f16(&dev, &gv, &uv, n, &mut out, &mut short, rows, n, gelu).is_err());

        // x += o, then the RMS norm of each row times w; o as rows, or as 1-7 parts
        // of split sums (a stride with room between them) summed in part order, with
        // and without each row's factor.
        let w: Vec<f32> = (0..n).map(|_| rnd(1.5)).collect();
        let wd = dev.stream.clone_htod(&w).unwrap();
        let row_f: Vec<f32> = (0..rows).map(|r| [1.0, 0.25, 0.125][r % 3]).collect();
        let fd = dev.stream.clone_htod(&row_f).unwrap();
        let eps = 1e-5;
        for (parts, scaled) in [(1, false), (1, true), (5, false), (7, true)] {
            let x: Vec<f32> = (0..rows * n).map(|_| rnd(2.0)).collect();
            let stride = rows * n + 3 * n + 1;
            let o: Vec<f32> = (0..(parts - 1) * stride + rows * n)
                .map(|_| rnd(2.0))
                .collect();
            let mut xd = dev.stream.clone_htod(&x).unwrap();
            let od = dev.stream.clone_htod(&o).unwrap();
            let addend = Addend {
                sums: &od,
                parts,
                stride,
                scale: scaled.then_some(&fd),
            };
            add_norm_f16(&dev, &mut xd, Some(addend), &wd, &mut out, rows, eps).unwrap();
            let (sum, normed) = (
                dev.stream.clone_dtoh(&xd).unwrap(),
                dev.stream.clone_dtoh(&out).unwrap(),
            );
            for r in 0..rows {
                let v: Vec<f32> = (0..n)
                    .map(|i| {
                        let mut acc = 0.0f32;
                        for p in 0..parts {
                            acc += o[p * stride + r * n + i];
                        }
                        x[r * n + i] + acc * if scaled { row_f[r] } else { 1.0 }
                    })
                    .collect();
                let rms =
                    (v.iter().map(|a| (a * a) as f64).sum::<f64>() / n as f64 + eps as f64).sqrt();
                for i in 0..n {
                    assert_eq!(sum[r * n + i], v[i], "{parts} parts, row {r} column {i}");
                    let want = (v[i] as f64 / rms * w[i] as f64) as f32;
                    let have = normed[r * n + i].to_f32();
                    assert!(
                        (have - want).abs() <= 2e-3 * want.abs() + 1e-4,
                        "{parts} parts, row {r} column {i}: {have} vs {want}"
                    );
                }
            }
            // Parts that overlap, and too few sums for the last part, are refused.
            if parts > 1 {
                let mut bad = addend;
                bad.stride = rows * n - 1;
                assert!(add_norm_f16(&dev, &mut xd, Some(bad), &wd, &mut out, rows, eps).is_err());
                bad.stride = stride + 1;
                assert!(add_norm_f16(&dev, &mut xd, Some(bad), &wd, &mut out, rows, eps).is_err());
            }
        }
    }
}

/// Dequantization to f16 (the prompt GEMMs' weights) and embedding rows against the
/// CPU decoders, for every type, on fresh random blocks.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_dequantize_and_embed_match_the_cpu_reference() {
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 21u64;
    // 2816 columns: Q8_0 regrouped, Q6_K not; 2048: both regrouped.
    for (ty, (ncols, nrows)) in GPU_TYPES
        .into_iter()
        .flat_map(|ty| [(ty, (2816usize, 37usize)), (ty, (2048, 5))])
    {
        let w = random_weights(ty, ncols, nrows, &mut seed);
        let want = dequantize_to_vec(ty, &w).unwrap();
        let wd = upload_weights(&dev, &w, ty, ncols).unwrap();
        if ty != GgmlType::F16 {
            let mut out = dev.stream.alloc_zeros::<f16>(ncols * nrows).unwrap();
            dequantize_f16(
                &dev,
                &wd.slice(..),
                ty,
                &mut out.slice_mut(..),
                nrows,
                ncols,
            )
            .unwrap();
            let got = dev.stream.clone_dtoh(&out).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let w16 = f16::from_f32(*w).to_f32();
                assert!(
                    (g.to_f32() - w16).abs() <= 1e-3 * w16.abs() + 1e-7,
                    "{ty} element {i}: {g} vs {w}"
                );
            }
        }
        let ids: Vec<i32> = (0..5)
            .map(|_| (lcg(&mut seed) % nrows as u64) as i32)
            .collect();
        let idd = dev.stream.clone_htod(&ids).unwrap();
        let mut rows = dev.stream.alloc_zeros::<f32>(5 * ncols).unwrap();
        embed_rows(&dev, &wd, ty, &idd.slice(..), &mut rows, ncols, 5, 0.5).unwrap();
        let got = dev.stream.clone_dtoh(&rows).unwrap();
        for (t, &id) in ids.iter().enumerate() {
            let r = id as usize * ncols;
            for c in 0..ncols {
                let (g, w) = (got[t * ncols + c], 0.5 * want[r + c]);
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                    "{ty} row {id} col {c}: {g} vs {w}"
                );
            }
        }
    }
}

/// Equal key and value widths `d`, the usual scale, a window of `window` positions (0:
/// none).
fn test_shape(nh: usize, nkv: usize, d: usize, window: usize) -> AttentionShape {
    AttentionShape {
        n_head: nh,
        n_head_kv: nkv,
        head_dim_k: d,
        head_dim_v: d,
        scale: 1.0 / (d as f32).sqrt(),
        window: (window > 0).then_some(window),
    }
}

/// Decode (split-K + combine) and prompt (flash) attention over a paged pool against
/// the CPU reference, on random queries and f16 keys and values (the CPU gets the same
/// f16 values, contiguous), for every head dimension, grouped heads, sliding windows,
/// split counts from 1 to 64, and two sequences per launch whose blocks are shuffled
/// through one pool.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_attention_matches_the_cpu_reference() {
    use crate::backend::cpu::ops as cpu;
    const BS: usize = 16;
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 77u64;
    let mut rnd = |scale: f32| ((lcg(&mut seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
    // (n_head, n_head_kv, head_dim, positions before the batch, batch, window)
    for (nh, nkv, d, p0, n_q, window) in [
        (32usize, 8usize, 128usize, 4090usize, 7usize, 0usize),
        (14, 2, 64, 60, 77, 0),
        (4, 1, 256, 250, 50, 16),
        (8, 8, 32, 0, 33, 0),
        (32, 8, 128, 0, 1, 0),
        (6, 2, 128, 1000, 40, 100),
        // Several row tiles of the tensor-core kernel, windows across its key tiles.
        (16, 2, 128, 130, 300, 0),
        (8, 2, 64, 37, 200, 70),
    ] {
        let row = nkv * d;
        let shape = test_shape(nh, nkv, d, window);
        // Two sequences: the case, and a shorter one.
        let seqs = [(p0, n_q), (p0 / 3, n_q.div_ceil(2))];
        let blocks: Vec<usize> = seqs.iter().map(|&(p, n)| (p + n).div_ceil(BS)).collect();
        let n_blocks = blocks.iter().sum::<usize>() + 3;
        // A shuffled pool: block ids in a random order.
        let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            let r = rnd(1.0).abs();
            ids.swap(i, ((r * i as f32) as usize).min(i));
        }
        let max_blocks = *blocks.iter().max().unwrap();
        let mut tables = vec![0i32; 2 * max_blocks];
        let mut k_pool = vec![f16::ZERO; n_blocks * BS * row];
        let mut v_pool = k_pool.clone();
        let (mut q_all, mut want_prefill, mut want_last, mut q_last) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut next_block = 0;
        for (s, &(p, n)) in seqs.iter().enumerate() {
            let n_kv = p + n;
            let table: Vec<u32> = ids[next_block..next_block + blocks[s]].to_vec();
            next_block += blocks[s];
            for (i, &b) in table.iter().enumerate() {
                tables[s * max_blocks + i] = b as i32;
            }
            let k16: Vec<f16> = (0..n_kv * row).map(|_| f16::from_f32(rnd(2.0))).collect();
            let v16: Vec<f16> = (0..n_kv * row).map(|_| f16::from_f32(rnd(2.0))).collect();
            for j in 0..n_kv {
                let slot = table[j / BS] as usize * BS + j % BS;
                k_pool[slot * row..(slot + 1) * row].copy_from_slice(&k16[j * row..(j + 1) * row]);
                v_pool[slot * row..(slot + 1) * row].copy_from_slice(&v16[j * row..(j + 1) * row]);
            }
            let q: Vec<f32> = (0..n * nh * d).map(|_| rnd(1.0)).collect();
            let kf: Vec<f32> = k16.iter().map(|v| v.to_f32()).collect();
            let vf: Vec<f32> = v16.iter().map(|v| v.to_f32()).collect();
            let mut want = vec![0f32; n * nh * d];
            cpu::attention(&shape, &q, &kf, &vf, p, &mut want);
            let last = (n - 1) * nh * d;
            q_last.extend_from_slice(&q[last..]);
            want_last.extend_from_slice(&want[last..]);
            q_all.extend(q);
            want_prefill.extend(want);
        }
        let kd = dev.stream.clone_htod(&k_pool).unwrap();
        let vd = dev.stream.clone_htod(&v_pool).unwrap();
        let ctx: Vec<i32> = seqs.iter().map(|&(p, n)| (p + n) as i32).collect();
        let ctx_d = dev.stream.clone_htod(&ctx).unwrap();
        let tables_d = dev.stream.clone_htod(&tables).unwrap();
        let kv = PagedKv {
            ctx_len: ctx_d.slice(..),
            block_tables: tables_d.slice(..),
            max_blocks,
            block_size: BS,
            n_seqs: 2,
            pool_slots: n_blocks * BS,
        };
        let close = |got: &[f32], want: &[f32], what: &str| {
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-3 * w.abs().max(0.1),
                    "{what} {nh}/{nkv} d{d} p0 {p0} n {n_q} w {window}: element {i}: {g} vs {w}"
                );
            }
        };
        // Prompt attention over both sequences' chunks in one launch.
        let total_q = seqs[0].1 + seqs[1].1;
        let qd = dev.stream.clone_htod(&q_all).unwrap();
        let q_start = dev
            .stream
            .clone_htod(&[0, seqs[0].1 as i32, total_q as i32])
            .unwrap();
        // Both kernels where the tensor-core one takes the head. It rounds the queries and
        // the probabilities to f16, so its bound is looser: 3e-3 of the value, at least
        // 1e-3 (a value is at most 2).
        for tc in [false, true] {
            if tc && d > MAX_TC_PROMPT_HEAD_DIM {
                continue;
            }
            let mut out = dev.stream.alloc_zeros::<f16>(total_q * nh * d).unwrap();
            attention_prefill_on(
                &dev,
                &shape,
                &qd,
                &kd,
                &vd,
                &mut out,
                &q_start.slice(..),
                &kv,
                total_q,
                seqs[0].1,
                tc,
            )
            .unwrap();
            let got: Vec<f32> = dev
                .stream
                .clone_dtoh(&out)
                .unwrap()
                .iter()
                .map(|v| v.to_f32())
                .collect();
            if !tc {
                close(&got, &want_prefill, "prefill");
                continue;
            }
            let mut worst = 0f32;
            for (i, (g, w)) in got.iter().zip(&want_prefill).enumerate() {
                let err = (g - w).abs() / w.abs().max(1.0 / 3.0);
                worst = worst.max(err);
                assert!(
                    err <= 3e-3,
                    "tensor-core prefill {nh}/{nkv} d{d} p0 {p0} n {n_q} w {window}: \
                     element {i}: {g} vs {w}"
                );
            }
            eprintln!("tensor-core prefill {nh}/{nkv} d{d} n {n_q} w {window}: worst {worst:.2e}");
        }
        // Decode of each sequence's last query together, at every split count it could get.
        let ql = dev.stream.clone_htod(&q_last).unwrap();
        let mut part_o = dev
            .stream
            .alloc_zeros::<f32>(2 * MAX_SPLITS * nh * d)
            .unwrap();
        let mut part_ml = dev
            .stream
            .alloc_zeros::<f32>(2 * MAX_SPLITS * nh * 2)
            .unwrap();
        let mut acts = DeviceActs::new(&dev, 2 * nh * d).unwrap();
        let mut outd = dev.stream.alloc_zeros::<f32>(2 * nh * d).unwrap();
        for n_split in [1, decode_splits(p0 + n_q), MAX_SPLITS] {
            attention_decode(
                &dev,
                &shape,
                &ql,
                &kd,
                &vd,
                &mut part_o,
                &mut part_ml,
                &kv,
                n_split,
            )
            .unwrap();
            attention_combine_into(
                &dev,
                &shape,
                &part_o,
                &part_ml,
                Some(&mut outd),
                &mut acts,
                n_split,
                2,
            )
            .unwrap();
            let got = dev.stream.clone_dtoh(&outd).unwrap();
            close(&got, &want_last, &format!("decode, {n_split} splits"));
        }
    }
}

/// The rows of a speculative verify step (one sequence's block table, contexts n to
/// n + 7) in one decode launch, split by the longest, against each row alone at its own
/// split count (what plain decoding runs): the same bits, also where the rows' contexts
/// cross a split boundary.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_decode_rows_sum_as_they_would_alone() {
    const BS: usize = 16;
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 4321u64;
    let mut rnd = |scale: f32| ((lcg(&mut seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
    for (nh, nkv, d, n0, window) in [
        (12usize, 2usize, 128usize, 60usize, 0usize),
        (32, 8, 128, 4093, 0),
        (14, 2, 64, 125, 0),
        (4, 1, 256, 190, 100),
    ] {
        let rows = 8;
        let row = nkv * d;
        let shape = test_shape(nh, nkv, d, window);
        let n_blocks = (n0 + rows).div_ceil(BS);
        let table: Vec<i32> = (0..n_blocks as i32).rev().collect();
        let pool: Vec<f16> = (0..n_blocks * BS * row)
            .map(|_| f16::from_f32(rnd(2.0)))
            .collect();
        let q: Vec<f32> = (0..rows * nh * d).map(|_| rnd(1.0)).collect();
        let (kd, vd) = (
            dev.stream.clone_htod(&pool).unwrap(),
            dev.stream.clone_htod(&pool).unwrap(),
        );
        let run = |first: usize, n: usize, n_split: usize| -> Vec<f32> {
            let ctx: Vec<i32> = (first..first + n).map(|r| (n0 + r + 1) as i32).collect();
            let tables: Vec<i32> = (0..n).flat_map(|_| table.iter().copied()).collect();
            let ctx_d = dev.stream.clone_htod(&ctx).unwrap();
            let tables_d = dev.stream.clone_htod(&tables).unwrap();
            let qd = dev
                .stream
                .clone_htod(&q[first * nh * d..(first + n) * nh * d])
                .unwrap();
            let kv = PagedKv {
                ctx_len: ctx_d.slice(..),
                block_tables: tables_d.slice(..),
                max_blocks: n_blocks,
                block_size: BS,
                n_seqs: n,
                pool_slots: n_blocks * BS,
            };
            let mut po = dev.stream.alloc_zeros::<f32>(n * n_split * nh * d).unwrap();
            let mut pm = dev.stream.alloc_zeros::<f32>(n * n_split * nh * 2).unwrap();
            attention_decode(&dev, &shape, &qd, &kd, &vd, &mut po, &mut pm, &kv, n_split).unwrap();
            let mut acts = DeviceActs::new(&dev, n * nh * d).unwrap();
            let mut out = dev.stream.alloc_zeros::<f32>(n * nh * d).unwrap();
            attention_combine_into(
                &dev,
                &shape,
                &po,
                &pm,
                Some(&mut out),
                &mut acts,
                n_split,
                n,
            )
            .unwrap();
            dev.stream.clone_dtoh(&out).unwrap()
        };
        let together = run(0, rows, decode_splits(n0 + rows));
        for r in 0..rows {
            let alone = run(r, 1, decode_splits(n0 + r + 1));
            let got = &together[r * nh * d..(r + 1) * nh * d];
            assert!(
                got.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{nh}/{nkv} d{d} context {}: the batch's row differs from the row alone",
                n0 + r + 1
            );
        }
    }
}

/// MoE routing against a sort on the host: random logits with exact ties (the lower
/// index wins, as the CPU engine sorts), -0 against +0 (equal), -inf, for every kernel
/// width (n_exp from 8 to 1024) and 1 to 16 experts used; shapes it refuses.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_moe_route_matches_a_sort() {
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 31u64;
    let n_tok = 5;
    for n_exp in [8usize, 33, 60, 128, 160, 300, 512, 1000, 1024] {
        for n_used in [1usize, 2, 8, 16].into_iter().filter(|&k| k <= n_exp) {
            for normalize in [false, true] {
                // Few distinct values, so that ties are common.
                let mut logits: Vec<f32> = (0..n_tok * n_exp)
                    .map(|_| (lcg(&mut seed) % 41) as f32 / 8.0 - 2.5)
                    .collect();
                logits[3 % n_exp] = -0.0;
                logits[5 % n_exp] = 0.0;
                logits[n_exp + 1] = f32::NEG_INFINITY;
                let ld = dev.stream.clone_htod(&logits).unwrap();
                let mut ids = dev.stream.alloc_zeros::<i32>(n_tok * n_used).unwrap();
                let mut wts = dev.stream.alloc_zeros::<f32>(n_tok * n_used).unwrap();
                moe_route(
                    &dev, &ld, &mut ids, &mut wts, n_tok, n_exp, n_used, normalize,
                )
                .unwrap();
                let (ids, wts) = (
                    dev.stream.clone_dtoh(&ids).unwrap(),
                    dev.stream.clone_dtoh(&wts).unwrap(),
                );
                for t in 0..n_tok {
                    let l = &logits[t * n_exp..(t + 1) * n_exp];
                    let mut order: Vec<usize> = (0..n_exp).collect();
                    order.sort_by(|&a, &b| l[b].partial_cmp(&l[a]).unwrap().then(a.cmp(&b)));
                    let mx = l.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
                    let sum: f64 = l.iter().map(|&v| (v as f64 - mx).exp()).sum();
                    let p: Vec<f64> = order[..n_used]
                        .iter()
                        .map(|&i| (l[i] as f64 - mx).exp() / sum)
                        .collect();
                    let z: f64 = if normalize { p.iter().sum() } else { 1.0 };
                    let what = format!("{n_exp} experts, {n_used} used, token {t}");
                    let got: Vec<usize> = ids[t * n_used..(t + 1) * n_used]
                        .iter()
                        .map(|&i| i as usize)
                        .collect();
                    assert_eq!(got, order[..n_used], "{what}");
                    for (k, &w) in wts[t * n_used..(t + 1) * n_used].iter().enumerate() {
                        let want = p[k] / z;
                        assert!(
                            (w as f64 - want).abs() <= 1e-6 + 1e-5 * want,
                            "{what}, pick {k}: {w} vs {want}"
                        );
                    }
                }
            }
        }
    }
    let ld = dev.stream.alloc_zeros::<f32>(2048).unwrap();
    let mut ids = dev.stream.alloc_zeros::<i32>(32).unwrap();
    let mut wts = dev.stream.alloc_zeros::<f32>(32).unwrap();
    for (n_exp, n_used) in [(1025, 8), (128, 17), (4, 8), (128, 0)] {
        assert!(moe_route(&dev, &ld, &mut ids, &mut wts, 1, n_exp, n_used, true).is_err());
    }
}

/// The rope adding a fused q|k|v product's split sums itself (`QkvRows::Sums`) writes
/// what it writes from the reduced rows, bit for bit: one, two and three runs, a bias,
/// fresh random sums; runs that miss columns, or sums too short for them, refused.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gpu_rope_adds_split_sums_as_the_reduce_would() {
    let dev = CudaDevice::new(0).expect("GPU");
    let mut seed = 0x5e75 ^ std::process::id() as u64;
    let mut rnd = |scale: f32| ((lcg(&mut seed) % 20001) as f32 / 10000.0 - 1.0) * scale;
    let shape = AttentionShape {
        n_head: 8,
        n_head_kv: 2,
        head_dim_k: 64,
        head_dim_v: 64,
        scale: 0.125,
        window: None,
    };
    let (q_len, kv_len) = (8 * 64, 2 * 64);
    let ld = q_len + 2 * kv_len;
    let rope = DeviceRope {
        halves: true,
        n_dims: 64,
        base: 10000.0,
        freq_scale: 1.0,
        freq_factors: None,
    };
    let (n, pool) = (5, 32);
    let pos = dev.stream.clone_htod(&[3i32, 10, 0, 7, 20]).unwrap();
    let slot = dev.stream.clone_htod(&[4i32, 9, 31, 0, 17]).unwrap();
    let (pos, slot) = (pos.slice(..), slot.slice(..));
    let norms = QkNorms {
        q: None,
        k: None,
        eps: 1e-6,
    };
    let cases: [&[(usize, usize)]; 3] = [
        &[(ld, 3)],
        &[(q_len + kv_len, 2), (kv_len, 5)],
        &[(q_len, 1), (kv_len, 4), (kv_len, 8)],
    ];
    for (ci, case) in cases.iter().enumerate() {
        let slots = 8;
        let mut runs = Vec::new();
        let mut offset = 0;
        for &(cols, parts) in case.iter() {
            runs.push(SumsRun {
                cols,
                parts,
                slots,
                offset,
            });
            offset += parts * slots * cols;
        }
        let sums: Vec<f32> = (0..offset).map(|_| rnd(2.0)).collect();
        let bias: Vec<f32> = (0..ld).map(|_| rnd(0.5)).collect();
        // The reduce's sums on the host: the bias, then the parts in order.
        let mut rows = vec![0.0f32; n * ld];
        let mut at = 0;
        for r in &runs {
            for t in 0..n {
                for c in 0..r.cols {
                    let mut acc = bias[at + c];
                    for p in 0..r.parts {
                        acc += sums[r.offset + p * r.slots * r.cols + t * r.cols + c];
                    }
                    rows[t * ld + at + c] = acc;
                }
            }
            at += r.cols;
        }
        let out = |qkv: QkvRows| {
            let mut q = dev.stream.alloc_zeros::<f32>(n * q_len).unwrap();
            let mut kc = dev.stream.alloc_zeros::<f16>(pool * kv_len).unwrap();
            let mut vc = dev.stream.alloc_zeros::<f16>(pool * kv_len).unwrap();
            rope_qk_append(
                &dev, &mut q, qkv, &mut kc, &mut vc, &shape, &rope, norms, &pos, &slot, n, pool,
            )
            .map(|_| {
                let q: Vec<u32> = dev
                    .stream
                    .clone_dtoh(&q)
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect();
                (
                    q,
                    dev.stream.clone_dtoh(&kc).unwrap(),
                    dev.stream.clone_dtoh(&vc).unwrap(),
                )
            })
        };
        let rows_d = dev.stream.clone_htod(&rows).unwrap();
        let (sums_d, bias_d) = (
            dev.stream.clone_htod(&sums).unwrap(),
            dev.stream.clone_htod(&bias).unwrap(),
        );
        let want = out(QkvRows::Fused(&rows_d)).unwrap();
        let sums_rows = |runs| QkvRows::Sums {
            sums: &sums_d,
            bias: Some(&bias_d),
            runs,
        };
        let got = out(sums_rows(&runs)).unwrap();
        assert!(
            want.0 == got.0 && want.1 == got.1 && want.2 == got.2,
            "case {ci}"
        );
        assert!(
            want.1.iter().any(|h| h.to_f32() != 0.0),
            "case {ci}: keys written"
        );
        // A run short of the columns, and sums too short for the last run.
        let mut short = runs.clone();
        short.last_mut().unwrap().cols -= 1;
        assert!(out(sums_rows(&short)).is_err());
        let mut past = runs.clone();
        past.last_mut().unwrap().offset += 1;
        assert!(out(sums_rows(&past)).is_err());
    }
}
