//! Tensor parallelism on the CPU: N ranks in this process, one thread each, every rank
//! holding its share of the weights (views of the same mapped file) and a KV pool of its
//! KV heads, exchanging over [`InProcess`]. On one CPU this is a correctness path (the
//! ranks share the cores and add the exchanges), the same structure the GPUs take with
//! NCCL: one thread per GPU, each running the one forward pass on its share.

use super::collective::{CollectiveError, InProcess};
use super::{plan, ParallelError};
use crate::backend::cpu::kv::KvPool;
use crate::batch::ForwardBatch;
use crate::models::{Decoder, ModelError};

struct Rank {
    decoder: Decoder,
    pool: KvPool,
    comm: InProcess,
}

pub struct CpuTensorParallel {
    ranks: Vec<Rank>,
}

impl CpuTensorParallel {
    /// `decoder` split over `world` ranks, each with a pool of `num_blocks` blocks of
    /// `block_size` positions for its KV heads; refused when the model does not split.
    pub fn new(
        decoder: &Decoder,
        world: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> Result<CpuTensorParallel, ParallelError> {
        plan::check(decoder, world)?;
        let ranks = InProcess::group(world)
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                let decoder = plan::shard(decoder, world, rank)?;
                let pool = decoder.new_pool(num_blocks, block_size);
                Ok(Rank {
                    decoder,
                    pool,
                    comm,
                })
            })
            .collect::<Result<_, ParallelError>>()?;
        Ok(CpuTensorParallel { ranks })
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    pub fn num_blocks(&self) -> usize {
        self.ranks[0].pool.num_blocks
    }

    pub fn block_size(&self) -> usize {
        self.ranks[0].pool.block_size
    }

    /// Bytes of every rank's pool together.
    pub fn pool_bytes(&self) -> usize {
        self.ranks.iter().map(|r| r.pool.bytes()).sum()
    }

    /// [`Decoder::forward_batch`] over the ranks: each runs the batch on its share, the
    /// logits come back whole (rank 0's copy; every rank gathers the same). A rank that
    /// fails or panics breaks the group, so the others stop at their next exchange instead
    /// of waiting for it; the step fails (as a panicking backend's step does) and the group
    /// is mended for the next.
    pub fn forward_batch(&mut self, batch: &ForwardBatch) -> Result<Vec<f32>, ModelError> {
        let mut results = std::thread::scope(|s| {
            let handles: Vec<_> = self
                .ranks
                .iter_mut()
                .enumerate()
                .map(|(i, r)| s.spawn(move || r.run(i, batch)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("panics are caught in the rank"))
                .collect::<Vec<_>>()
        });
        if results.iter().any(|r| r.is_err()) {
            self.ranks[0].comm.reset();
            // The first rank's own failure, rather than another's report of it.
            let i = results
                .iter()
                .position(|r| matches!(r, Err(e) if !matches!(e, ModelError::Collective(CollectiveError::Aborted))))
                .unwrap_or(0);
            return results.swap_remove(i);
        }
        results.swap_remove(0)
    }
}

impl Rank {
    fn run(&mut self, index: usize, batch: &ForwardBatch) -> Result<Vec<f32>, ModelError> {
        let pass = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.decoder
                .forward_batch_rank(&mut self.pool, batch, Some(&self.comm))
        }));
        let result = pass.unwrap_or_else(|_| {
            Err(ModelError::Invalid(format!(
                "tensor-parallel rank {index} panicked"
            )))
        });
        if result.is_err() {
            self.comm.abort();
        }
        result
    }
}
