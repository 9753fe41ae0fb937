//! The GGUF reader. It treats the file as hostile: every size is checked arithmetic, every
//! count is capped by the bytes left in the file before anything is allocated for it, and
//! every problem is a [`GgufError`] naming the offset, never a panic.
//!
//! Layout (GGUF v2/v3, little-endian): magic `GGUF`, u32 version, u64 tensor count, u64
//! metadata count, the metadata key/value pairs, the tensor infos (name, n_dims, dims,
//! type, offset), padding to `general.alignment` (default 32), then the tensor data.

use std::collections::HashSet;
use std::fs::File;
use std::ops::Deref;
use std::path::Path;

use memmap2::Mmap;

use crate::error::{ErrorKind, GgufError};
use crate::metadata::{Metadata, Value, ValueType};
use crate::types::GgmlType;

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_NAME`: longer tensor names cannot be represented by ggml.
pub const MAX_TENSOR_NAME: u64 = 64;
/// ggml tensors have at most four dimensions.
pub const MAX_DIMS: u32 = 4;
/// Arrays of arrays deeper than this are rejected, so nesting cannot exhaust the stack.
pub const MAX_ARRAY_NESTING: usize = 8;
/// Metadata values in all (array elements included) a file may hold. Parsed values take
/// up to 32 bytes of memory each, so this bounds the memory metadata can claim (1 GiB)
/// whatever the file says; a 262k-token vocabulary with scores, types and merges is
/// about a million values.
pub const MAX_METADATA_VALUES: u64 = 1 << 25;

/// Smallest possible encodings, used to cap counts before allocating.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1; // key length, one key byte, value type, a u8 value
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 8 + 4 + 8; // name len+1 byte, n_dims, 1 dim, type, offset

type Result<T> = std::result::Result<T, GgufError>;

/// One tensor's description from the file header.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub ty: GgmlType,
    /// Dimensions in ggml order: `dims[0]` is the row length (innermost).
    pub dims: Vec<u64>,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        // Checked at parse time not to overflow.
        self.dims.iter().product()
    }

    /// Number of rows (all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims[1..].iter().product()
    }
}

/// Where the file bytes live: a read-only mapping, or memory (tests, fuzzing).
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file with zero-copy access to its tensor data.
pub struct GgufFile {
    storage: Storage,
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
}

impl GgufFile {
    /// Maps and parses a file.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let io = |e: std::io::Error| {
            GgufError::new(0, ErrorKind::Io(format!("{}: {e}", path.display())))
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only. A file truncated by another process while mapped
        // can still fault; that is the usual contract of mmap-based loaders (llama.cpp too).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        GgufFile::parse(Storage::Mapped(map))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<GgufFile> {
        let header = parse_header(&storage)?;
        Ok(GgufFile {
            storage,
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_offset: header.data_offset,
        })
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.storage
    }

    /// The whole file's size in bytes.
    pub fn file_size(&self) -> u64 {
        self.storage.len() as u64
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The bytes of a tensor of this file. Bounds were checked when the file was parsed.
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.storage[start..start + info.size as usize]
    }
}

/// Everything before the tensor data.
pub struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
}

/// Parses and validates a GGUF header against the whole file's bytes.
pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    let mut c = Cursor {
        buf: bytes,
        pos: 0,
        values_left: MAX_METADATA_VALUES,
    };
    let magic: [u8; 4] = c.take(4, "magic")?.try_into().expect("4 bytes");
    if magic != GGUF_MAGIC {
        return Err(GgufError::new(0, ErrorKind::BadMagic(magic)));
    }
    let version = c.u32("version")?;
    match version {
        2 | 3 => {}
        v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
            return Err(GgufError::new(4, ErrorKind::BigEndian))
        }
        v => return Err(GgufError::new(4, ErrorKind::UnsupportedVersion(v))),
    }
    let tensor_count_at = c.pos;
    let n_tensors = c.u64("tensor count")?;
    let kv_count_at = c.pos;
    let n_kv = c.u64("metadata count")?;
    // Each metadata entry and each tensor info takes a minimum number of bytes.
    c.check_count(n_kv, MIN_KV_BYTES, "metadata entry", kv_count_at)?;
    c.check_count(
        n_tensors,
        MIN_TENSOR_INFO_BYTES,
        "tensor info",
        tensor_count_at,
    )?;

    let mut metadata = Metadata::new();
    for _ in 0..n_kv {
        let key_at = c.pos;
        let key = c.string("metadata key")?;
        if key.is_empty() {
            return Err(GgufError::new(key_at, ErrorKind::EmptyKey));
        }
        let vt_at = c.pos;
        let vt = c.value_type(vt_at)?;
        let value = c.value(vt, 0)?;
        if !metadata.insert(key.clone(), value) {
            return Err(GgufError::new(key_at, ErrorKind::DuplicateKey(key)));
        }
    }

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(Value::U32(a)) => return Err(GgufError::new(0, ErrorKind::BadAlignment((*a).into()))),
        Some(v) => {
            return Err(GgufError::new(
                0,
                ErrorKind::AlignmentType(v.value_type().name()),
            ))
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut offsets_at = Vec::with_capacity(n_tensors as usize);
    let mut names = HashSet::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name_at = c.pos;
        let len = c.u64("tensor name length")?;
        if len == 0 {
            return Err(GgufError::new(name_at, ErrorKind::EmptyTensorName));
        }
        if len > MAX_TENSOR_NAME {
            return Err(GgufError::new(name_at, ErrorKind::TensorNameTooLong(len)));
        }
        let name = c.utf8(len, "tensor name")?;
        if !names.insert(name.clone()) {
            return Err(GgufError::new(name_at, ErrorKind::DuplicateTensor(name)));
        }
        let dims_at = c.pos;
        let n_dims = c.u32("tensor dimension count")?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(GgufError::new(
                dims_at,
                ErrorKind::BadDimCount {
                    tensor: name,
                    n_dims,
                },
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for axis in 0..n_dims as usize {
            let at = c.pos;
            let d = c.u64("tensor dimension")?;
            if d == 0 {
                return Err(GgufError::new(
                    at,
                    ErrorKind::ZeroDim { tensor: name, axis },
                ));
            }
            dims.push(d);
        }
        // ggml counts elements in int64_t.
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        let Some(n_elements) = n_elements else {
            return Err(GgufError::new(
                dims_at,
                ErrorKind::ElementCountOverflow { tensor: name, dims },
            ));
        };
        let type_at = c.pos;
        let type_id = c.u32("tensor type")?;
        let Some(ty) = GgmlType::from_id(type_id) else {
            return Err(GgufError::new(
                type_at,
                ErrorKind::UnknownTensorType {
                    tensor: name,
                    id: type_id,
                },
            ));
        };
        if dims[0] % ty.block_size() as u64 != 0 {
            return Err(GgufError::new(
                dims_at,
                ErrorKind::RowNotBlockMultiple {
                    tensor: name,
                    ty,
                    ne0: dims[0],
                    block: ty.block_size(),
                },
            ));
        }
        let size = (n_elements / ty.block_size() as u64)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| {
                GgufError::new(
                    dims_at,
                    ErrorKind::ElementCountOverflow {
                        tensor: name.clone(),
                        dims: dims.clone(),
                    },
                )
            })?;
        let offset_at = c.pos;
        let offset = c.u64("tensor data offset")?;
        if offset % alignment != 0 {
            return Err(GgufError::new(
                offset_at,
                ErrorKind::MisalignedTensor {
                    tensor: name,
                    offset,
                    alignment,
                },
            ));
        }
        offsets_at.push(offset_at);
        tensors.push(TensorInfo {
            name,
            ty,
            dims,
            offset,
            size,
        });
    }

    let end_of_infos = c.pos as u64;
    let data_offset = end_of_infos.div_ceil(alignment) * alignment;
    let file_len = bytes.len() as u64;
    let data_len = file_len.saturating_sub(data_offset);
    for (t, &at) in tensors.iter().zip(&offsets_at) {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|end| end > data_len) {
            return Err(GgufError::new(
                at,
                ErrorKind::TensorOutOfFile {
                    tensor: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    data_len,
                },
            ));
        }
    }
    let mut by_offset: Vec<usize> = (0..tensors.len()).collect();
    by_offset.sort_by_key(|&i| tensors[i].offset);
    for pair in by_offset.windows(2) {
        let (a, b) = (&tensors[pair[0]], &tensors[pair[1]]);
        if a.offset + a.size > b.offset {
            return Err(GgufError::new(
                offsets_at[pair[1]],
                ErrorKind::OverlappingTensors {
                    first: a.name.clone(),
                    second: b.name.clone(),
                },
            ));
        }
    }

    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    values_left: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn at(&self) -> usize {
        self.pos
    }

    fn take(&mut self, n: u64, what: &'static str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(GgufError::new(
                self.at(),
                ErrorKind::Truncated {
                    what,
                    needed: n,
                    available: self.remaining(),
                },
            ));
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Fails unless `count` items of at least `min_size` bytes each fit in the rest of the
    /// file; makes allocating `count` slots safe.
    fn check_count(&self, count: u64, min_size: u64, what: &'static str, at: usize) -> Result<()> {
        let max = self.remaining() / min_size;
        if count > max {
            return Err(GgufError::new(
                at,
                ErrorKind::CountTooLarge { what, count, max },
            ));
        }
        Ok(())
    }

    fn utf8(&mut self, len: u64, what: &'static str) -> Result<String> {
        let at = self.at();
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::new(at, ErrorKind::InvalidUtf8 { what })),
        }
    }

    fn string(&mut self, what: &'static str) -> Result<String> {
        let len = self.u64(what)?;
        self.utf8(len, what)
    }

    fn value_type(&mut self, at: usize) -> Result<ValueType> {
        let id = self.u32("metadata value type")?;
        ValueType::from_id(id).ok_or_else(|| GgufError::new(at, ErrorKind::UnknownValueType(id)))
    }

    fn value(&mut self, vt: ValueType, depth: usize) -> Result<Value> {
        const W: &str = "metadata value";
        if self.values_left == 0 {
            return Err(GgufError::new(
                self.at(),
                ErrorKind::TooManyValues(MAX_METADATA_VALUES),
            ));
        }
        self.values_left -= 1;
        Ok(match vt {
            ValueType::U8 => Value::U8(self.array::<1>(W)?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(W)?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(W)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(W)?)),
            ValueType::U32 => Value::U32(self.u32(W)?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(W)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(W)?)),
            ValueType::U64 => Value::U64(self.u64(W)?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(W)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(W)?)),
            ValueType::Bool => {
                let at = self.at();
                match self.array::<1>(W)?[0] {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(GgufError::new(at, ErrorKind::InvalidBool(b))),
                }
            }
            ValueType::String => Value::String(self.string("metadata string")?),
            ValueType::Array => {
                let at = self.pos;
                if depth >= MAX_ARRAY_NESTING {
                    return Err(GgufError::new(
                        at,
                        ErrorKind::NestingTooDeep(MAX_ARRAY_NESTING),
                    ));
                }
                let elem = self.value_type(at)?;
                let count_at = self.pos;
                let n = self.u64("array length")?;
                self.check_count(n, elem.min_encoded_size(), "array element", count_at)?;
                let mut items = Vec::with_capacity(n.min(self.values_left) as usize);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}
