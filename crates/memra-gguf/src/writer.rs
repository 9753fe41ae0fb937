//! The GGUF writer (version 3). It lays out tensor data at `general.alignment` and can
//! stream tensor bytes chunk by chunk, so multi-gigabyte synthetic models never have to
//! sit in memory whole.

use std::collections::HashSet;
use std::io::Write;

use crate::error::WriteError;
use crate::metadata::{Metadata, Value, ValueType};
use crate::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS, MAX_TENSOR_NAME};
use crate::types::GgmlType;

type Result<T> = std::result::Result<T, WriteError>;

/// A tensor to be written: its name, type and dimensions (ggml order).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
}

impl TensorSpec {
    pub fn new(name: impl Into<String>, ty: GgmlType, dims: &[u64]) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            ty,
            dims: dims.to_vec(),
        }
    }

    /// Bytes of data, or `None` when the dimensions are invalid for the type.
    pub fn size(&self) -> Option<u64> {
        if self.dims.is_empty() || self.dims.len() > MAX_DIMS as usize {
            return None;
        }
        let n = self
            .dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|_| d > 0))?;
        self.ty.row_bytes(self.dims[0])?;
        (n / self.ty.block_size() as u64).checked_mul(self.ty.type_size() as u64)
    }
}

/// A GGUF file under construction: metadata and tensor specs; data is supplied at write time.
#[derive(Clone, Debug, Default)]
pub struct GgufBuilder {
    pub metadata: Metadata,
    pub tensors: Vec<TensorSpec>,
}

/// Where each tensor's data goes, computed from the header.
#[derive(Clone, Debug)]
pub struct Layout {
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_offset: u64,
    /// Offset of each tensor from the data section start, and its size.
    pub tensors: Vec<(u64, u64)>,
    /// Total file size.
    pub file_size: u64,
}

impl GgufBuilder {
    pub fn new() -> GgufBuilder {
        GgufBuilder::default()
    }

    pub fn alignment(&self) -> Result<u64> {
        match self.metadata.get("general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some(Value::U32(a)) if a.is_power_of_two() => Ok((*a).into()),
            Some(v) => Err(WriteError::invalid(format!(
                "general.alignment must be a power-of-two u32, not {v}"
            ))),
        }
    }

    fn header_bytes(&self, layout_offsets: &[(u64, u64)]) -> Result<Vec<u8>> {
        let mut h = Vec::new();
        h.extend_from_slice(&GGUF_MAGIC);
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in self.metadata.iter() {
            if key.is_empty() {
                return Err(WriteError::invalid("empty metadata key"));
            }
            put_str(&mut h, key);
            h.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut h, value)?;
        }
        for (t, &(offset, _)) in self.tensors.iter().zip(layout_offsets) {
            put_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.ty.id().to_le_bytes());
            h.extend_from_slice(&offset.to_le_bytes());
        }
        Ok(h)
    }

    /// Validates the tensors and computes where everything goes.
    pub fn layout(&self) -> Result<Layout> {
        let alignment = self.alignment()?;
        let mut names = HashSet::new();
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut next = 0u64;
        for t in &self.tensors {
            if t.name.is_empty() || t.name.len() as u64 > MAX_TENSOR_NAME {
                return Err(WriteError::invalid(format!(
                    "tensor name {:?} must have 1 to {MAX_TENSOR_NAME} bytes",
                    t.name
                )));
            }
            if !names.insert(t.name.as_str()) {
                return Err(WriteError::invalid(format!(
                    "duplicate tensor name {:?}",
                    t.name
                )));
            }
            let size = t.size().ok_or_else(|| {
                WriteError::invalid(format!(
                    "tensor {:?}: dimensions {:?} are invalid for {}",
                    t.name, t.dims, t.ty
                ))
            })?;
            offsets.push((next, size));
            next = (next + size).div_ceil(alignment) * alignment;
        }
        let header_len = self.header_bytes(&offsets)?.len() as u64;
        let data_offset = header_len.div_ceil(alignment) * alignment;
        let file_size = match offsets.last() {
            Some(&(o, s)) => data_offset + o + s,
            None => header_len,
        };
        Ok(Layout {
            alignment,
            data_offset,
            tensors: offsets,
            file_size,
        })
    }

    /// Writes the file, asking `fill(tensor_index, offset_in_tensor, chunk)` for each
    /// tensor's bytes, in chunks of whole blocks of at most `chunk_bytes` bytes.
    pub fn write_streaming<W: Write>(
        &self,
        out: &mut W,
        chunk_bytes: usize,
        mut fill: impl FnMut(usize, u64, &mut [u8]),
    ) -> Result<Layout> {
        let layout = self.layout()?;
        let header = self.header_bytes(&layout.tensors)?;
        out.write_all(&header)?;
        let mut written = header.len() as u64;
        let mut buf = Vec::new();
        for (i, (t, &(offset, size))) in self.tensors.iter().zip(&layout.tensors).enumerate() {
            pad_to(out, &mut written, layout.data_offset + offset)?;
            let block = t.ty.type_size();
            let step = (chunk_bytes / block).max(1) * block;
            let mut done = 0u64;
            while done < size {
                let n = step.min((size - done) as usize);
                buf.resize(n, 0);
                fill(i, done, &mut buf);
                out.write_all(&buf)?;
                done += n as u64;
            }
            written += size;
        }
        Ok(layout)
    }

    /// Writes the file with each tensor's complete data given in order.
    pub fn write<W: Write>(&self, out: &mut W, data: &[&[u8]]) -> Result<Layout> {
        if data.len() != self.tensors.len() {
            return Err(WriteError::invalid(format!(
                "{} tensors but {} data buffers",
                self.tensors.len(),
                data.len()
            )));
        }
        let layout = self.layout()?;
        for (t, (d, &(_, size))) in self.tensors.iter().zip(data.iter().zip(&layout.tensors)) {
            if d.len() as u64 != size {
                return Err(WriteError::invalid(format!(
                    "tensor {:?} needs {size} bytes, {} given",
                    t.name,
                    d.len()
                )));
            }
        }
        self.write_streaming(out, usize::MAX, |i, offset, chunk| {
            let start = offset as usize;
            chunk.copy_from_slice(&data[i][start..start + chunk.len()]);
        })
    }

    /// The whole file in memory (tests).
    pub fn to_bytes(&self, data: &[&[u8]]) -> Result<Vec<u8>> {
        let mut v = Vec::new();
        self.write(&mut v, data)?;
        Ok(v)
    }
}

fn pad_to<W: Write>(out: &mut W, written: &mut u64, target: u64) -> Result<()> {
    const ZEROS: [u8; 256] = [0; 256];
    while *written < target {
        let n = ((target - *written) as usize).min(ZEROS.len());
        out.write_all(&ZEROS[..n])?;
        *written += n as u64;
    }
    Ok(())
}

fn put_str(h: &mut Vec<u8>, s: &str) {
    h.extend_from_slice(&(s.len() as u64).to_le_bytes());
    h.extend_from_slice(s.as_bytes());
}

fn put_value(h: &mut Vec<u8>, v: &Value) -> Result<()> {
    match v {
        Value::U8(x) => h.push(*x),
        Value::I8(x) => h.push(*x as u8),
        Value::U16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::U64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => h.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(b) => h.push(u8::from(*b)),
        Value::String(s) => put_str(h, s),
        Value::Array(t, items) => {
            h.extend_from_slice(&(*t as u32).to_le_bytes());
            h.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                if item.value_type() != *t {
                    return Err(WriteError::invalid(format!(
                        "array of {} holds a {}",
                        t.name(),
                        item.type_description()
                    )));
                }
                put_value(h, item)?;
            }
        }
    }
    Ok(())
}

/// Shorthand for building string-array metadata.
pub fn string_array<I, S>(items: I) -> Value
where
    I: IntoIterator<Item = S>,
    S: Into<String>,
{
    Value::Array(
        ValueType::String,
        items.into_iter().map(|s| Value::String(s.into())).collect(),
    )
}
