//! The CPU's paged KV pool: per layer, `num_blocks x block_size` slots of keys and of
//! values (f32), addressed by the slots of a `ForwardBatch`.

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
