//! Dequantization checked against gguf-py (`scripts/make-quant-reference.py`): tensors of
//! the tiny and real models read through our reader, and synthetic random blocks of every
//! type gguf-py decodes.

use memra_gguf::quant::dequantize;
use memra_gguf::test_files::{real_model, tiny_model};
use memra_gguf::{GgmlType, GgufFile};
use serde::Deserialize;
use std::collections::HashMap;

#[derive(Deserialize)]
struct Reference {
    models: Vec<ModelCase>,
    synthetic: Vec<SyntheticCase>,
}

#[derive(Deserialize)]
struct ModelCase {
    file: String,
    tensor: String,
    #[serde(rename = "type")]
    ty: String,
    rows: usize,
    row_elements: usize,
    first: Vec<f32>,
    sum: f64,
    sum_sq: f64,
}

#[derive(Deserialize)]
struct SyntheticCase {
    #[serde(rename = "type")]
    ty: String,
    hex: String,
    values: Vec<f32>,
}

fn reference() -> Reference {
    serde_json::from_str(include_str!("data/dequant-reference.json")).expect("reference json")
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Same f32 operations in the same order give the same bits; allow one rounding step.
fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let tol = 1e-6 * w.abs().max(1e-3);
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: got {g}, gguf-py {w}"
        );
    }
}

#[test]
fn synthetic_blocks_of_every_type_match_gguf_py() {
    let r = reference();
    // Every type gguf-py decodes: 17 scalar, legacy, k- and 4-bit types plus 7 codebook i-quants.
    assert_eq!(r.synthetic.len(), 24);
    for case in &r.synthetic {
        let ty = GgmlType::from_name(&case.ty).unwrap();
        let raw = unhex(&case.hex);
        let mut out = vec![f32::NAN; case.values.len()];
        dequantize(ty, &raw, &mut out).unwrap_or_else(|e| panic!("{}: {e}", case.ty));
        assert_close(&out, &case.values, &case.ty);
        // Misaligned input takes the copying path and must give the same values.
        let mut shifted = vec![0u8; raw.len() + 1];
        shifted[1..].copy_from_slice(&raw);
        let mut out2 = vec![f32::NAN; case.values.len()];
        dequantize(ty, &shifted[1..], &mut out2).unwrap();
        assert_eq!(out, out2, "{}: misaligned input", case.ty);
    }
}

fn check_model(file: &str, path: &std::path::Path, cases: &[&ModelCase]) {
    let gguf = GgufFile::open(path).unwrap_or_else(|e| panic!("{file}: {e}"));
    for case in cases {
        let what = format!("{file} {} ({})", case.tensor, case.ty);
        let info = gguf.tensor(&case.tensor).expect(&what);
        assert_eq!(info.ty.name(), case.ty, "{what}");
        assert_eq!(info.dims[0] as usize, case.row_elements, "{what}");
        let n = case.rows * case.row_elements;
        let bytes = info.ty.row_bytes(n as u64).unwrap() as usize;
        let mut out = vec![f32::NAN; n];
        dequantize(info.ty, &gguf.tensor_data(info)[..bytes], &mut out).expect(&what);
        assert_close(&out[..case.first.len()], &case.first, &what);
        let sum: f64 = out.iter().map(|&v| f64::from(v)).sum();
        let sum_sq: f64 = out.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        assert!(
            (sum - case.sum).abs() <= 1e-6 * case.sum_sq.sqrt().max(1.0) * (n as f64).sqrt(),
            "{what}: sum {sum} vs {}",
            case.sum
        );
        assert!(
            (sum_sq - case.sum_sq).abs() <= 1e-5 * case.sum_sq,
            "{what}: sum of squares {sum_sq} vs {}",
            case.sum_sq
        );
    }
}

fn cases_by_file(r: &Reference) -> HashMap<&str, Vec<&ModelCase>> {
    let mut by_file: HashMap<&str, Vec<&ModelCase>> = HashMap::new();
    for c in &r.models {
        by_file.entry(c.file.as_str()).or_default().push(c);
    }
    by_file
}

#[test]
fn tiny_model_tensors_match_gguf_py() {
    let r = reference();
    let by_file = cases_by_file(&r);
    let mut types = std::collections::BTreeSet::new();
    for (file, cases) in by_file.iter().filter(|(f, _)| f.starts_with("tiny-")) {
        check_model(file, &tiny_model(file), cases);
        types.extend(cases.iter().map(|c| c.ty.clone()));
    }
    // The tiny models cycle through thirteen weight types plus F32 norms.
    assert!(types.len() >= 14, "types covered: {types:?}");
}

#[test]
fn real_model_tensors_match_gguf_py() {
    let r = reference();
    let by_file = cases_by_file(&r);
    let real: Vec<_> = by_file
        .iter()
        .filter(|(f, _)| !f.starts_with("tiny-"))
        .collect();
    assert_eq!(real.len(), 3);
    for (file, cases) in real {
        check_model(file, &real_model(file), cases);
    }
}
