//! The CPU's paged KV pool: per layer, `num_blocks x block_size` slots of keys and of
//! values (f32), addressed by the slots of a `ForwardBatch`.

use crate::kv::BlockId;

pub struct KvPool {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Per layer, `slots x k_row` keys and `slots x v_row` values.
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    pub k_row: usize,
    pub v_row: usize,
}

impl KvPool {
    pub fn new(
        n_layer: usize,
        k_row: usize,
        v_row: usize,
        num_blocks: usize,
        block_size: usize,
    ) -> KvPool {
        let slots = num_blocks * block_size;
        KvPool {
            block_size,
            num_blocks,
            k: (0..n_layer).map(|_| vec![0.0; slots * k_row]).collect(),
            v: (0..n_layer).map(|_| vec![0.0; slots * v_row]).collect(),
            k_row,
            v_row,
        }
    }

    /// Bytes of one position in every layer.
    pub fn bytes_per_token(n_layer: usize, k_row: usize, v_row: usize) -> usize {
        n_layer * (k_row + v_row) * std::mem::size_of::<f32>()
    }

    pub fn bytes(&self) -> usize {
        self.num_blocks
            * self.block_size
            * Self::bytes_per_token(self.k.len(), self.k_row, self.v_row)
    }
}

/// Keys and values of one sequence's past positions: a paged pool whose blocks the
/// sequence holds in order, the one-sequence case of `Decoder::forward_batch`.
pub struct KvCache {
    pub(super) pool: KvPool,
    pub(super) blocks: Vec<BlockId>,
    pub(super) n_ctx: usize,
    pub(super) len: usize,
}

impl KvCache {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Forgets everything from position `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}
