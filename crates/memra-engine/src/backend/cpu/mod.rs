//! The CPU backend: rayon-parallel f32 operations and integer matrix products on
//! quantized weights, and the paged KV pool.

mod forward;
pub mod kv;
pub mod matmul;
pub mod ops;
pub mod unpack;
