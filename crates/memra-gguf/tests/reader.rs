//! The reader against hostile input (a corpus of malformed files and random mutations) and
//! the writer -> reader round trip.

use memra_gguf::test_files::{malformed_corpus, tiny_model, valid_small_file};
use memra_gguf::{GgmlType, GgufBuilder, GgufFile, TensorSpec, Value, ValueType};
use proptest::prelude::*;

#[test]
fn the_valid_base_file_parses() {
    let f = GgufFile::from_bytes(valid_small_file()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata.architecture().unwrap(), "llama");
    assert_eq!(
        f.metadata.get_str_array("test.tokens").unwrap().unwrap(),
        ["a", "bc", "<0x0A>"]
    );
    assert_eq!(
        f.metadata.get("test.nested"),
        Some(&Value::Array(
            ValueType::Array,
            vec![
                Value::Array(ValueType::U32, vec![Value::U32(1), Value::U32(2)]),
                Value::Array(ValueType::U32, vec![Value::U32(3)]),
            ]
        ))
    );
    let names: Vec<_> = f
        .tensors
        .iter()
        .map(|t| (t.name.as_str(), t.ty, t.size))
        .collect();
    assert_eq!(
        names,
        [
            ("a", GgmlType::F32, 64),
            ("b", GgmlType::Q4_0, 36),
            ("c", GgmlType::F16, 8)
        ]
    );
    let c = f.tensor("c").unwrap();
    let want: Vec<u8> = (128..136u32).map(|i| (i * 7) as u8).collect();
    assert_eq!(f.tensor_data(c), want.as_slice());
}

#[test]
fn every_malformed_file_gives_its_error() {
    let cases = malformed_corpus(1);
    assert!(cases.len() > 400, "{} cases", cases.len());
    for case in cases {
        match GgufFile::from_bytes(case.bytes.clone()) {
            Ok(_) => panic!("{}: parsed without error", case.name),
            Err(e) => {
                let msg = e.to_string();
                assert!(
                    case.message_fits(&msg),
                    "{}: error {msg:?} does not mention {:?}",
                    case.name,
                    case.expect
                );
                assert!(
                    e.offset <= case.bytes.len() as u64,
                    "{}: offset {}",
                    case.name,
                    e.offset
                );
                assert!(!msg.contains('\n'), "{}: multi-line error", case.name);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Overwriting any bytes of a valid file gives a file or an error, never a panic.
    #[test]
    fn random_overwrites_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u64>(), 1usize..=8), 1..4),
    ) {
        let mut b = valid_small_file();
        for (pos, value, width) in edits {
            let p = pos.index(b.len());
            let end = (p + width).min(b.len());
            b[p..end].copy_from_slice(&value.to_le_bytes()[..end - p]);
        }
        let _ = GgufFile::from_bytes(b);
    }
}

fn value_strategy() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<f32>()
            .prop_filter("NaN != NaN", |f| !f.is_nan())
            .prop_map(Value::F32),
        any::<f64>()
            .prop_filter("NaN != NaN", |f| !f.is_nan())
            .prop_map(Value::F64),
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 40, 6, |inner| {
        // Arrays hold one element type: build from one sample, repeated with variations.
        (inner, 0usize..6).prop_map(|(v, n)| {
            let t = v.value_type();
            let items = match &v {
                Value::Array(..) => vec![v.clone(); n],
                _ => vec![v; n],
            };
            Value::Array(t, items)
        })
    })
}

const TYPES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q4_0,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q6K,
    GgmlType::Iq4Xs,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn writer_output_reads_back_identically(
        kvs in proptest::collection::btree_map("[a-z.]{1,16}", value_strategy(), 0..12),
        tensors in proptest::collection::vec((0..TYPES.len(), 1u64..3, 1u64..4, 1u64..3), 0..6),
        alignment in prop_oneof![Just(None), Just(Some(1u32)), Just(Some(8)), Just(Some(64))],
        seed in any::<u8>(),
    ) {
        let mut b = GgufBuilder::new();
        if let Some(a) = alignment {
            b.metadata.insert("general.alignment", Value::U32(a));
        }
        for (k, v) in &kvs {
            b.metadata.set(format!("x.{k}"), v.clone());
        }
        let mut data = Vec::new();
        for (i, &(t, row_blocks, rows, planes)) in tensors.iter().enumerate() {
            let ty = TYPES[t];
            let dims = [row_blocks * ty.block_size() as u64, rows, planes];
            let spec = TensorSpec::new(format!("t{i}"), ty, &dims[..1 + (i % 3)]);
            let size = spec.size().unwrap() as usize;
            data.push((0..size).map(|j| (j as u8).wrapping_mul(31) ^ seed).collect::<Vec<u8>>());
            b.tensors.push(spec);
        }
        let refs: Vec<&[u8]> = data.iter().map(|d| d.as_slice()).collect();
        let bytes = b.to_bytes(&refs).unwrap();
        prop_assert_eq!(bytes.len() as u64, b.layout().unwrap().file_size);
        let f = GgufFile::from_bytes(bytes).unwrap();
        prop_assert_eq!(&f.metadata, &b.metadata);
        prop_assert_eq!(f.tensors.len(), b.tensors.len());
        for ((info, spec), d) in f.tensors.iter().zip(&b.tensors).zip(&data) {
            prop_assert_eq!(&info.name, &spec.name);
            prop_assert_eq!(info.ty, spec.ty);
            prop_assert_eq!(&info.dims, &spec.dims);
            prop_assert_eq!(info.offset % f.alignment, 0);
            prop_assert_eq!(f.tensor_data(info), d.as_slice());
        }
    }
}

#[test]
fn writer_rejects_what_the_reader_would() {
    let mut b = GgufBuilder::new();
    b.tensors
        .push(TensorSpec::new("w", GgmlType::Q4K, &[100, 2]));
    assert!(b.layout().is_err(), "row not a block multiple");
    b.tensors[0] = TensorSpec::new("", GgmlType::F32, &[4]);
    assert!(b.layout().is_err(), "empty name");
    b.tensors[0] = TensorSpec::new("w", GgmlType::F32, &[4]);
    b.tensors.push(TensorSpec::new("w", GgmlType::F32, &[4]));
    assert!(b.layout().is_err(), "duplicate name");
    b.tensors.pop();
    b.metadata.insert("general.alignment", Value::U32(3));
    assert!(b.layout().is_err(), "alignment 3");
    b.metadata.set("general.alignment", Value::U32(16));
    b.metadata
        .insert("bad", Value::Array(ValueType::U8, vec![Value::U16(1)]));
    assert!(b.to_bytes(&[&[0u8; 16]]).is_err(), "mixed array");
    b.metadata.set("bad", Value::U8(1));
    assert!(b.to_bytes(&[&[0u8; 15]]).is_err(), "short data");
    assert!(b.to_bytes(&[&[0u8; 16]]).is_ok());
}

#[test]
fn tiny_models_parse_and_describe_their_tensors() {
    for name in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3moe",
        "tiny-gemma3",
    ] {
        let f = GgufFile::open(tiny_model(&format!("{name}.gguf"))).unwrap();
        let arch = f.metadata.architecture().unwrap();
        assert_eq!(format!("tiny-{arch}"), name);
        let end = f
            .tensors
            .iter()
            .map(|t| f.data_offset + t.offset + t.size)
            .max()
            .unwrap();
        assert!(end <= f.file_size());
        assert!(
            f.metadata
                .get_str_array("tokenizer.ggml.tokens")
                .unwrap()
                .unwrap()
                .len()
                == 267
        );
    }
}
