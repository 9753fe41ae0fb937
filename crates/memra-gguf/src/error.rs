//! Errors of the GGUF reader, writer and metadata accessors.

use std::fmt;

use crate::types::GgmlType;

/// A file that cannot be read as GGUF: what is wrong, and the byte offset where the
/// offending field starts.
#[derive(Debug, thiserror::Error)]
#[error("{kind} (at byte {offset})")]
pub struct GgufError {
    pub offset: u64,
    pub kind: ErrorKind,
}

impl GgufError {
    pub(crate) fn new(offset: usize, kind: ErrorKind) -> GgufError {
        GgufError {
            offset: offset as u64,
            kind,
        }
    }
}

/// What is wrong with a GGUF file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ErrorKind {
    #[error("cannot read file: {0}")]
    Io(String),
    #[error("not a GGUF file: magic is {0:02x?}, expected \"GGUF\"")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (versions 2 and 3 are)")]
    UnsupportedVersion(u32),
    #[error("big-endian GGUF files are not supported")]
    BigEndian,
    #[error("file truncated while reading {what}: needs {needed} bytes, {available} left")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: u64,
    },
    #[error("{what} count {count} is impossible: the rest of the file holds at most {max}")]
    CountTooLarge {
        what: &'static str,
        count: u64,
        max: u64,
    },
    #[error("{what} is not valid UTF-8")]
    InvalidUtf8 { what: &'static str },
    #[error("empty metadata key")]
    EmptyKey,
    #[error("unknown metadata value type {0}")]
    UnknownValueType(u32),
    #[error("boolean value {0} is neither 0 nor 1")]
    InvalidBool(u8),
    #[error("more than {0} metadata values")]
    TooManyValues(u64),
    #[error("metadata arrays nested deeper than {0} levels")]
    NestingTooDeep(usize),
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("general.alignment must be a u32, found {0}")]
    AlignmentType(&'static str),
    #[error("general.alignment {0} is not a power of two")]
    BadAlignment(u64),
    #[error("empty tensor name")]
    EmptyTensorName,
    #[error("tensor name of {0} bytes exceeds the limit of {max}", max = crate::reader::MAX_TENSOR_NAME)]
    TensorNameTooLong(u64),
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor {tensor:?} has {n_dims} dimensions (1 to 4 are allowed)")]
    BadDimCount { tensor: String, n_dims: u32 },
    #[error("tensor {tensor:?} has dimension {axis} equal to 0")]
    ZeroDim { tensor: String, axis: usize },
    #[error("tensor {tensor:?} has too many elements (dimensions {dims:?})")]
    ElementCountOverflow { tensor: String, dims: Vec<u64> },
    #[error("tensor {tensor:?} has unknown ggml type id {id}")]
    UnknownTensorType { tensor: String, id: u32 },
    #[error(
        "tensor {tensor:?}: row length {ne0} is not a multiple of the {ty} block size {block}"
    )]
    RowNotBlockMultiple {
        tensor: String,
        ty: GgmlType,
        ne0: u64,
        block: usize,
    },
    #[error(
        "tensor {tensor:?} data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {tensor:?} data [{start}, {end}) lies outside the {data_len}-byte data section"
    )]
    TensorOutOfFile {
        tensor: String,
        start: u64,
        end: u64,
        data_len: u64,
    },
    #[error("tensors {first:?} and {second:?} overlap")]
    OverlappingTensors { first: String, second: String },
}

/// A metadata key that is missing or holds a value of the wrong type.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MetadataError {
    #[error("metadata key {0:?} is missing")]
    Missing(String),
    #[error("metadata key {key:?} should hold {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {key:?} holds {value}, out of range for {expected}")]
    OutOfRange {
        key: String,
        expected: &'static str,
        value: String,
    },
}

/// Misuse of the writer: values it cannot encode.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("io: {0}")]
    Io(#[from] std::io::Error),
    #[error("invalid GGUF content: {0}")]
    Invalid(String),
}

impl WriteError {
    pub(crate) fn invalid(msg: impl fmt::Display) -> WriteError {
        WriteError::Invalid(msg.to_string())
    }
}
