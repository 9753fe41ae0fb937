//! memra-gguf: the GGUF file format and ggml's weight encodings, in plain Rust.
//!
//! - [`GgufFile`]: a hardened reader over a memory map, with typed metadata and
//!   zero-copy tensor views;
//! - [`GgufBuilder`]: a writer that streams tensor data;
//! - [`quant`]: every ggml block layout with CPU dequantization and the activation
//!   quantize + dot product pairs, the reference for faster kernels.
//!
//! No CUDA and no model knowledge live here.

#[cfg(target_endian = "big")]
compile_error!("memra-gguf reads little-endian GGUF files by casting bytes; big-endian hosts are not supported");

pub mod error;
pub mod metadata;
pub mod quant;
pub mod reader;
pub mod test_files;
pub mod types;
pub mod writer;

pub use error::{ErrorKind, GgufError, MetadataError, WriteError};
pub use metadata::{Metadata, Value, ValueType};
pub use reader::{parse_header, GgufFile, TensorInfo};
pub use types::{GgmlType, QK_K};
pub use writer::{string_array, GgufBuilder, Layout, TensorSpec};
