//! `ForwardBatch`: what one forward pass computes, for any number of sequences, each with
//! its own positions and KV blocks. The engine fills one per step from the scheduler's
//! plan; a backend reads it as it is (the GPU copies the arrays into device buffers of
//! fixed size, so a step of a given shape replays one graph).

use crate::constraint::MaskSlot;
use crate::kv::BlockId;
use crate::sampler::Sampler;

/// What a step does with the logits of one of its rows: sample the next token with the
/// sequence's sampler (a GPU does it on the device where it can, and only the id comes
/// back), or return the logits (log-probabilities, prompt scoring).
pub enum RowPick<'a> {
    /// The most likely token.
    Greedy,
    Sample(&'a mut Sampler),
    /// Sample among the tokens the mask allows only (a grammar's: bit `t % 32` of word
    /// `t / 32` set for an allowed token `t`, tokens past the mask not allowed): the other
    /// logits are minus infinity before the sampler sees them. The mask may still be being
    /// computed: wait for it only when picking the row; a mask that failed makes the row
    /// come back as logits.
    Masked(&'a mut Sampler, &'a MaskSlot),
    Logits,
}

/// A row's result, as its [`RowPick`] asked; or a hidden row's state
/// ([`ForwardBatch::hidden_rows`]).
#[derive(Clone, Debug, PartialEq)]
pub enum RowOut {
    Token(u32),
    Logits(Vec<f32>),
    /// The token's last hidden state after the output norm (`n_embd`), before the output
    /// projection: what embeddings pool.
    Hidden(Vec<f32>),
}

impl RowOut {
    /// The logits of a row that asked for them.
    pub fn into_logits(self) -> Vec<f32> {
        match self {
            RowOut::Logits(l) => l,
            RowOut::Token(_) | RowOut::Hidden(_) => panic!("a sampled or hidden row has no logits"),
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct ForwardBatch {
    pub block_size: usize,
    /// Token ids `[T]`, sequence after sequence.
    pub tokens: Vec<u32>,
    /// Position of each token in its sequence `[T]`.
    pub positions: Vec<u32>,
    /// KV slot each token writes `[T]`: `block * block_size + position % block_size`.
    pub slots: Vec<u32>,
    /// First token of each sequence, and the total, `[S + 1]`.
    pub query_start: Vec<u32>,
    /// Positions each sequence attends to after this step (cached and new) `[S]`.
    pub context_len: Vec<u32>,
    /// The blocks of every sequence, one after the other (`block_start[s]..block_start[s +
    /// 1]` are sequence `s`'s) `[S + 1]`.
    pub block_start: Vec<u32>,
    pub block_tables: Vec<BlockId>,
    /// Tokens whose logits the step returns, in order `[R]`.
    pub logit_rows: Vec<u32>,
    /// Tokens whose hidden state after the output norm the step returns, after the logit
    /// rows' results, in order `[H]` (embeddings).
    pub hidden_rows: Vec<u32>,
    /// Sequences of a few tokens that a backend may compute as decodes, each token a row
    /// at its own position (the GPU does while the rows fit its mat-vec kernels): a
    /// speculative verify step (the last token and its drafts), a draft model catching up
    /// with the tokens verified since its last step.
    pub as_decodes: Vec<usize>,
}

impl ForwardBatch {
    pub fn new(block_size: usize) -> ForwardBatch {
        ForwardBatch {
            block_size,
            query_start: vec![0],
            block_start: vec![0],
            ..ForwardBatch::default()
        }
    }

    /// A sequence's tokens at positions `start..start + tokens.len()`, its blocks (covering
    /// every position up to the last new one), and which of the new tokens (by index among
    /// them) need logits.
    pub fn push(
        &mut self,
        tokens: &[u32],
        start: usize,
        blocks: &[BlockId],
        logits: impl IntoIterator<Item = usize>,
    ) {
        let bs = self.block_size;
        let end = start + tokens.len();
        assert!(
            !tokens.is_empty() && blocks.len() * bs >= end,
            "{} blocks of {bs} cannot hold {end} positions",
            blocks.len()
        );
        let t0 = self.tokens.len() as u32;
        for (i, &t) in tokens.iter().enumerate() {
            let p = start + i;
            self.tokens.push(t);
            self.positions.push(p as u32);
            self.slots
                .push(blocks[p / bs] * bs as u32 + (p % bs) as u32);
        }
        for i in logits {
            assert!(i < tokens.len());
            self.logit_rows.push(t0 + i as u32);
        }
        self.query_start.push(self.tokens.len() as u32);
        self.context_len.push(end as u32);
        self.block_tables.extend_from_slice(blocks);
        self.block_start.push(self.block_tables.len() as u32);
    }

    pub fn n_tokens(&self) -> usize {
        self.tokens.len()
    }

    pub fn n_seqs(&self) -> usize {
        self.context_len.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Sequence `s`'s tokens (indices into the batch).
    pub fn seq_tokens(&self, s: usize) -> std::ops::Range<usize> {
        self.query_start[s] as usize..self.query_start[s + 1] as usize
    }

    /// Also returns the hidden states of the last sequence pushed at these of its new
    /// tokens (by index among them).
    pub fn push_hidden(&mut self, rows: impl IntoIterator<Item = usize>) {
        let s = self.n_seqs() - 1;
        let r = self.seq_tokens(s);
        for i in rows {
            assert!(i < r.len());
            self.hidden_rows.push((r.start + i) as u32);
        }
    }

    /// Marks the last sequence pushed as one to compute as decodes
    /// ([`ForwardBatch::as_decodes`]).
    pub fn mark_as_decodes(&mut self) {
        self.as_decodes.push(self.n_seqs() - 1);
    }

    pub fn is_as_decodes(&self, s: usize) -> bool {
        self.as_decodes.contains(&s)
    }

    /// Sequence `s`'s block table.
    pub fn block_table(&self, s: usize) -> &[BlockId] {
        &self.block_tables[self.block_start[s] as usize..self.block_start[s + 1] as usize]
    }

    /// Checks the batch against a model and a pool: ids in the vocabulary, blocks in the
    /// pool, each sequence's tokens at consecutive positions ending at its context length.
    pub fn validate(&self, n_vocab: usize, num_blocks: usize) -> Result<(), String> {
        if let Some(&bad) = self.tokens.iter().find(|&&id| id as usize >= n_vocab) {
            return Err(format!("token id {bad} outside the vocabulary"));
        }
        if let Some(&b) = self
            .block_tables
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return Err(format!("block {b} outside the pool of {num_blocks}"));
        }
        for s in 0..self.n_seqs() {
            let r = self.seq_tokens(s);
            let last = self.positions[r.end - 1] as usize;
            let consecutive = self.positions[r.clone()]
                .windows(2)
                .all(|w| w[1] == w[0] + 1);
            if !consecutive || last + 1 != self.context_len[s] as usize {
                return Err(format!("sequence {s}: positions out of order"));
            }
        }
        if self
            .logit_rows
            .iter()
            .chain(&self.hidden_rows)
            .any(|&r| r as usize >= self.n_tokens())
        {
            return Err("a logit or hidden row outside the batch".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequences_map_positions_to_their_blocks() {
        let mut b = ForwardBatch::new(4);
        b.push(&[10, 11, 12], 5, &[7, 2], [2]);
        b.push(&[20], 0, &[9], [0]);
        assert_eq!(b.positions, [5, 6, 7, 0]);
        assert_eq!(b.slots, [2 * 4 + 1, 2 * 4 + 2, 2 * 4 + 3, 9 * 4]);
        assert_eq!(b.query_start, [0, 3, 4]);
        assert_eq!(b.context_len, [8, 1]);
        assert_eq!(b.block_table(0), [7, 2]);
        assert_eq!(b.block_table(1), [9]);
        assert_eq!(b.logit_rows, [2, 3]);
        b.push(&[30, 31], 0, &[4], []);
        b.push_hidden([0, 1]);
        assert_eq!(b.hidden_rows, [4, 5]);
        b.validate(100, 10).unwrap();
        assert!(b.validate(15, 10).unwrap_err().contains("vocabulary"));
        assert!(b.validate(100, 8).unwrap_err().contains("outside the pool"));
    }
}
