//! The CPU backend: rayon-parallel f32 operations and integer matrix products on
//! quantized weights.

pub mod matmul;
pub mod ops;
pub mod unpack;
