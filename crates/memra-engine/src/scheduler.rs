//! The scheduler: which tokens of which sequences the next forward pass computes.
//!
//! Each sequence counts its computed tokens (`num_computed`); a step spends a token budget
//! first on running sequences that decode (one token each), then on running sequences with
//! prompt left to compute (chunked prefill: a long prompt takes what is left of the budget
//! each step, so it never stalls the decodes), then admits waiting sequences while fewer
//! than `max_running` run, taking the longest cached prefix of each first. While some
//! sequence decodes, a step computes at most `prompt_chunk` prompt tokens: the decodes read
//! the weights anyway, so small chunks cost them little and waiting prompts get their first
//! token sooner than in a few large steps (docs/engine.md has the measurement). When the pool
//! has no block for a running sequence, the most recently admitted one is preempted: its
//! blocks go back (their prefixes stay cached) and it waits at the front of the queue to be
//! recomputed, prompt and output alike; nothing is dropped. A waiting sequence whose next
//! prompt block a running sequence is computing right now waits for it (one step, usually)
//! instead of computing it a second time: sequences sent together with a shared prefix
//! compute it once. Plain CPU code: it never touches a device.

use std::collections::{HashMap, VecDeque};

use crate::kv::{block_hash, BlockId, BlockManager};

pub type SeqId = u64;

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences running at once at most (`--parallel`).
    pub max_running: usize,
    /// Tokens computed per step at most.
    pub token_budget: usize,
    /// Prompt tokens computed per step at most while a sequence decodes.
    pub prompt_chunk: usize,
}

impl Default for SchedulerConfig {
    fn default() -> SchedulerConfig {
        SchedulerConfig {
            max_running: 64,
            token_budget: 2048,
            prompt_chunk: 512,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// The prompt, then the generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose keys and values are in the sequence's blocks.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Hashes of the leading full computed blocks (the chain the next one extends).
    block_hashes: Vec<u64>,
    /// Hashes of the full prompt blocks it has yet to compute (while it runs).
    inflight: Vec<u64>,
    /// Prompt tokens found in the prefix cache at the first admission.
    pub cached_tokens: Option<usize>,
    /// Whether to look the sequence up in the prefix cache (off for prompt scoring,
    /// which needs every position's logits).
    pub use_prefix_cache: bool,
    pub preemptions: usize,
    /// Drafted tokens at the end of `tokens` (speculative decoding), not yet verified:
    /// computed with the sequence's last token, never cached.
    pub draft: usize,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>) -> Sequence {
        Sequence {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            blocks: Vec::new(),
            block_hashes: Vec::new(),
            inflight: Vec::new(),
            cached_tokens: None,
            use_prefix_cache: true,
            preemptions: 0,
            draft: 0,
        }
    }

    pub fn remaining(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Whether only its last token (and its drafts) is left to compute: it generates.
    fn decodes(&self) -> bool {
        self.remaining() == 1 + self.draft
    }
}

/// Tokens `start..start + n` of sequence `id` go into the step; `logits` when the last of
/// them is the sequence's last token (its next token gets sampled).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub n: usize,
    pub logits: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Step {
    pub seqs: Vec<Scheduled>,
    /// Sequences preempted while planning this step (they wait to be recomputed).
    pub preempted: Vec<SeqId>,
}

impl Step {
    pub fn n_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }
}

pub struct Scheduler {
    pub config: SchedulerConfig,
    pub blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    /// In admission order: the last is the first to be preempted.
    running: Vec<Sequence>,
    /// Full prompt blocks running sequences are computing, by prefix hash.
    inflight: HashMap<u64, SeqId>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, blocks: BlockManager) -> Scheduler {
        assert!(config.max_running > 0 && config.token_budget > 0 && config.prompt_chunk > 0);
        Scheduler {
            config,
            blocks,
            waiting: VecDeque::new(),
            running: Vec::new(),
            inflight: HashMap::new(),
        }
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Whether sequence `id` runs (holds blocks), rather than waits.
    pub fn is_running(&self, id: SeqId) -> bool {
        self.running.iter().any(|s| s.id == id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// The running or waiting sequence `id`.
    pub fn get(&self, id: SeqId) -> Option<&Sequence> {
        self.running
            .iter()
            .chain(self.waiting.iter())
            .find(|s| s.id == id)
    }

    fn running_mut(&mut self, id: SeqId) -> &mut Sequence {
        self.running
            .iter_mut()
            .find(|s| s.id == id)
            .expect("scheduled sequences run")
    }

    /// Gives every block of `seq` back (last first, so the pool reuses a sequence's tail
    /// before its head) and rewinds it to be recomputed.
    fn free_blocks(
        blocks: &mut BlockManager,
        inflight: &mut HashMap<u64, SeqId>,
        seq: &mut Sequence,
    ) {
        for h in seq.inflight.drain(..) {
            if inflight.get(&h) == Some(&seq.id) {
                inflight.remove(&h);
            }
        }
        for &b in seq.blocks.iter().rev() {
            blocks.release(b);
        }
        seq.blocks.clear();
        seq.block_hashes.clear();
        seq.num_computed = 0;
        // A recomputed sequence starts from what it had verified.
        seq.tokens.truncate(seq.tokens.len() - seq.draft);
        seq.draft = 0;
    }

    /// Takes blocks so that `seq` holds `n` positions; false (nothing taken) when the pool
    /// has too few.
    fn grow(blocks: &mut BlockManager, seq: &mut Sequence, n: usize) -> bool {
        let need = n
            .div_ceil(blocks.block_size())
            .saturating_sub(seq.blocks.len());
        if need > blocks.num_free() {
            return false;
        }
        for _ in 0..need {
            seq.blocks.push(blocks.allocate().expect("counted free"));
        }
        true
    }

    /// Takes the longest cached prefix of a waiting sequence: full blocks only, and never
    /// its last token, whose logits the step must compute.
    fn take_prefix(&mut self, seq: &mut Sequence) {
        let bs = self.blocks.block_size();
        let max_blocks = (seq.tokens.len() - 1) / bs;
        let mut parent = None;
        for i in 0..max_blocks {
            let Some((b, h)) = self
                .blocks
                .lookup(parent, &seq.tokens[i * bs..(i + 1) * bs])
            else {
                break;
            };
            self.blocks.take_cached(b);
            seq.blocks.push(b);
            seq.block_hashes.push(h);
            parent = Some(h);
        }
        seq.num_computed = seq.blocks.len() * bs;
    }

    /// Hashes of the full prompt blocks `seq` has yet to compute.
    fn future_blocks(&self, seq: &Sequence) -> Vec<u64> {
        let bs = self.blocks.block_size();
        let mut parent = seq.block_hashes.last().copied();
        (seq.block_hashes.len()..seq.prompt_len / bs)
            .map(|i| {
                let h = block_hash(parent, &seq.tokens[i * bs..(i + 1) * bs]);
                parent = Some(h);
                h
            })
            .collect()
    }

    /// Plans the next step. Sequences it schedules stay planned until
    /// [`Scheduler::complete`] is called with the step.
    pub fn schedule(&mut self) -> Step {
        let mut step = Step::default();
        let mut budget = self.config.token_budget;
        // Prompt tokens (and tokens recomputed after a preemption) the step may still take.
        let mut prompt_left = if self.running.iter().any(Sequence::decodes) {
            self.config.prompt_chunk
        } else {
            usize::MAX
        };
        // Decodes first, then running prompts, each in admission order.
        let mut order: Vec<SeqId> = Vec::new();
        order.extend(
            self.running
                .iter()
                .filter(|s| s.remaining() == 1)
                .map(|s| s.id),
        );
        order.extend(
            self.running
                .iter()
                .filter(|s| s.remaining() > 1)
                .map(|s| s.id),
        );
        for id in order {
            if budget == 0 {
                break;
            }
            // Preempted while planning an earlier one.
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            let prompt = !self.running[i].decodes();
            if prompt && prompt_left == 0 {
                continue;
            }
            let mut n = self.running[i].remaining().min(budget);
            if prompt {
                n = n.min(prompt_left);
            }
            loop {
                let seq = &mut self.running[i];
                let target = seq.num_computed + n;
                if Self::grow(&mut self.blocks, seq, target) {
                    step.seqs.push(Scheduled {
                        id,
                        start: seq.num_computed,
                        n,
                        logits: target == seq.tokens.len(),
                    });
                    budget -= n;
                    if prompt {
                        prompt_left -= n;
                    }
                    break;
                }
                // Drafts never preempt anyone: without room for them, the sequence drops
                // them and decodes its one token.
                if seq.draft > 0 {
                    seq.tokens.truncate(seq.tokens.len() - seq.draft);
                    seq.draft = 0;
                    n = 1;
                    continue;
                }
                // Out of blocks: preempt the most recently admitted, maybe this one.
                let mut victim = self.running.pop().expect("this one runs");
                if let Some(at) = step.seqs.iter().position(|s| s.id == victim.id) {
                    let n = step.seqs.remove(at).n;
                    budget += n;
                    if !victim.decodes() {
                        prompt_left = prompt_left.saturating_add(n);
                    }
                }
                Self::free_blocks(&mut self.blocks, &mut self.inflight, &mut victim);
                victim.preemptions += 1;
                step.preempted.push(victim.id);
                self.waiting.push_front(victim);
                if self.running.len() == i {
                    break;
                }
            }
        }
        // Admit waiting sequences (not in a step that had to preempt: blocks are short).
        while budget > 0
            && prompt_left > 0
            && step.preempted.is_empty()
            && self.running.len() < self.config.max_running
        {
            let Some(mut seq) = self.waiting.pop_front() else {
                break;
            };
            if seq.use_prefix_cache {
                self.take_prefix(&mut seq);
                let future = self.future_blocks(&seq);
                if future
                    .first()
                    .is_some_and(|h| self.inflight.contains_key(h))
                {
                    // Another sequence computes this block now: take it from the cache
                    // once it is done.
                    Self::free_blocks(&mut self.blocks, &mut self.inflight, &mut seq);
                    self.waiting.push_front(seq);
                    break;
                }
                seq.inflight = future;
            }
            let n = seq.remaining().min(budget).min(prompt_left);
            let target = seq.num_computed + n;
            if !Self::grow(&mut self.blocks, &mut seq, target) {
                Self::free_blocks(&mut self.blocks, &mut self.inflight, &mut seq);
                self.waiting.push_front(seq);
                break;
            }
            seq.cached_tokens.get_or_insert(seq.num_computed);
            for &h in &seq.inflight {
                self.inflight.entry(h).or_insert(seq.id);
            }
            step.seqs.push(Scheduled {
                id: seq.id,
                start: seq.num_computed,
                n,
                logits: target == seq.tokens.len(),
            });
            budget -= n;
            prompt_left -= n;
            self.running.push(seq);
        }
        step
    }

    /// Records that `step` ran: its tokens are computed, and full blocks join the prefix
    /// cache.
    pub fn complete(&mut self, step: &Step) {
        let bs = self.blocks.block_size();
        for s in &step.seqs {
            let i = self
                .running
                .iter()
                .position(|q| q.id == s.id)
                .expect("scheduled sequences run");
            let seq = &mut self.running[i];
            debug_assert_eq!(seq.num_computed, s.start);
            seq.num_computed += s.n;
            Self::register_full(&mut self.blocks, &mut self.inflight, seq, bs);
        }
    }

    /// Puts the full blocks of `seq`'s computed and verified tokens in the prefix cache.
    fn register_full(
        blocks: &mut BlockManager,
        inflight: &mut HashMap<u64, SeqId>,
        seq: &mut Sequence,
        bs: usize,
    ) {
        let verified = seq.num_computed.min(seq.tokens.len() - seq.draft);
        while (seq.block_hashes.len() + 1) * bs <= verified {
            let j = seq.block_hashes.len();
            let parent = seq.block_hashes.last().copied();
            let h = blocks.register(seq.blocks[j], parent, &seq.tokens[j * bs..(j + 1) * bs]);
            seq.block_hashes.push(h);
            if let Some(at) = seq.inflight.iter().position(|&f| f == h) {
                seq.inflight.remove(at);
                if inflight.get(&h) == Some(&seq.id) {
                    inflight.remove(&h);
                }
            }
        }
    }

    /// Appends a sampled token to running sequence `id` (computed by a later step).
    pub fn append(&mut self, id: SeqId, token: u32) {
        self.running_mut(id).tokens.push(token);
    }

    /// Appends drafted tokens to running sequence `id`, which decodes (its last token is
    /// the only one left to compute): the next step computes them with it, like a prompt
    /// chunk, and [`Scheduler::settle_draft`] keeps the ones verified.
    pub fn add_draft(&mut self, id: SeqId, draft: &[u32]) {
        let seq = self.running_mut(id);
        debug_assert!(seq.draft == 0 && seq.remaining() == 1);
        seq.tokens.extend_from_slice(draft);
        seq.draft = draft.len();
    }

    /// Keeps the first `accepted` drafted tokens of sequence `id` and drops the others:
    /// their positions are computed again when the sequence gets there (the blocks that
    /// held only them go back to the pool; none of them was cached).
    pub fn settle_draft(&mut self, id: SeqId, accepted: usize) {
        let bs = self.blocks.block_size();
        let Some(i) = self.running.iter().position(|s| s.id == id) else {
            return; // preempted: free_blocks dropped the drafts
        };
        let seq = &mut self.running[i];
        let keep = seq.tokens.len() - seq.draft + accepted.min(seq.draft);
        seq.tokens.truncate(keep);
        seq.draft = 0;
        seq.num_computed = seq.num_computed.min(keep);
        while seq.blocks.len() > keep.div_ceil(bs).max(seq.block_hashes.len()) {
            let b = seq.blocks.pop().expect("more blocks than kept");
            self.blocks.release(b);
        }
        Self::register_full(&mut self.blocks, &mut self.inflight, seq, bs);
    }

    /// Removes sequence `id`, running or waiting, giving its blocks back (their prefixes
    /// stay cached); returns it, or `None` if there is no such sequence.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let mut seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i).expect("found")
        };
        Self::free_blocks(&mut self.blocks, &mut self.inflight, &mut seq);
        Some(seq)
    }

    /// Checks (tests) that the blocks held by sequences are exactly the blocks with a
    /// non-zero ref count, each counted once per holder.
    pub fn check(&self) -> Result<(), String> {
        self.blocks.check()?;
        let mut holders = vec![0u32; self.blocks.num_blocks()];
        for s in self.running.iter().chain(self.waiting.iter()) {
            for &b in &s.blocks {
                holders[b as usize] += 1;
            }
            if s.blocks.len() * self.blocks.block_size() < s.num_computed {
                return Err(format!("sequence {} computed past its blocks", s.id));
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            if h != self.blocks.ref_count(b as BlockId) {
                return Err(format!(
                    "block {b}: {h} holders, ref count {}",
                    self.blocks.ref_count(b as BlockId)
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 64 blocks of 4 positions, up to 8 sequences, the budget and the prompt chunk given.
    fn chunked(budget: usize, prompt_chunk: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_running: 8,
                token_budget: budget,
                prompt_chunk,
            },
            BlockManager::new(64, 4),
        )
    }

    /// A step's (id, start, n) entries.
    fn plan(st: Step) -> Vec<(SeqId, usize, usize)> {
        st.seqs.iter().map(|q| (q.id, q.start, q.n)).collect()
    }

    fn sched(blocks: usize, bs: usize, max_running: usize, budget: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_running,
                token_budget: budget,
                prompt_chunk: budget,
            },
            BlockManager::new(blocks, bs),
        )
    }

    /// Runs a step, then appends token `next` to each sequence that gets logits.
    fn step(s: &mut Scheduler, next: u32) -> Step {
        let st = s.schedule();
        s.complete(&st);
        for q in st.seqs.iter().filter(|q| q.logits) {
            s.append(q.id, next);
        }
        s.check().unwrap();
        st
    }

    #[test]
    fn decodes_go_first_and_a_long_prompt_is_chunked_by_the_budget() {
        let mut s = sched(64, 4, 8, 10);
        s.add(Sequence::new(1, vec![1; 3]));
        let st = step(&mut s, 7);
        assert_eq!(
            st.seqs,
            [Scheduled {
                id: 1,
                start: 0,
                n: 3,
                logits: true
            }]
        );
        s.add(Sequence::new(2, vec![2; 25]));
        // Sequence 1 decodes (1 token), sequence 2 takes the other 9 of the budget.
        let st = step(&mut s, 7);
        assert_eq!(st.seqs[0].id, 1);
        assert_eq!((st.seqs[0].n, st.seqs[0].logits), (1, true));
        assert_eq!((st.seqs[1].id, st.seqs[1].n), (2, 9));
        assert!(!st.seqs[1].logits);
        let st = step(&mut s, 7);
        assert_eq!(st.seqs[0].id, 1, "the decode still goes first");
        assert_eq!((st.seqs[1].start, st.seqs[1].n), (9, 9));
        let st = step(&mut s, 7);
        assert_eq!(
            (st.seqs[1].start, st.seqs[1].n, st.seqs[1].logits),
            (18, 7, true)
        );
        assert_eq!(st.n_tokens(), 8);
        assert_eq!(s.get(2).unwrap().tokens.len(), 26);
    }

    #[test]
    fn prompts_take_the_chunk_beside_decodes_and_the_budget_alone() {
        let mut s = chunked(40, 6);
        // Nothing decodes: two prompts share the whole budget.
        s.add(Sequence::new(1, vec![1; 30]));
        s.add(Sequence::new(2, vec![2; 30]));
        let st = step(&mut s, 7);
        assert_eq!(
            st.seqs.iter().map(|q| (q.id, q.n)).collect::<Vec<_>>(),
            [(1, 30), (2, 10)]
        );
        // Sequence 1 decodes: sequence 2's prompt goes on 6 tokens a step, and a new one
        // waits for the chunk to have room.
        s.add(Sequence::new(3, vec![3; 5]));
        assert_eq!(plan(step(&mut s, 7)), [(1, 30, 1), (2, 10, 6)]);
        assert_eq!(plan(step(&mut s, 7)), [(1, 31, 1), (2, 16, 6)]);
        assert_eq!(plan(step(&mut s, 7)), [(1, 32, 1), (2, 22, 6)]);
        // Sequence 2's last 2 prompt tokens leave 4 of the chunk to sequence 3.
        assert_eq!(plan(step(&mut s, 7)), [(1, 33, 1), (2, 28, 2), (3, 0, 4)]);
        assert_eq!(plan(step(&mut s, 7)), [(1, 34, 1), (2, 30, 1), (3, 4, 1)]);
        assert_eq!(s.get(3).unwrap().tokens.len(), 6);
    }

    #[test]
    fn prompts_go_on_when_more_sequences_decode_than_the_chunk() {
        let mut s = chunked(100, 2);
        for id in 0..4 {
            s.add(Sequence::new(id, vec![1; 2]));
        }
        step(&mut s, 7);
        s.add(Sequence::new(9, vec![9; 5]));
        for start in [0, 2, 4] {
            let st = step(&mut s, 7);
            // Four decodes, then the prompt's chunk of at most 2.
            assert_eq!(st.seqs.len(), 5);
            assert_eq!((st.seqs[4].id, st.seqs[4].start), (9, start));
            assert_eq!(st.seqs[4].n, 2.min(5 - start));
        }
        assert!(s.get(9).unwrap().decodes());
    }

    #[test]
    fn the_running_cap_holds_sequences_back() {
        let mut s = sched(64, 4, 2, 100);
        for id in 0..3 {
            s.add(Sequence::new(id, vec![1, 2, 3]));
        }
        let st = step(&mut s, 9);
        assert_eq!(st.seqs.len(), 2);
        assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
        s.remove(0).unwrap();
        let st = step(&mut s, 9);
        assert_eq!(st.seqs.iter().map(|q| q.id).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let mut s = sched(64, 4, 8, 100);
        let prompt: Vec<u32> = (0..10).collect();
        s.add(Sequence::new(1, prompt.clone()));
        step(&mut s, 50);
        // Two full blocks of sequence 1 are cached; the second sequence shares them.
        let mut other = prompt[..8].to_vec();
        other.extend([99, 98, 97]);
        s.add(Sequence::new(2, other));
        let st = step(&mut s, 50);
        let q2 = st.seqs.iter().find(|q| q.id == 2).unwrap();
        assert_eq!((q2.start, q2.n), (8, 3));
        assert_eq!(s.get(2).unwrap().cached_tokens, Some(8));
        let (a, b) = (&s.get(1).unwrap().blocks, &s.get(2).unwrap().blocks);
        assert_eq!(a[..2], b[..2]);
        assert_ne!(a[2], b[2]);
        assert_eq!(s.blocks.ref_count(a[0]), 2);
        // A finished sequence's blocks stay cached: the same prompt again hits them all
        // but the block holding its last token.
        s.remove(1).unwrap();
        s.remove(2).unwrap();
        assert_eq!(s.blocks.num_free(), 64);
        s.add(Sequence::new(3, prompt.clone()));
        let st = step(&mut s, 50);
        assert_eq!((st.seqs[0].start, st.seqs[0].n), (8, 2));
        // A prompt of exactly two blocks recomputes its last block for the last logits.
        s.add(Sequence::new(4, prompt[..8].to_vec()));
        let st = step(&mut s, 50);
        let q4 = st.seqs.iter().find(|q| q.id == 4).unwrap();
        assert_eq!((q4.start, q4.n), (4, 4));
    }

    #[test]
    fn sequences_sent_together_compute_a_shared_prefix_once() {
        let mut s = sched(64, 4, 8, 100);
        let prefix: Vec<u32> = (0..8).collect();
        for id in 0..3u64 {
            let mut p = prefix.clone();
            p.extend([100 + id as u32, 7]);
            s.add(Sequence::new(id, p));
        }
        let st = step(&mut s, 1);
        assert_eq!(st.seqs.len(), 1, "the others wait for the shared blocks");
        let st = step(&mut s, 1);
        let plan: Vec<_> = st.seqs.iter().map(|q| (q.id, q.start, q.n)).collect();
        assert_eq!(plan, [(0, 10, 1), (1, 8, 2), (2, 8, 2)]);
        assert_eq!(s.get(2).unwrap().cached_tokens, Some(8));
        assert_eq!(s.get(0).unwrap().cached_tokens, Some(0));
    }

    #[test]
    fn a_full_pool_preempts_the_newest_and_it_comes_back() {
        // 4 blocks of 2: two sequences of 3 prompt tokens hold 2 blocks each.
        let mut s = sched(4, 2, 8, 100);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        s.add(Sequence::new(2, vec![4, 5, 6]));
        step(&mut s, 0);
        assert_eq!(s.blocks.num_free(), 0);
        // Each now needs its 4th position: both fit (3 -> 4 tokens stay in 2 blocks).
        let st = step(&mut s, 0);
        assert_eq!(st.seqs.len(), 2);
        // The 5th position needs a third block: sequence 2 (newest) is preempted.
        let st = step(&mut s, 0);
        assert_eq!(st.preempted, [2]);
        assert_eq!(st.seqs.iter().map(|q| q.id).collect::<Vec<_>>(), [1]);
        let seq2 = s.get(2).unwrap();
        assert_eq!((seq2.num_computed, seq2.tokens.len()), (0, 5));
        assert!(seq2.blocks.is_empty());
        // When sequence 1 finishes, sequence 2 is recomputed, prompt and output, reusing
        // its cached full blocks.
        s.remove(1).unwrap();
        let st = step(&mut s, 0);
        assert_eq!(st.seqs.len(), 1);
        assert_eq!(st.seqs[0].id, 2);
        assert_eq!(st.seqs[0].start + st.seqs[0].n, 5);
        assert!(st.seqs[0].logits);
        assert_eq!(s.get(2).unwrap().preemptions, 1);
    }

    #[test]
    fn a_sequence_that_preempts_itself_waits() {
        let mut s = sched(2, 2, 8, 100);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        step(&mut s, 0);
        step(&mut s, 0);
        // 5 positions need 3 blocks of the 2 there are: the sequence preempts itself and
        // waits (the engine refuses such requests before they start).
        let st = step(&mut s, 0);
        assert!(st.seqs.is_empty());
        assert_eq!(st.preempted, [1]);
        assert_eq!(s.blocks.num_free(), 2);
    }

    #[test]
    fn removing_gives_every_block_back() {
        let mut s = sched(16, 4, 8, 6);
        s.add(Sequence::new(1, (0..20).collect()));
        s.add(Sequence::new(2, (0..3).collect()));
        step(&mut s, 0);
        assert!(s.blocks.num_free() < 16);
        s.remove(1).unwrap();
        s.remove(2).unwrap();
        assert!(s.remove(2).is_none());
        assert!(s.is_idle());
        assert_eq!(s.blocks.num_free(), 16);
        s.check().unwrap();
    }

    /// Speculative drafts: computed with the last token in one step, the accepted ones
    /// kept, the others dropped with the blocks that held only them, none of them ever in
    /// the prefix cache.
    #[test]
    fn drafts_are_verified_settled_and_never_cached() {
        let mut s = sched(16, 2, 8, 100);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        step(&mut s, 4); // prompt done, token 4 appended
        s.add_draft(1, &[5, 6, 7, 8]);
        let st = s.schedule();
        assert_eq!(
            st.seqs,
            [Scheduled {
                id: 1,
                start: 3,
                n: 5,
                logits: true
            }]
        );
        s.complete(&st);
        s.check().unwrap();
        // Only 5 of the drafts were right: keep one.
        s.settle_draft(1, 1);
        let seq = s.get(1).unwrap();
        assert_eq!(seq.tokens, [1, 2, 3, 4, 5]);
        assert_eq!((seq.num_computed, seq.draft, seq.blocks.len()), (5, 0, 3));
        s.check().unwrap();
        s.append(1, 9);
        assert_eq!(
            s.schedule().seqs[0],
            Scheduled {
                id: 1,
                start: 5,
                n: 1,
                logits: true
            }
        );
        // Another sequence with the rejected drafts in its prompt finds only verified
        // blocks: [1, 2] and [3, 4] (and [5, 9] once computed), not [5, 6] or [7, 8].
        let mut s2 = sched(16, 2, 8, 100);
        s2.add(Sequence::new(1, vec![1, 2, 3]));
        step(&mut s2, 4);
        s2.add_draft(1, &[5, 6, 7, 8]);
        let st = s2.schedule();
        s2.complete(&st);
        s2.settle_draft(1, 0);
        s2.append(1, 9);
        step(&mut s2, 0);
        s2.add(Sequence::new(2, vec![1, 2, 3, 4, 5, 6, 7, 8, 0]));
        let st = s2.schedule();
        let new = st.seqs.iter().find(|q| q.id == 2).unwrap();
        assert_eq!(new.start, 4, "only the verified blocks are cached");
        s2.complete(&st);
        s2.check().unwrap();
    }

    /// Drafts without room in the pool are dropped, never a reason to preempt (here the
    /// sequence itself, or another); a settle after that keeps nothing more; chunked
    /// drafts (a budget smaller than the draft) keep what was computed.
    #[test]
    fn drafts_never_preempt_and_may_be_chunked() {
        let mut s = sched(3, 2, 8, 100);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        step(&mut s, 4);
        s.add_draft(1, &[5, 6, 7]);
        // 7 positions need 4 blocks of the 3 there are: the drafts go, the token decodes.
        let st = s.schedule();
        assert!(st.preempted.is_empty());
        assert_eq!(
            st.seqs,
            [Scheduled {
                id: 1,
                start: 3,
                n: 1,
                logits: true
            }]
        );
        s.complete(&st);
        s.settle_draft(1, 2);
        let seq = s.get(1).unwrap();
        assert_eq!((seq.tokens.as_slice(), seq.draft), (&[1, 2, 3, 4][..], 0));
        s.check().unwrap();
        // With another sequence admitted after it, a full pool: the drafts of the first go,
        // the other (the one a preemption would take) keeps its blocks.
        let mut s = sched(4, 2, 8, 100);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        s.add(Sequence::new(2, vec![9, 8, 7]));
        step(&mut s, 4);
        assert_eq!(s.blocks.num_free(), 0);
        s.add_draft(1, &[5, 6, 7, 8]);
        let st = s.schedule();
        assert!(st.preempted.is_empty(), "{st:?}");
        assert_eq!(
            st.seqs.iter().map(|q| q.n).collect::<Vec<_>>(),
            [1, 1],
            "{st:?}"
        );
        s.complete(&st);
        s.check().unwrap();

        let mut s = sched(16, 2, 8, 3);
        s.add(Sequence::new(1, vec![1, 2, 3]));
        step(&mut s, 4);
        s.add_draft(1, &[5, 6, 7]);
        let st = s.schedule();
        assert_eq!(
            st.seqs,
            [Scheduled {
                id: 1,
                start: 3,
                n: 3,
                logits: false
            }]
        );
        s.complete(&st);
        // Rows for 4, 5, 6 verify 5 and 6; 7 was not computed.
        s.settle_draft(1, 2);
        let seq = s.get(1).unwrap();
        assert_eq!((seq.tokens.len(), seq.num_computed), (6, 6));
        s.check().unwrap();
    }
}
