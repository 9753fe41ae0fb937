//! The paged KV cache's bookkeeping: blocks, their holders and the prefix cache. The
//! storage itself belongs to each backend (a pool of `num_blocks x block_size` positions per
//! layer); this side never touches it.

pub mod blocks;

pub use blocks::{block_hash, BlockId, BlockManager};

/// Positions per KV block (vLLM's default): small enough that a prefix is shared to within
/// 15 tokens and a sequence wastes at most 15 positions, large enough that block tables
/// stay short.
pub const DEFAULT_BLOCK_SIZE: usize = 16;
