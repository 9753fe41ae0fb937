//! Where tests find the shared reference files and the real models.
//!
//! Not part of the format code: a small helper so every crate's tests locate
//! `../shared` (the golden outputs and tiny models) and the model cache the same way.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root exists")
}

/// The shared folder beside the checkout: `$MEMRA_SHARED`, else `<workspace>/../shared`.
pub fn shared_dir() -> PathBuf {
    match std::env::var_os("MEMRA_SHARED") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join("../shared"),
    }
}

/// A tiny model from `shared/golden/tiny`.
pub fn tiny_model(name: &str) -> PathBuf {
    shared_dir().join("golden/tiny").join(name)
}

/// The model cache: `$MEMRA_MODELS`, else `~/.cache/memra/models`.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("MEMRA_MODELS") {
        Some(p) => PathBuf::from(p),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/memra/models")
        }
    }
}

/// A real model from the cache, fetched with `scripts/fetch-models.sh` when missing.
/// Panics with the script's message when it cannot be had.
pub fn real_model(name: &str) -> PathBuf {
    let path = models_dir().join(name);
    if !path.is_file() {
        let script = workspace_root().join("scripts/fetch-models.sh");
        let status = Command::new("bash")
            .arg(&script)
            .arg(name)
            .status()
            .expect("run scripts/fetch-models.sh");
        assert!(status.success(), "scripts/fetch-models.sh {name} failed");
    }
    path
}

/// One malformed GGUF file: a name, the bytes, and what its error message must hold.
pub struct MalformedCase {
    pub name: String,
    pub bytes: Vec<u8>,
    /// Fragments separated by `|`: the message must contain one of them.
    pub expect: &'static str,
}

impl MalformedCase {
    pub fn message_fits(&self, message: &str) -> bool {
        self.expect.split('|').any(|e| message.contains(e))
    }
}

/// A metadata entry as raw bytes: key, value type id, encoded value.
struct RawKv {
    key: Vec<u8>,
    ty: u32,
    value: Vec<u8>,
}

struct RawTensor {
    name: Vec<u8>,
    dims: Vec<u64>,
    ty: u32,
    offset: u64,
}

/// A GGUF file spelled out byte by byte, independently of the crate's writer, remembering
/// where each field it wrote starts so that a case can overwrite it.
struct RawFile {
    kvs: Vec<RawKv>,
    tensors: Vec<RawTensor>,
    data: Vec<u8>,
}

fn raw_str(s: &[u8]) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s);
    v
}

fn raw_array(elem_ty: u32, items: &[Vec<u8>]) -> Vec<u8> {
    let mut v = elem_ty.to_le_bytes().to_vec();
    v.extend_from_slice(&(items.len() as u64).to_le_bytes());
    for i in items {
        v.extend_from_slice(i);
    }
    v
}

impl RawFile {
    fn base() -> RawFile {
        let kv = |key: &str, ty: u32, value: Vec<u8>| RawKv {
            key: key.as_bytes().to_vec(),
            ty,
            value,
        };
        let tokens = [b"a".as_slice(), b"bc", b"<0x0A>"].map(raw_str).to_vec();
        let inner = vec![
            raw_array(
                4,
                &[1u32.to_le_bytes().to_vec(), 2u32.to_le_bytes().to_vec()],
            ),
            raw_array(4, &[3u32.to_le_bytes().to_vec()]),
        ];
        let tensor = |name: &str, dims: &[u64], ty: u32, offset: u64| RawTensor {
            name: name.as_bytes().to_vec(),
            dims: dims.to_vec(),
            ty,
            offset,
        };
        RawFile {
            kvs: vec![
                kv("general.architecture", 8, raw_str(b"llama")),
                kv("general.alignment", 4, 32u32.to_le_bytes().to_vec()),
                kv("test.bool", 7, vec![1]),
                kv("test.tokens", 9, raw_array(8, &tokens)),
                kv("test.nested", 9, raw_array(9, &inner)),
                kv("test.f", 6, 1.5f32.to_le_bytes().to_vec()),
            ],
            tensors: vec![
                tensor("a", &[8, 2], 0, 0),   // F32, 64 bytes
                tensor("b", &[32, 2], 2, 64), // Q4_0, 36 bytes
                tensor("c", &[4], 1, 128),    // F16, 8 bytes
            ],
            data: (0..136u32).map(|i| (i * 7) as u8).collect(),
        }
    }

    /// The file's bytes and the start of each named field.
    fn encode(&self) -> (Vec<u8>, HashMap<String, usize>) {
        let mut b = b"GGUF".to_vec();
        let mut at = HashMap::new();
        at.insert("version".to_string(), b.len());
        b.extend_from_slice(&3u32.to_le_bytes());
        at.insert("tensor_count".to_string(), b.len());
        b.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        at.insert("kv_count".to_string(), b.len());
        b.extend_from_slice(&(self.kvs.len() as u64).to_le_bytes());
        for (i, kv) in self.kvs.iter().enumerate() {
            at.insert(format!("key_len{i}"), b.len());
            b.extend_from_slice(&raw_str(&kv.key));
            at.insert(format!("value_type{i}"), b.len());
            b.extend_from_slice(&kv.ty.to_le_bytes());
            at.insert(format!("value{i}"), b.len());
            b.extend_from_slice(&kv.value);
        }
        for (i, t) in self.tensors.iter().enumerate() {
            at.insert(format!("name_len{i}"), b.len());
            b.extend_from_slice(&raw_str(&t.name));
            at.insert(format!("n_dims{i}"), b.len());
            b.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for (k, d) in t.dims.iter().enumerate() {
                at.insert(format!("dim{i}.{k}"), b.len());
                b.extend_from_slice(&d.to_le_bytes());
            }
            at.insert(format!("type{i}"), b.len());
            b.extend_from_slice(&t.ty.to_le_bytes());
            at.insert(format!("offset{i}"), b.len());
            b.extend_from_slice(&t.offset.to_le_bytes());
        }
        b.resize(b.len().div_ceil(32) * 32, 0);
        b.extend_from_slice(&self.data);
        (b, at)
    }
}

/// A small valid GGUF file (three tensors, scalar, string, array and nested-array
/// metadata), spelled out independently of the crate's writer.
pub fn valid_small_file() -> Vec<u8> {
    RawFile::base().encode().0
}

/// Malformed GGUF files, each with a fragment of the error it must give: truncations at
/// every `truncate_step`-th offset, huge and zero counts in every count field, overflowing
/// dimensions, bad alignment, overlapping or out-of-file tensors, wrong value types.
pub fn malformed_corpus(truncate_step: usize) -> Vec<MalformedCase> {
    let mut cases = Vec::new();
    let mut add = |name: String, bytes: Vec<u8>, expect: &'static str| {
        cases.push(MalformedCase {
            name,
            bytes,
            expect,
        })
    };
    let (base, at) = RawFile::base().encode();
    let patched = |field: &str, value: &[u8]| {
        let mut b = base.clone();
        let o = at[field];
        b[o..o + value.len()].copy_from_slice(value);
        b
    };
    let u64b = |v: u64| v.to_le_bytes().to_vec();
    let u32b = |v: u32| v.to_le_bytes().to_vec();

    for cut in (0..base.len()).step_by(truncate_step.max(1)) {
        // Header cuts say "truncated"; cuts in the data leave a tensor outside the file.
        let expect = if cut < at["offset2"] + 8 {
            "truncated|is impossible"
        } else {
            "outside the"
        };
        add(format!("truncated at {cut}"), base[..cut].to_vec(), expect);
    }
    add(
        "bad magic".into(),
        [b"GGUX".as_slice(), &base[4..]].concat(),
        "not a GGUF file",
    );
    add(
        "version 1".into(),
        patched("version", &u32b(1)),
        "version 1 is not supported",
    );
    add(
        "version 4".into(),
        patched("version", &u32b(4)),
        "version 4 is not supported",
    );
    add(
        "big-endian".into(),
        patched("version", &3u32.to_be_bytes()),
        "big-endian",
    );

    for (field, what) in [
        ("tensor_count", "tensor info count"),
        ("kv_count", "metadata entry count"),
    ] {
        for v in [u64::MAX, 1 << 40, u64::MAX / 2 + 1] {
            add(format!("{field} = {v}"), patched(field, &u64b(v)), what);
        }
    }
    for i in 0..6 {
        add(
            format!("key {i} length huge"),
            patched(&format!("key_len{i}"), &u64b(u64::MAX)),
            "truncated",
        );
        add(
            format!("key {i} length zero"),
            patched(&format!("key_len{i}"), &u64b(0)),
            "empty metadata key",
        );
        add(
            format!("value type {i} unknown"),
            patched(&format!("value_type{i}"), &u32b(13)),
            "unknown metadata value type 13",
        );
        add(
            format!("value type {i} u32::MAX"),
            patched(&format!("value_type{i}"), &u32b(u32::MAX)),
            "unknown metadata value type",
        );
    }
    add(
        "string value length huge".into(),
        patched("value0", &u64b(u64::MAX)),
        "truncated",
    );
    add(
        "bool value 2".into(),
        patched("value2", &[2]),
        "boolean value 2",
    );
    // test.tokens: [elem type u32][count u64][strings]
    let tokens = at["value3"];
    add(
        "array count huge".into(),
        patched("value3", &[u32b(8), u64b(u64::MAX)].concat()),
        "array element count",
    );
    add(
        "array count 2^40".into(),
        patched("value3", &[u32b(8), u64b(1 << 40)].concat()),
        "array element count",
    );
    add(
        "array element type unknown".into(),
        patched("value3", &u32b(99)),
        "unknown metadata value type 99",
    );
    add(
        "array string length huge".into(),
        {
            let mut b = base.clone();
            b[tokens + 12..tokens + 20].copy_from_slice(&u64b(u64::MAX));
            b
        },
        "truncated",
    );
    add(
        "nested array count huge".into(),
        {
            let mut b = base.clone();
            let inner = at["value4"] + 12;
            b[inner + 4..inner + 12].copy_from_slice(&u64b(u64::MAX));
            b
        },
        "array element count",
    );
    add(
        "alignment 3".into(),
        patched("value1", &u32b(3)),
        "not a power of two",
    );
    add(
        "alignment 0".into(),
        patched("value1", &u32b(0)),
        "not a power of two",
    );
    add(
        "alignment as i32".into(),
        patched("value_type1", &u32b(5)),
        "general.alignment must be a u32",
    );
    add(
        "alignment as string".into(),
        {
            let mut f = RawFile::base();
            f.kvs[1].ty = 8;
            f.kvs[1].value = raw_str(b"32");
            f.encode().0
        },
        "general.alignment must be a u32, found string",
    );
    add(
        "invalid UTF-8 key".into(),
        {
            let mut f = RawFile::base();
            f.kvs[2].key = vec![b't', 0xff, 0xfe];
            f.encode().0
        },
        "not valid UTF-8",
    );
    add(
        "duplicate key".into(),
        {
            let mut f = RawFile::base();
            f.kvs[5].key = b"test.bool".to_vec();
            f.encode().0
        },
        "duplicate metadata key",
    );
    add(
        "arrays nested too deep".into(),
        {
            let mut f = RawFile::base();
            let mut v = raw_array(4, &[]);
            for _ in 0..12 {
                v = raw_array(9, &[v]);
            }
            f.kvs[4].value = v;
            f.encode().0
        },
        "nested deeper",
    );

    for i in 0..3 {
        add(
            format!("tensor {i} name length huge"),
            patched(&format!("name_len{i}"), &u64b(u64::MAX)),
            "exceeds the limit",
        );
        add(
            format!("tensor {i} name empty"),
            patched(&format!("name_len{i}"), &u64b(0)),
            "empty tensor name",
        );
        for n in [0u32, 5, u32::MAX] {
            add(
                format!("tensor {i} n_dims {n}"),
                patched(&format!("n_dims{i}"), &u32b(n)),
                "dimensions (1 to 4",
            );
        }
        add(
            format!("tensor {i} dim 0"),
            patched(&format!("dim{i}.0"), &u64b(0)),
            "equal to 0",
        );
        add(
            format!("tensor {i} dim huge"),
            patched(&format!("dim{i}.0"), &u64b(u64::MAX)),
            "too many elements",
        );
        add(
            format!("tensor {i} type unknown"),
            patched(&format!("type{i}"), &u32b(1000)),
            "unknown ggml type id 1000",
        );
        add(
            format!("tensor {i} type retired"),
            patched(&format!("type{i}"), &u32b(4)),
            "unknown ggml type id 4",
        );
        add(
            format!("tensor {i} offset misaligned"),
            patched(&format!("offset{i}"), &u64b(1)),
            "not a multiple of the alignment",
        );
        add(
            format!("tensor {i} offset near u64::MAX"),
            patched(&format!("offset{i}"), &u64b(u64::MAX - 31)),
            "outside the",
        );
        add(
            format!("tensor {i} offset past the end"),
            patched(&format!("offset{i}"), &u64b(1 << 20)),
            "outside the",
        );
    }
    add(
        "dims overflow i64".into(),
        patched("dim0.1", &u64b(1 << 62)),
        "too many elements",
    );
    add(
        "dims product overflows u64".into(),
        {
            let mut f = RawFile::base();
            f.tensors[0].dims = vec![1 << 32, 1 << 32, 1 << 32];
            f.encode().0
        },
        "too many elements",
    );
    add(
        "tensor larger than file".into(),
        patched("dim1.1", &u64b(1000)),
        "outside the",
    );
    add(
        "row not a block multiple".into(),
        patched("type0", &u32b(2)),
        "not a multiple of the Q4_0 block size",
    );
    add(
        "overlapping tensors".into(),
        patched("offset1", &u64b(32)),
        "overlap",
    );
    add(
        "same offset".into(),
        patched("offset2", &u64b(64)),
        "overlap",
    );
    add(
        "duplicate tensor name".into(),
        {
            let mut f = RawFile::base();
            f.tensors[2].name = b"a".to_vec();
            f.encode().0
        },
        "duplicate tensor name",
    );
    add(
        "invalid UTF-8 tensor name".into(),
        {
            let mut f = RawFile::base();
            f.tensors[1].name = vec![0xc3];
            f.encode().0
        },
        "not valid UTF-8",
    );
    add("empty file".into(), Vec::new(), "truncated");
    cases
}
