//! Speculative decoding: drafts of the next few tokens, verified by the target model in
//! one forward pass over all of them (a verify step costs about what a decode step costs
//! while decoding is bound by reading the weights, so every accepted draft is a token
//! almost for free).
//!
//! Drafts come from prompt lookup ([`ngram`]: the sequence's own earlier tokens) or from a
//! smaller model with the same vocabulary ([`draft`]).
//! [`verify`] accepts a prefix of them so that the output is distributed exactly as plain
//! decoding's: at temperature 0 the very tokens plain decoding gives, above it the
//! standard rejection rule (accept a draft with probability min(1, p/q), else draw from the
//! normalized residual max(0, p - q)), where p is the sampler's distribution for the row
//! (after its penalties, bias and filters) and q the draft's.

pub mod draft;
mod length;
pub mod ngram;
mod verify;

pub use length::{DraftLength, DraftPolicy, SpecCosts};
pub use verify::{verify, Verdict};

/// How a sequence speculates.
#[derive(Clone, Debug, PartialEq)]
pub struct SpecConfig {
    /// Prompt lookup: match the last `ngram` tokens (down to 1) earlier in the sequence
    /// (unused with a draft model).
    pub ngram: usize,
    /// Drafted tokens per step at most, and at least (fewer found: no speculation).
    pub draft_max: usize,
    pub draft_min: usize,
    /// Speculate only while at most this many sequences run: a large batch is already
    /// compute-bound, where verifying rejected drafts costs real time.
    pub max_batch: usize,
    /// How the draft length is chosen ([`DraftPolicy`]).
    pub policy: DraftPolicy,
}

impl SpecConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.ngram == 0 {
            return Err("--spec-ngram must be at least 1".into());
        }
        if self.draft_max == 0 || self.draft_min > self.draft_max {
            return Err(format!(
                "--draft-max ({}) must be at least 1 and at least --draft-min ({})",
                self.draft_max, self.draft_min
            ));
        }
        Ok(())
    }
}
