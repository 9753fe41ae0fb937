//! The activation quantizers and integer dot products, checked against f64 products of
//! the dequantized blocks on fresh random inputs, plus hand-computed single blocks.

use half::f16;
use memra_gguf::quant::{
    activation_type, dequantize, dequantize_to_vec, f16_scale_fields, quantize_activations,
    unpack_row, vec_dot, vec_dot_f32, QuantError,
};
use memra_gguf::GgmlType;
use proptest::prelude::*;

const DOT_TYPES: [GgmlType; 22] = [
    GgmlType::Iq2Xxs,
    GgmlType::Iq2Xs,
    GgmlType::Iq2S,
    GgmlType::Iq3Xxs,
    GgmlType::Iq3S,
    GgmlType::Iq1S,
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
    GgmlType::Mxfp4,
    GgmlType::Tq1_0,
    GgmlType::Tq2_0,
    GgmlType::Q8K,
];

fn random_blocks(ty: GgmlType, n_blocks: usize, bytes: &[u8], scales: &[f32]) -> Vec<u8> {
    let size = ty.type_size();
    let mut raw: Vec<u8> = bytes
        .iter()
        .cycle()
        .take(n_blocks * size)
        .copied()
        .collect();
    for (b, block) in raw.chunks_exact_mut(size).enumerate() {
        for (k, &off) in f16_scale_fields(ty).iter().enumerate() {
            let s = scales[(b * 2 + k) % scales.len()];
            block[off..off + 2].copy_from_slice(&f16::from_f32(s).to_le_bytes());
        }
        if ty == GgmlType::Q8K {
            // An f32 scale; bsums are ignored when Q8_K is the weight.
            block[..4].copy_from_slice(&scales[b % scales.len()].to_le_bytes());
        }
        if ty == GgmlType::Mxfp4 {
            block[0] = 110 + block[0] % 30; // exponents near 2^-18 .. 2^11
        }
    }
    raw
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(x) * f64::from(y))
        .sum()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn integer_dot_matches_dequantized_product(
        bytes in proptest::collection::vec(any::<u8>(), 600),
        scales in proptest::collection::vec(-0.05f32..0.05, 8),
        x in proptest::collection::vec(-4f32..4.0, 512),
        which in 0..DOT_TYPES.len(),
        two_blocks in any::<bool>(),
    ) {
        let ty = DOT_TYPES[which];
        let n = if ty.block_size() == 32 { if two_blocks { 512 } else { 96 } } else if two_blocks { 512 } else { 256 };
        let w = random_blocks(ty, n / ty.block_size(), &bytes, &scales);
        let act = activation_type(ty).expect("quantized types have an activation form");
        let mut q = Vec::new();
        quantize_activations(act, &x[..n], &mut q).unwrap();
        let got = vec_dot(ty, n, &w, &q).unwrap();

        let wf = dequantize_to_vec(ty, &w).unwrap();
        let xq = dequantize_to_vec(act, &q).unwrap();
        // Same quantized operands: only float summation order differs.
        let exact = dot64(&wf, &xq);
        let mag = wf.iter().zip(&xq).map(|(&a, &b)| f64::from(a * b).abs()).sum::<f64>();
        // Q8_1's precomputed sum `s` is rounded to f16, which the dequantized activations
        // do not see: allow for it where the weights carry a min.
        let tol = if matches!(ty, GgmlType::Q4_1 | GgmlType::Q5_1) { 2e-3 } else { 1e-5 };
        prop_assert!((f64::from(got) - exact).abs() <= tol * mag + 1e-6,
            "{ty}: dot {got} vs dequantized {exact} (magnitude {mag})");
        // Against unquantized activations: int8 rounding error only.
        let full = dot64(&wf, &x[..n]);
        let wmag = wf.iter().zip(&x[..n]).map(|(&a, &b)| f64::from(a * b).abs()).sum::<f64>();
        prop_assert!((f64::from(got) - full).abs() <= 0.02 * wmag + 1e-6,
            "{ty}: dot {got} vs f32 activations {full}");
    }

    #[test]
    fn unpacked_levels_reproduce_dequantized_values(
        bytes in proptest::collection::vec(any::<u8>(), 600),
        scales in proptest::collection::vec(-0.05f32..0.05, 8),
        which in 0..DOT_TYPES.len(),
    ) {
        let ty = DOT_TYPES[which];
        let n = 256;
        let w = random_blocks(ty, n / ty.block_size(), &bytes, &scales);
        let want = dequantize_to_vec(ty, &w).unwrap();
        let (mut levels, mut s16, mut m16) = (vec![0i8; n], vec![f32::NAN; n / 16], vec![f32::NAN; n / 16]);
        unpack_row(ty, &w, &mut levels, &mut s16, &mut m16).unwrap();
        for i in 0..n {
            let v = s16[i / 16] * f32::from(levels[i]) - m16[i / 16];
            prop_assert!((v - want[i]).abs() <= 1e-6 * want[i].abs().max(1e-3), "{ty} element {i}: {v} vs {}", want[i]);
        }
    }

    #[test]
    fn quantized_activations_round_trip_closely(
        x in proptest::collection::vec(-100f32..100.0, 256),
        act in prop_oneof![Just(GgmlType::Q8_0), Just(GgmlType::Q8_1), Just(GgmlType::Q8K)],
    ) {
        let mut q = Vec::new();
        quantize_activations(act, &x, &mut q).unwrap();
        prop_assert_eq!(q.len(), 256 / act.block_size() * act.type_size());
        let back = dequantize_to_vec(act, &q).unwrap();
        for block in 0..256 / act.block_size() {
            let r = block * act.block_size()..(block + 1) * act.block_size();
            let amax = x[r.clone()].iter().fold(0f32, |m, v| m.max(v.abs()));
            for i in r {
                // Half a quantization step, plus the f16 scale's relative error.
                prop_assert!((back[i] - x[i]).abs() <= amax / 127.0 * 0.5 + amax * 1e-3,
                    "{act} element {i}: {} -> {}", x[i], back[i]);
            }
        }
    }

    #[test]
    fn float_weight_dot_matches_f64(
        x in proptest::collection::vec(-2f32..2.0, 1..300),
        seed in any::<u32>(),
    ) {
        let w: Vec<f32> = (0..x.len()).map(|i| ((i as u32 ^ seed).wrapping_mul(2654435761) % 2001) as f32 / 1000.0 - 1.0).collect();
        let f32_bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16_bytes: Vec<u8> = w.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect();
        let bf16_bytes: Vec<u8> = w.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        for (ty, bytes) in [(GgmlType::F32, &f32_bytes), (GgmlType::F16, &f16_bytes), (GgmlType::Bf16, &bf16_bytes)] {
            let wf = dequantize_to_vec(ty, bytes).unwrap();
            let got = vec_dot_f32(ty, bytes, &x).unwrap();
            let want = dot64(&wf, &x);
            prop_assert!((f64::from(got) - want).abs() <= 1e-4 * (x.len() as f64), "{ty}: {got} vs {want}");
        }
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

#[test]
fn hand_computed_q4_0_block() {
    let mut b = [0u8; 18];
    b[..2].copy_from_slice(&f16_bytes(0.5));
    b[2] = 0x21; // element 0 level 1, element 16 level 2
    b[17] = 0xf0; // element 15 level 0, element 31 level 15
    let v = dequantize_to_vec(GgmlType::Q4_0, &b).unwrap();
    assert_eq!(v[0], (1.0 - 8.0) * 0.5);
    assert_eq!(v[16], (2.0 - 8.0) * 0.5);
    assert_eq!(v[15], -4.0);
    assert_eq!(v[31], 3.5);
    assert_eq!(v[1], -4.0);
}

#[test]
fn hand_computed_q4_k_block() {
    let mut b = [0u8; 144];
    b[0..2].copy_from_slice(&f16_bytes(1.0)); // d
    b[2..4].copy_from_slice(&f16_bytes(0.5)); // dmin
    let scales = &mut b[4..16];
    scales[0] = 2 | 0x40; // sub-block 0 scale 2; top bits feed sub-block 4's scale
    scales[4] = 3; // sub-block 0 min 3
    scales[8] = 0x21; // sub-block 4: scale low 1, min low 2
    b[16] = 0x05; // element 0 (low nibble) = 5; element 32 (high nibble) = 0
    b[16 + 64] = 0x07; // element 128 (sub-block 4) = 7
    let v = dequantize_to_vec(GgmlType::Q4K, &b).unwrap();
    assert_eq!(v[0], 2.0 * 5.0 - 0.5 * 3.0);
    assert_eq!(v[1], -1.5);
    assert_eq!(v[32], 0.0); // sub-block 1: scale 0, min 0
    assert_eq!(v[128], 17.0 * 7.0 - 0.5 * 2.0);
}

#[test]
fn hand_computed_activation_blocks() {
    // Q8_0 rounds half away from zero (C roundf), as ggml's reference quantizer.
    let x: Vec<f32> = (1..=32).map(|i| i as f32).collect();
    let mut q = Vec::new();
    quantize_activations(GgmlType::Q8_0, &x, &mut q).unwrap();
    assert_eq!(q.len(), 34);
    assert_eq!(
        f16::from_le_bytes([q[0], q[1]]),
        f16::from_f32(32.0 / 127.0)
    );
    assert_eq!(q[2 + 31] as i8, 127);
    assert_eq!(
        q[2 + 15] as i8,
        64,
        "16 * 127/32 = 63.5 rounds away from zero"
    );

    // Q8_1 also stores s = d * sum(q).
    let mut q1 = Vec::new();
    quantize_activations(GgmlType::Q8_1, &x, &mut q1).unwrap();
    let d = f16::from_le_bytes([q1[0], q1[1]]).to_f32();
    let s = f16::from_le_bytes([q1[2], q1[3]]).to_f32();
    let sum: i32 = q1[4..].iter().map(|&b| i32::from(b as i8)).sum();
    assert!((s - d * sum as f32).abs() <= 1e-3 * s.abs());

    // Q8_K: the largest-magnitude value maps to -127 and ties round to even.
    let mut xk = vec![0f32; 256];
    xk[0] = 127.0;
    xk[1] = 2.5;
    xk[2] = 3.5;
    xk[17] = 10.0;
    let mut qk = Vec::new();
    quantize_activations(GgmlType::Q8K, &xk, &mut qk).unwrap();
    assert_eq!(qk.len(), 292);
    assert_eq!(f32::from_le_bytes(qk[0..4].try_into().unwrap()), -1.0);
    assert_eq!(qk[4] as i8, -127);
    assert_eq!(qk[5] as i8, -2, "-2.5 rounds to even");
    assert_eq!(qk[6] as i8, -4, "-3.5 rounds to even");
    let bsum0 = i16::from_le_bytes([qk[260], qk[261]]);
    let bsum1 = i16::from_le_bytes([qk[262], qk[263]]);
    assert_eq!((bsum0, bsum1), (-127 - 2 - 4, -10));
}

#[test]
fn bad_lengths_and_types_are_errors() {
    let mut out = vec![0f32; 32];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0u8; 17], &mut out),
        Err(QuantError::ByteLength {
            expected: 18,
            got: 17,
            ..
        })
    ));
    let mut odd = vec![0f32; 33];
    assert!(matches!(
        dequantize(GgmlType::Q4_0, &[0u8; 18], &mut odd),
        Err(QuantError::NotBlockMultiple { .. })
    ));
    assert!(matches!(
        dequantize(GgmlType::I32, &[0u8; 16], &mut [0f32; 3]),
        Err(QuantError::ByteLength { .. })
    ));
    assert!(matches!(
        vec_dot(GgmlType::F16, 2, &[0u8; 4], &[0u8; 4]),
        Err(QuantError::Unsupported(GgmlType::F16))
    ));
    assert!(vec_dot(GgmlType::Q4_0, 32, &[0u8; 18], &[0u8; 33]).is_err());
    assert!(quantize_activations(GgmlType::Q4_0, &[0.0; 32], &mut Vec::new()).is_err());
    assert!(quantize_activations(GgmlType::Q8_0, &[0.0; 31], &mut Vec::new()).is_err());
}
