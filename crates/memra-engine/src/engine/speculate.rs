//! The engine's side of speculative decoding (`crate::spec`): which sequences draft this
//! step and how long, and how a verify step's rows turn into tokens.

use crate::batch::RowOut;
use crate::sampler::{Distribution, Sampler};
use crate::spec::{ngram, verify, DraftLength, Verdict};

/// A sequence's speculation state.
#[derive(Debug, Default)]
pub(super) struct SpecState {
    /// The drafts appended to the sequence for the step being planned, and the
    /// distributions a draft model drew them from (none for prompt lookup and greedy
    /// drafts).
    pub draft: Vec<u32>,
    pub q: Option<Vec<Distribution>>,
    pub length: DraftLength,
    /// Drafted and accepted tokens so far.
    pub drafted: usize,
    pub accepted: usize,
}

impl SpecState {
    /// A new sequence's, its acceptance starting at the engine's recent one.
    pub fn starting_at(acceptance: f64) -> SpecState {
        SpecState {
            length: DraftLength::starting_at(acceptance),
            ..SpecState::default()
        }
    }
}

/// Prompt-lookup drafts (matching up to `n` tokens) for a decoding sequence whose tokens
/// are `tokens`, at most `k`; none when fewer than `least` are found.
pub(super) fn lookup_drafts(tokens: &[u32], n: usize, k: usize, least: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let draft = ngram::propose(tokens, n, k);
    if draft.len() < least.max(1) {
        return Vec::new();
    }
    draft
}

/// The tokens a verify step gives: its rows (the runner's greedy picks, or logits for the
/// sampler) judged against the drafts they computed. Returns the verdict and whether the
/// sampler has recorded its tokens already (it has when it judged logits).
pub(super) fn judge(
    rows: Vec<RowOut>,
    drafts: &[u32],
    q: Option<&[Distribution]>,
    sampler: &mut Sampler,
) -> (Verdict, bool) {
    debug_assert_eq!(rows.len(), drafts.len() + 1);
    if rows.iter().all(|r| matches!(r, RowOut::Token(_))) {
        // Plain greedy: the device picked each row's best token.
        let ids: Vec<u32> = rows
            .into_iter()
            .map(|r| match r {
                RowOut::Token(t) => t,
                RowOut::Logits(_) | RowOut::Hidden(_) => unreachable!("checked above"),
            })
            .collect();
        let accepted = ids.iter().zip(drafts).take_while(|(t, d)| t == d).count();
        let next = ids[accepted];
        return (Verdict { accepted, next }, false);
    }
    let logits: Vec<Vec<f32>> = rows.into_iter().map(RowOut::into_logits).collect();
    let refs: Vec<&[f32]> = logits.iter().map(|r| r.as_slice()).collect();
    let q = q.map(|q| &q[..drafts.len()]);
    (verify(sampler, &refs, drafts, q), true)
}
