//! The CPU backend as a batch runner: the model's forward over an f32 paged pool.

use std::sync::Arc;

use super::BatchRunner;
use crate::backend::cpu::kv::KvPool;
use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::constraint::apply_mask;
use crate::models::Model;
use crate::sampler::argmax;

pub struct CpuBatchRunner {
    model: Arc<Model>,
    pool: KvPool,
}

impl CpuBatchRunner {
    /// A pool of at least `kv_tokens` positions in blocks of `block_size`.
    pub fn new(model: Arc<Model>, kv_tokens: usize, block_size: usize) -> CpuBatchRunner {
        let blocks = kv_tokens.div_ceil(block_size).max(1);
        let pool = model.decoder.new_pool(blocks, block_size);
        CpuBatchRunner { model, pool }
    }
}

impl BatchRunner for CpuBatchRunner {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        picks: &mut [RowPick],
    ) -> Result<Vec<RowOut>, String> {
        let logits = self
            .model
            .decoder
            .forward_batch(&mut self.pool, batch)
            .map_err(|e| e.to_string())?;
        let nv = self.model.decoder.hp.n_vocab;
        Ok(logits
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
            .collect())
    }

    fn num_blocks(&self) -> usize {
        self.pool.num_blocks
    }

    fn block_size(&self) -> usize {
        self.pool.block_size
    }

    fn describe(&self) -> String {
        format!(
            "KV pool: {} tokens in {} blocks of {} (f32, {:.0} MiB, CPU)",
            self.pool.num_blocks * self.pool.block_size,
            self.pool.num_blocks,
            self.pool.block_size,
            self.pool.bytes() as f64 / (1 << 20) as f64
        )
    }
}
