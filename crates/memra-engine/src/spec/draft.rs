//! A draft model: a smaller model with the target's vocabulary proposes the next tokens,
//! each sequence keeping its own paged KV in the draft's pool. Drafting is batched over
//! the step's speculating sequences: one forward catches each up with its verified tokens
//! and drafts its first token, then one forward per further draft token.

use std::collections::HashMap;
use std::sync::Arc;

use crate::batch::{ForwardBatch, RowOut, RowPick};
use crate::engine::BatchRunner;
use crate::kv::{BlockId, BlockManager};
use crate::models::Model;
use crate::sampler::{Distribution, Sampler, SamplerConfig};
use crate::scheduler::SeqId;

/// Refuses a draft whose vocabulary differs from the target's: its token ids would mean
/// other text.
pub fn check_vocab(target: &Model, draft: &Model) -> Result<(), String> {
    let (t, d) = (&target.tokenizer, &draft.tokenizer);
    let (tn, dn) = (target.decoder.hp.n_vocab, draft.decoder.hp.n_vocab);
    if tn != dn {
        return Err(format!(
            "the draft model's output has {dn} rows, the target's {tn}: a draft must share the \
             target's vocabulary"
        ));
    }
    if t.n_vocab() != d.n_vocab() {
        return Err(format!(
            "the draft model's vocabulary has {} tokens, the target's {}: a draft must share \
             the target's tokenizer",
            d.n_vocab(),
            t.n_vocab()
        ));
    }
    if let Some(id) = (0..t.n_vocab() as u32).find(|&i| t.token_text(i) != d.token_text(i)) {
        return Err(format!(
            "the draft model's token {id} is {:?}, the target's {:?}: a draft must share the \
             target's tokenizer",
            d.token_text(id).unwrap_or(""),
            t.token_text(id).unwrap_or("")
        ));
    }
    Ok(())
}

/// One sequence's state in the draft's pool.
struct DraftSeq {
    blocks: Vec<BlockId>,
    /// Positions whose keys and values the draft holds (a prefix of the sequence's
    /// verified tokens, then drafts).
    computed: usize,
    /// Draws the drafts at temperature > 0 (the sequence's filters and temperature, no
    /// penalties: q may be any distribution, as long as verification uses the same).
    sampler: Sampler,
}

/// What the draft proposes for one sequence: tokens, and the distribution each was drawn
/// from (none when drawn greedily, where verification compares tokens).
pub struct Proposal {
    pub tokens: Vec<u32>,
    pub q: Option<Vec<Distribution>>,
}

pub struct DraftModel {
    model: Arc<Model>,
    runner: Box<dyn BatchRunner>,
    blocks: BlockManager,
    seqs: HashMap<SeqId, DraftSeq>,
    /// The most tokens one sequence caught up with in the last [`DraftModel::propose`].
    caught_up: usize,
}

impl DraftModel {
    pub fn new(model: Arc<Model>, runner: Box<dyn BatchRunner>) -> DraftModel {
        let blocks = BlockManager::new(runner.num_blocks(), runner.block_size());
        DraftModel {
            model,
            runner,
            blocks,
            seqs: HashMap::new(),
            caught_up: 0,
        }
    }

    /// The most verified tokens one sequence's first forward of the last proposal had to
    /// compute (a new sequence's prompt, or the one or two a step gave): the engine's cost
    /// rule measures only proposals that are drafting, not catching up on a prompt.
    pub fn caught_up(&self) -> usize {
        self.caught_up
    }

    pub fn describe(&self) -> String {
        format!("draft {}: {}", self.model.name, self.runner.describe())
    }

    /// Drafts `k` tokens after `tokens` for each `(id, tokens, k, sampler)`; a sequence the
    /// draft's pool has no room for gets none this step. Errors are the runner's.
    pub fn propose(
        &mut self,
        want: &[(SeqId, &[u32], usize, &SamplerConfig)],
    ) -> Result<HashMap<SeqId, Proposal>, String> {
        let bs = self.blocks.block_size();
        let mut active: Vec<(SeqId, &[u32], usize, bool)> = Vec::new();
        for &(id, tokens, k, config) in want {
            let ds = self.seqs.entry(id).or_insert_with(|| DraftSeq {
                blocks: Vec::new(),
                computed: 0,
                sampler: Sampler::new(SamplerConfig {
                    repeat_penalty: 1.0,
                    presence_penalty: 0.0,
                    frequency_penalty: 0.0,
                    logit_bias: HashMap::new(),
                    seed: config.seed ^ 0x9E37_79B9_7F4A_7C15,
                    ..config.clone()
                })
                .expect("a validated configuration"),
            });
            ds.computed = ds.computed.min(tokens.len() - 1);
            // Room for the verified tokens and the drafts but the last (never computed).
            let need = (tokens.len() + k - 1).div_ceil(bs);
            let more = need.saturating_sub(ds.blocks.len());
            if k == 0 || more > self.blocks.num_free() {
                continue;
            }
            for _ in 0..more {
                ds.blocks
                    .push(self.blocks.allocate().expect("counted free"));
            }
            active.push((id, tokens, k, config.temperature > 0.0));
        }
        let mut out: HashMap<SeqId, Proposal> = active
            .iter()
            .map(|&(id, _, _, sampled)| {
                let q = sampled.then(Vec::new);
                (
                    id,
                    Proposal {
                        tokens: Vec::new(),
                        q,
                    },
                )
            })
            .collect();
        self.caught_up = active
            .iter()
            .map(|&(id, tokens, _, _)| tokens.len() - self.seqs[&id].computed)
            .max()
            .unwrap_or(0);
        let longest = active.iter().map(|a| a.2).max().unwrap_or(0);
        for j in 0..longest {
            let mut batch = ForwardBatch::new(bs);
            let mut order = Vec::new();
            for &(id, tokens, k, _) in &active {
                if j >= k {
                    continue;
                }
                let ds = &self.seqs[&id];
                let p = &out[&id];
                // First: every verified token the draft has not seen; then the last draft.
                let (new, start): (Vec<u32>, usize) = match j {
                    0 => (tokens[ds.computed..].to_vec(), ds.computed),
                    _ => (
                        vec![*p.tokens.last().expect("drafted")],
                        tokens.len() + j - 1,
                    ),
                };
                let n = new.len();
                batch.push(&new, start, &ds.blocks, [n - 1]);
                // The catch-up after a step that took every draft is two tokens (the last
                // draft and the target's own): decode rows on the GPU, not a prompt chunk.
                if n > 1 {
                    batch.mark_as_decodes();
                }
                order.push(id);
            }
            if order.is_empty() {
                break;
            }
            let mut picks: Vec<RowPick> = order
                .iter()
                .map(|id| match out[id].q {
                    None => RowPick::Greedy,
                    Some(_) => RowPick::Logits,
                })
                .collect();
            let rows = self.runner.forward(&batch, &mut picks)?;
            drop(picks);
            for (id, row) in order.iter().zip(rows) {
                let ds = self.seqs.get_mut(id).expect("active");
                let p = out.get_mut(id).expect("active");
                let next = match row {
                    RowOut::Token(t) => t,
                    RowOut::Hidden(_) => return Err("the draft returned a hidden state".into()),
                    RowOut::Logits(l) => {
                        let q = ds.sampler.distribution(&l);
                        let t = match &q {
                            Distribution::Greedy(t) => *t,
                            Distribution::Candidates(c) => ds.sampler.draw(c),
                        };
                        p.q.as_mut().expect("sampled").push(q);
                        t
                    }
                };
                p.tokens.push(next);
            }
            for &(id, tokens, k, _) in &active {
                if j < k {
                    self.seqs.get_mut(&id).expect("active").computed = tokens.len() + j;
                }
            }
        }
        Ok(out)
    }

    /// The sequence's tokens are verified up to `verified` positions: the draft's keys and
    /// values past them (rejected drafts) are to be recomputed.
    pub fn settle(&mut self, id: SeqId, verified: usize) {
        if let Some(ds) = self.seqs.get_mut(&id) {
            ds.computed = ds.computed.min(verified);
        }
    }

    /// Forgets the sequences not in `keep`, giving their blocks back.
    pub fn retain(&mut self, keep: impl Fn(SeqId) -> bool) {
        let blocks = &mut self.blocks;
        self.seqs.retain(|&id, ds| {
            let k = keep(id);
            if !k {
                ds.blocks.drain(..).rev().for_each(|b| blocks.release(b));
            }
            k
        });
    }
}
