//! The CPU backend as a batch runner: the model's forward over an f32 paged pool, whole or
//! split over in-process tensor-parallel ranks.

use std::sync::Arc;

use super::BatchRunner;
use crate::backend::cpu::kv::KvPool;
use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::constraint::apply_mask;
use crate::models::Model;
use crate::parallel::{CpuTensorParallel, ParallelError};
use crate::sampler::argmax;

pub struct CpuBatchRunner {
    model: Arc<Model>,
    backend: Backend,
}

enum Backend {
    Whole(KvPool),
    Ranks(CpuTensorParallel),
}

impl CpuBatchRunner {
    /// A pool of at least `kv_tokens` positions in blocks of `block_size`.
    pub fn new(model: Arc<Model>, kv_tokens: usize, block_size: usize) -> CpuBatchRunner {
        let blocks = kv_tokens.div_ceil(block_size).max(1);
        let pool = model.decoder.new_pool(blocks, block_size);
        CpuBatchRunner {
            model,
            backend: Backend::Whole(pool),
        }
    }

    /// The model split over `world` tensor-parallel ranks on threads (`world` 1 too: the
    /// same path with no one to exchange with), each rank's pool `kv_tokens` positions of
    /// its KV heads.
    pub fn tensor_parallel(
        model: Arc<Model>,
        world: usize,
        kv_tokens: usize,
        block_size: usize,
    ) -> Result<CpuBatchRunner, ParallelError> {
        let blocks = kv_tokens.div_ceil(block_size).max(1);
        let tp = CpuTensorParallel::new(&model.decoder, world, blocks, block_size)?;
        Ok(CpuBatchRunner {
            model,
            backend: Backend::Ranks(tp),
        })
    }
}

impl BatchRunner for CpuBatchRunner {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        picks: &mut [RowPick],
    ) -> Result<Vec<RowOut>, String> {
        let logits = match &mut self.backend {
            Backend::Whole(pool) => self.model.decoder.forward_batch(pool, batch),
            Backend::Ranks(tp) => tp.forward_batch(batch),
        }
        .map_err(|e| e.to_string())?;
        let (nv, e) = (self.model.decoder.hp.n_vocab, self.model.decoder.hp.n_embd);
        let (logits, hidden) = logits.split_at(batch.logit_rows.len() * nv);
        let mut out: Vec<RowOut> = logits
            .chunks_exact(nv)
            .zip(picks.iter_mut())
            .map(|(row, pick)| match pick {
                RowPick::Greedy => RowOut::Token(argmax(row)),
                RowPick::Sample(s) => RowOut::Token(s.sample(row)),
                RowPick::Masked(s, slot) => match slot.wait() {
                    Some(mask) => {
                        let mut row = row.to_vec();
                        apply_mask(&mut row, mask);
                        RowOut::Token(s.sample(&row))
                    }
                    None => RowOut::Logits(row.to_vec()),
                },
                RowPick::Logits => RowOut::Logits(row.to_vec()),
            })
            .collect();
        out.extend(hidden.chunks_exact(e).map(|h| RowOut::Hidden(h.to_vec())));
        Ok(out)
    }

    fn num_blocks(&self) -> usize {
        match &self.backend {
            Backend::Whole(pool) => pool.num_blocks,
            Backend::Ranks(tp) => tp.num_blocks(),
        }
    }

    fn block_size(&self) -> usize {
        match &self.backend {
            Backend::Whole(pool) => pool.block_size,
            Backend::Ranks(tp) => tp.block_size(),
        }
    }

    fn describe(&self) -> String {
        let (ranks, bytes) = match &self.backend {
            Backend::Whole(pool) => (String::new(), pool.bytes()),
            Backend::Ranks(tp) => (
                format!(", split over {} tensor-parallel ranks", tp.world_size()),
                tp.pool_bytes(),
            ),
        };
        format!(
            "KV pool: {} tokens in {} blocks of {} (f32, {:.0} MiB, CPU{ranks})",
            self.num_blocks() * self.block_size(),
            self.num_blocks(),
            self.block_size(),
            bytes as f64 / (1 << 20) as f64
        )
    }
}
