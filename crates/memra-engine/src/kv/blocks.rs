//! The block manager: which KV blocks are free, who holds each one, and which full blocks
//! hold a known prefix (prefix caching, as vLLM does it).
//!
//! A block holds the keys and values of `block_size` consecutive positions of one sequence,
//! in every layer; sequences hold blocks by opaque ids through a block table. A full block
//! whose positions are computed gets a hash: its tokens chained with its parent block's
//! hash, so equal hashes mean equal prefixes. A block whose last holder lets it go keeps its
//! contents and hash and goes to the back of the free queue: a later prompt with the same
//! prefix takes it back (a hit) instead of recomputing it, and the pool reuses the least
//! recently freed blocks first.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};

/// A block of the KV pool.
pub type BlockId = u32;

/// End marker of the free queue's links.
const NIL: u32 = u32::MAX;

/// The prefix hash of a full block: `parent` (the previous block's hash, `None` for the
/// first block) chained with the block's tokens. `DefaultHasher::new()` has fixed keys, so
/// hashes are the same in every process.
pub fn block_hash(parent: Option<u64>, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What a cached block holds, to confirm a hash hit exactly (a 64-bit hash may collide).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Content {
    hash: u64,
    parent: Option<u64>,
    tokens: Vec<u32>,
}

pub struct BlockManager {
    block_size: usize,
    ref_count: Vec<u32>,
    /// Set on full computed blocks that are in `cached`.
    content: Vec<Option<Content>>,
    cached: HashMap<u64, BlockId>,
    /// Free blocks (ref count 0) in the order they are reused, oldest first: a doubly
    /// linked list over block ids, so a cached block that is hit leaves it in O(1).
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    n_free: usize,
    /// Blocks taken back from the cache, and cached blocks reused for other contents.
    pub hits: u64,
    pub evictions: u64,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize) -> BlockManager {
        assert!(block_size > 0 && num_blocks < NIL as usize);
        let mut m = BlockManager {
            block_size,
            ref_count: vec![0; num_blocks],
            content: vec![None; num_blocks],
            cached: HashMap::new(),
            prev: vec![NIL; num_blocks],
            next: vec![NIL; num_blocks],
            head: NIL,
            tail: NIL,
            n_free: 0,
            hits: 0,
            evictions: 0,
        };
        for b in 0..num_blocks as u32 {
            m.push_free(b);
        }
        m
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_count.len()
    }

    /// Blocks that can be handed out now (cached ones among them).
    pub fn num_free(&self) -> usize {
        self.n_free
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.ref_count[b as usize]
    }

    /// Blocks of cached prefixes.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    fn push_free(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = b;
        } else {
            self.next[self.tail as usize] = b;
        }
        self.tail = b;
        self.n_free += 1;
    }

    fn unlink_free(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.n_free -= 1;
    }

    /// A fresh block for the caller (ref count 1), evicting the cached prefix it held;
    /// `None` when every block is held.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = self.head;
        if b == NIL {
            return None;
        }
        self.unlink_free(b);
        if let Some(c) = self.content[b as usize].take() {
            self.cached.remove(&c.hash);
            self.evictions += 1;
        }
        self.ref_count[b as usize] = 1;
        Some(b)
    }

    /// The cached block holding the full block `tokens` after the prefix `parent`, if any,
    /// with its hash. It is not taken: see [`BlockManager::take_cached`].
    pub fn lookup(&self, parent: Option<u64>, tokens: &[u32]) -> Option<(BlockId, u64)> {
        debug_assert_eq!(tokens.len(), self.block_size);
        let hash = block_hash(parent, tokens);
        let &b = self.cached.get(&hash)?;
        let c = self.content[b as usize].as_ref()?;
        (c.parent == parent && c.tokens == tokens).then_some((b, hash))
    }

    /// Takes a hold on a cached block found by [`BlockManager::lookup`] (another sequence
    /// may hold it too).
    pub fn take_cached(&mut self, b: BlockId) {
        if self.ref_count[b as usize] == 0 {
            self.unlink_free(b);
        }
        self.ref_count[b as usize] += 1;
        self.hits += 1;
    }

    /// Records that full block `b`, held by the caller, now holds `tokens` after the prefix
    /// `parent`; returns its hash. Where another block already caches that prefix, `b`
    /// stays uncached (its contents are the same).
    pub fn register(&mut self, b: BlockId, parent: Option<u64>, tokens: &[u32]) -> u64 {
        debug_assert_eq!(tokens.len(), self.block_size);
        debug_assert!(self.ref_count[b as usize] > 0, "block {b} is not held");
        let hash = block_hash(parent, tokens);
        if self.content[b as usize].is_none() && !self.cached.contains_key(&hash) {
            self.cached.insert(hash, b);
            self.content[b as usize] = Some(Content {
                hash,
                parent,
                tokens: tokens.to_vec(),
            });
        }
        hash
    }

    /// Lets go of a hold on `b`; at the last one it becomes free, keeping any cached
    /// prefix until the block is reused.
    pub fn release(&mut self, b: BlockId) {
        let rc = &mut self.ref_count[b as usize];
        assert!(*rc > 0, "block {b} released more often than taken");
        *rc -= 1;
        if *rc == 0 {
            self.push_free(b);
        }
    }

    /// Checks the invariants (tests): every block free exactly when nobody holds it, the
    /// free count and links consistent, the cache index pointing at matching contents.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![false; self.num_blocks()];
        let (mut b, mut n, mut last) = (self.head, 0usize, NIL);
        while b != NIL {
            if seen[b as usize] {
                return Err(format!("block {b} twice in the free queue"));
            }
            seen[b as usize] = true;
            if self.prev[b as usize] != last {
                return Err(format!("block {b}: broken back link"));
            }
            last = b;
            b = self.next[b as usize];
            n += 1;
        }
        if last != self.tail || n != self.n_free {
            return Err(format!("free queue of {n} blocks, counted {}", self.n_free));
        }
        for (i, (&rc, &free)) in self.ref_count.iter().zip(&seen).enumerate() {
            if (rc == 0) != free {
                return Err(format!(
                    "block {i}: ref count {rc}, in the free queue: {free}"
                ));
            }
        }
        for (&h, &b) in &self.cached {
            if self.content[b as usize].as_ref().map(|c| c.hash) != Some(h) {
                return Err(format!(
                    "cache entry {h:x} points at block {b} of other contents"
                ));
            }
        }
        let with_content = self.content.iter().filter(|c| c.is_some()).count();
        if with_content != self.cached.len() {
            return Err("blocks with contents not in the cache index".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_handed_out_once_and_come_back() {
        let mut m = BlockManager::new(3, 4);
        let a: Vec<_> = (0..3).map(|_| m.allocate().unwrap()).collect();
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 1, 2]);
        assert_eq!(m.allocate(), None, "pool exhausted");
        assert_eq!(m.num_free(), 0);
        m.release(a[1]);
        assert_eq!(m.num_free(), 1);
        assert_eq!(m.allocate(), Some(a[1]));
        m.check().unwrap();
    }

    #[test]
    #[should_panic(expected = "released more often")]
    fn a_double_release_is_caught() {
        let mut m = BlockManager::new(2, 4);
        let b = m.allocate().unwrap();
        m.release(b);
        m.release(b);
    }

    #[test]
    fn a_cached_prefix_is_found_shared_and_evicted_last_freed_last() {
        let mut m = BlockManager::new(4, 2);
        let (t0, t1) = ([1, 2], [3, 4]);
        let (b0, b1) = (m.allocate().unwrap(), m.allocate().unwrap());
        let h0 = m.register(b0, None, &t0);
        let h1 = m.register(b1, Some(h0), &t1);
        assert_eq!(m.lookup(None, &t0), Some((b0, h0)));
        assert_eq!(m.lookup(Some(h0), &t1), Some((b1, h1)));
        // Same tokens after another prefix: no hit.
        assert_eq!(m.lookup(Some(h1), &t1), None);
        assert_eq!(m.lookup(None, &[9, 9]), None);
        // A second holder shares the block; it stays held after the first lets go.
        m.take_cached(b0);
        assert_eq!(m.ref_count(b0), 2);
        m.release(b0);
        m.release(b1);
        assert_eq!(m.ref_count(b0), 1);
        assert_eq!(m.num_free(), 3, "b1 free but still cached");
        assert_eq!(m.lookup(Some(h0), &t1), Some((b1, h1)));
        // Taking a free cached block back removes it from the free queue.
        m.take_cached(b1);
        assert_eq!(m.num_free(), 2);
        m.release(b1);
        m.release(b0);
        m.check().unwrap();
        // Fresh blocks first (never cached), then the least recently freed cached one.
        let order: Vec<_> = (0..4).map(|_| m.allocate().unwrap()).collect();
        assert_eq!(&order[2..], &[b1, b0]);
        assert_eq!(m.evictions, 2);
        assert_eq!(m.num_cached(), 0);
        assert_eq!(m.lookup(None, &t0), None, "evicted");
        m.check().unwrap();
    }

    #[test]
    fn a_duplicate_block_stays_uncached() {
        let mut m = BlockManager::new(2, 2);
        let (a, b) = (m.allocate().unwrap(), m.allocate().unwrap());
        let h = m.register(a, None, &[5, 6]);
        assert_eq!(m.register(b, None, &[5, 6]), h);
        assert_eq!(m.num_cached(), 1);
        assert_eq!(m.lookup(None, &[5, 6]), Some((a, h)));
        m.check().unwrap();
    }
}
