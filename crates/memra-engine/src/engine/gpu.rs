//! The CUDA backend as a batch runner: the GPU decoder over its paged f16 pool, sampling
//! on the device.

use super::BatchRunner;
use crate::backend::cuda::decoder::GpuDecoder;
use crate::batch::{ForwardBatch, RowOut, RowPick};

pub struct GpuBatchRunner {
    gpu: GpuDecoder,
    /// The engine thread has made the decoder's context current.
    bound: bool,
}

impl GpuBatchRunner {
    pub fn new(gpu: GpuDecoder) -> GpuBatchRunner {
        GpuBatchRunner { gpu, bound: false }
    }
}

impl BatchRunner for GpuBatchRunner {
    fn forward(
        &mut self,
        batch: &ForwardBatch,
        picks: &mut [RowPick],
    ) -> Result<Vec<RowOut>, String> {
        if !batch.hidden_rows.is_empty() {
            // The GPU's prompt path norms into f16 buffers fused with the residual add;
            // returning those rows is not written yet (docs/server.md, "Embeddings").
            return Err("embeddings are computed on the CPU only (--device cpu)".into());
        }
        if !self.bound {
            self.gpu.bind_to_thread().map_err(|e| e.to_string())?;
            self.bound = true;
        }
        self.gpu
            .forward_step(batch, picks)
            .map_err(|e| e.to_string())
    }

    fn num_blocks(&self) -> usize {
        self.gpu.num_blocks()
    }

    fn block_size(&self) -> usize {
        self.gpu.block_size()
    }

    fn computes_hidden(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        format!(
            "KV pool: {} tokens in {} blocks of {} (GPU); {}",
            self.gpu.num_blocks() * self.gpu.block_size(),
            self.gpu.num_blocks(),
            self.gpu.block_size(),
            self.gpu.memory_report()
        )
    }
}
