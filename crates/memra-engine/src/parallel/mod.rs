//! Several devices for one model: tensor parallelism (`docs/parallel.md`).
//!
//! - `plan`: which share of every weight matrix each rank holds (Megatron-style), checked
//!   before any rank starts; a rank's share is a [`Decoder`](crate::models::Decoder) of
//!   views into the same file.
//! - `collective`: the [`Collective`] trait (all-reduce, all-gather, broadcast) and its
//!   in-process implementation, N ranks on threads: the test double of NCCL and the CPU's
//!   transport.
//! - `nccl`: the same trait over NCCL (GPU buffers), loaded at run time.
//! - `cpu`: tensor parallelism on the CPU backend: one thread per rank, each running the
//!   one forward pass (`models/forward.rs`) on its share with the collective calls.

pub mod collective;
pub mod cpu;
pub mod nccl;
pub mod plan;

pub use collective::{Collective, CollectiveError, HostCollective, InProcess};
pub use cpu::CpuTensorParallel;

use memra_gguf::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum ParallelError {
    #[error("tensor parallelism needs at least 1 rank, not {0}")]
    World(usize),
    #[error("rank {rank} of a group of {world}")]
    Rank { rank: usize, world: usize },
    #[error(
        "the model's {n} {what} heads do not split over {world} ranks: tensor parallelism gives \
         each rank whole heads (and does not replicate KV heads); use a -tp that divides {n}"
    )]
    Heads {
        what: &'static str,
        n: usize,
        world: usize,
    },
    #[error("{tensor}: an FFN width of {n} does not split over {world} ranks")]
    FfnWidth {
        tensor: String,
        n: usize,
        world: usize,
    },
    #[error(
        "{tensor} is {ty} (blocks of {block} weights): {n_in} columns in {world} shares would \
         cut its quant blocks; use a smaller -tp or a model whose rows split on block boundaries"
    )]
    Blocks {
        tensor: String,
        ty: GgmlType,
        block: usize,
        n_in: usize,
        world: usize,
    },
}
