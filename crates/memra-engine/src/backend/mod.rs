//! Compute backends. The CPU backend is the reference every other backend is checked against.

pub mod cpu;
pub mod cuda;
