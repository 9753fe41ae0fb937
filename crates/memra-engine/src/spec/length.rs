//! How many tokens a sequence drafts next.
//!
//! A cycle of k drafts costs drafting them and verifying them, and gives the accepted
//! drafts and the verify step's own token. With each draft passing with chance a (given
//! the ones before it passed), that is (1 - a^(k+1)) / (1 - a) tokens in a plain step's
//! time plus k times what a draft adds (drafting it and its row in the verify step):
//! relative to plain decoding, f(k) = (1 - a^(k+1)) / ((1 - a)(1 + k c)), with c a draft's
//! cost over a plain step's (Leviathan et al. 2023). The cost rule takes the k that makes
//! f largest, and none where no k beats plain decoding (f(0) = 1): on the H200 the real
//! Qwen 0.5B drafting for the 1.5B costs c = 0.54 a token, and at 75% acceptance the
//! length rule's 5-7 drafts gave 0.86x plain decoding where f says one draft gives 1.14x
//! (docs/engine.md). c and a are measured as the engine runs.

/// How a sequence's draft length is chosen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DraftPolicy {
    /// From the measured costs and the sequence's acceptance: the length with the most
    /// tokens a second, none where drafting loses (tried again after `PROBE_AFTER` steps,
    /// then at doubling intervals).
    #[default]
    Cost,
    /// Twice the recent accepted count plus one, whatever drafting costs.
    Length,
}

/// A sequence that does not draft because it would not pay drafts again after this many
/// steps, so that its acceptance (and the costs) are measured again; the wait doubles
/// after each probe that does not pay, up to `MAX_PROBE_AFTER` (a probe costs the draft
/// model's catch-up with the tokens it missed, on the CPU as much as several steps).
pub const PROBE_AFTER: usize = 16;
const MAX_PROBE_AFTER: usize = 256;

/// The step costs are the median of their last `COST_WINDOW` measurements, once there are
/// `COST_MIN_SAMPLES`: a GPU runs a step of a new row count eagerly, then captures its
/// graph, so the first two steps of a size are slow, and a median outvotes them (and the
/// odd late step) where an average would carry them for many steps.
const COST_WINDOW: usize = 9;
const COST_MIN_SAMPLES: usize = 3;

/// Decay of the acceptance counts per verify step (about the last ten steps count).
const ACCEPT_DECAY: f32 = 0.8;

/// A new sequence's acceptance counts as this many drafts at the engine's acceptance.
const PRIOR_WEIGHT: f32 = 3.0;

/// Decay of the engine's acceptance counts per verify step of any sequence.
const ENGINE_ACCEPT_DECAY: f32 = 0.95;

/// Decaying counts of drafts passed and of drafts rejected (each verify step rejects at
/// most one: the first that fails ends it): passed / (passed + rejected) is the per-draft
/// acceptance's maximum-likelihood estimate for drafts that pass independently.
#[derive(Clone, Copy, Debug)]
struct Acceptance {
    passed: f32,
    rejected: f32,
}

impl Acceptance {
    /// 2/3, as from three drafts.
    const PRIOR: Acceptance = Acceptance {
        passed: 2.0,
        rejected: 1.0,
    };

    fn record(&mut self, decay: f32, accepted: usize, drafted: usize) {
        self.passed = decay * self.passed + accepted as f32;
        self.rejected = decay * self.rejected + f32::from(accepted < drafted);
    }

    fn rate(&self) -> f64 {
        f64::from(self.passed / (self.passed + self.rejected))
    }
}

/// A sequence's recent acceptance and what it waited.
#[derive(Clone, Debug)]
pub struct DraftLength {
    /// Exponential moving average of accepted drafts per step (the length rule).
    accepted: f32,
    acceptance: Acceptance,
    /// Steps without drafts since the cost rule last chose some, and how many it waits
    /// before it probes.
    waited: usize,
    probe_after: usize,
}

impl Default for DraftLength {
    fn default() -> DraftLength {
        DraftLength {
            accepted: 2.0,
            acceptance: Acceptance::PRIOR,
            waited: 0,
            probe_after: PROBE_AFTER,
        }
    }
}

impl DraftLength {
    /// A new sequence's state, its acceptance starting at `a` (the engine's recent one,
    /// [`SpecCosts::acceptance`]) as if from three drafts.
    pub fn starting_at(a: f64) -> DraftLength {
        let a = a.clamp(0.0, 1.0) as f32;
        DraftLength {
            acceptance: Acceptance {
                passed: PRIOR_WEIGHT * a,
                rejected: PRIOR_WEIGHT * (1.0 - a),
            },
            ..DraftLength::default()
        }
    }

    /// The next length: at most `most` and at least `least` (at least 1), or 0 (no drafts
    /// this step). `ratio` is a draft's cost over a plain step's, where it is measured;
    /// without it the length rule answers.
    pub fn next(
        &mut self,
        policy: DraftPolicy,
        ratio: Option<f64>,
        least: usize,
        most: usize,
    ) -> usize {
        let least = least.max(1);
        if most < least {
            return 0;
        }
        let by_length = || {
            let want = (2.0 * self.accepted).ceil() as usize + 1;
            want.clamp(least, most)
        };
        let (DraftPolicy::Cost, Some(c)) = (policy, ratio) else {
            return by_length();
        };
        let k = best_length(self.acceptance(), c, least, most);
        if k > 0 {
            (self.waited, self.probe_after) = (0, PROBE_AFTER);
            return k;
        }
        self.waited += 1;
        if self.waited > self.probe_after {
            self.waited = 0;
            self.probe_after = (2 * self.probe_after).min(MAX_PROBE_AFTER);
            return least;
        }
        0
    }

    /// A verify step took `accepted` of `drafted` drafts.
    pub fn record(&mut self, accepted: usize, drafted: usize) {
        self.accepted = 0.7 * self.accepted + 0.3 * accepted as f32;
        self.acceptance.record(ACCEPT_DECAY, accepted, drafted);
    }

    /// The estimated chance that a draft passes.
    pub fn acceptance(&self) -> f64 {
        self.acceptance.rate()
    }
}

/// The draft length in `least..=most` with the most tokens a second at acceptance `a` and
/// cost ratio `c` (f above), or 0 where none beats plain decoding.
pub fn best_length(a: f64, c: f64, least: usize, most: usize) -> usize {
    // An acceptance of 1 would make every length free of rejections: keep f finite.
    let a = a.clamp(0.0, 0.999);
    let f = |k: usize| (1.0 - a.powi(k as i32 + 1)) / ((1.0 - a) * (1.0 + k as f64 * c.max(0.0)));
    let (mut best, mut best_f) = (0, 1.0);
    for k in least.max(1)..=most {
        if f(k) > best_f {
            (best, best_f) = (k, f(k));
        }
    }
    best
}

/// What the engine's steps cost while it speculates, measured by the engine thread, and
/// its sequences' recent acceptance (where a new sequence's starts: a draft model that
/// rarely passes need not be tried again on every request).
#[derive(Debug)]
pub struct SpecCosts {
    /// Seconds of a step of n decodes without drafts (index n - 1).
    plain: Vec<Samples>,
    /// Seconds a drafted token adds to a step of decodes: drafting it, and its row in the
    /// verify step.
    per_draft: Samples,
    /// Over every sequence's verify steps.
    acceptance: Acceptance,
}

impl Default for SpecCosts {
    fn default() -> SpecCosts {
        SpecCosts {
            plain: Vec::new(),
            per_draft: Samples::default(),
            acceptance: Acceptance::PRIOR,
        }
    }
}

/// The last `COST_WINDOW` measurements of a cost.
#[derive(Clone, Debug, Default)]
struct Samples(std::collections::VecDeque<f64>);

impl Samples {
    fn push(&mut self, v: f64) {
        if self.0.len() == COST_WINDOW {
            self.0.pop_front();
        }
        self.0.push_back(v);
    }

    fn median(&self) -> Option<f64> {
        if self.0.len() < COST_MIN_SAMPLES {
            return None;
        }
        let mut v: Vec<f64> = self.0.iter().copied().collect();
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    }
}

impl SpecCosts {
    /// A step of `n` decodes, no drafts, took `secs`.
    pub fn record_plain(&mut self, n: usize, secs: f64) {
        if n == 0 {
            return;
        }
        if self.plain.len() < n {
            self.plain.resize(n, Samples::default());
        }
        self.plain[n - 1].push(secs);
    }

    /// A step of `n` decoding sequences with `drafts` drafted tokens among them took
    /// `secs` to draft and verify (unused before plain steps of `n` are measured).
    pub fn record_cycle(&mut self, n: usize, drafts: usize, secs: f64) {
        let Some(plain) = self.plain(n) else { return };
        if drafts == 0 {
            return;
        }
        self.per_draft
            .push(((secs - plain) / drafts as f64).max(0.0));
    }

    /// A verify step of some sequence took `accepted` of `drafted` drafts.
    pub fn record_verify(&mut self, accepted: usize, drafted: usize) {
        self.acceptance
            .record(ENGINE_ACCEPT_DECAY, accepted, drafted);
    }

    /// The engine's recent acceptance (2/3 before any verify step).
    pub fn acceptance(&self) -> f64 {
        self.acceptance.rate()
    }

    /// A plain step of `n` decodes, once measured often enough.
    pub fn plain(&self, n: usize) -> Option<f64> {
        self.plain.get(n.checked_sub(1)?)?.median()
    }

    /// A draft's cost over a plain step of `n` decodes, once both are measured.
    pub fn ratio(&self, n: usize) -> Option<f64> {
        Some(self.per_draft.median()? / self.plain(n)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniform in [0, 1), from a 64-bit LCG's high bits.
    fn uniform(seed: &mut u64) -> f64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (*seed >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Tokens a second, relative to plain decoding, of k drafts a cycle, by simulation:
    /// drafts pass independently with chance a; a cycle costs 1 + k c plain steps and
    /// gives the passed drafts up to the first failure, and one more token.
    fn simulated(a: f64, c: f64, k: usize, seed: &mut u64) -> f64 {
        let cycles = 40_000;
        let mut tokens = 0usize;
        for _ in 0..cycles {
            let passed = (0..k).take_while(|_| uniform(seed) < a).count();
            tokens += passed + 1;
        }
        tokens as f64 / (cycles as f64 * (1.0 + k as f64 * c))
    }

    #[test]
    fn best_length_is_the_fastest_in_a_simulation() {
        let mut seed = 7u64;
        for _ in 0..12 {
            let a = 0.05 + 0.92 * uniform(&mut seed);
            let c = 1.2 * uniform(&mut seed);
            let (least, most) = (1, 8);
            let k = best_length(a, c, least, most);
            let rates: Vec<f64> = (0..=most)
                .map(|k| match k {
                    0 => 1.0,
                    _ => simulated(a, c, k, &mut seed),
                })
                .collect();
            let best = rates.iter().cloned().fold(0.0, f64::max);
            // Within the simulation's noise of the fastest length (or of plain decoding).
            assert!(
                rates[k] >= best * 0.97,
                "a {a:.3} c {c:.3}: chose {k} ({:.3}), rates {rates:?}",
                rates[k]
            );
        }
    }

    #[test]
    fn best_length_at_the_measured_h200_costs() {
        // The real 0.5B drafting for the 1.5B: c = 0.80 / 1.48 ms.
        assert_eq!(best_length(0.75, 0.54, 1, 7), 1);
        // Drafts that rarely pass, or cost more than they give: none.
        assert_eq!(best_length(0.3, 0.54, 1, 7), 0);
        assert_eq!(best_length(0.9, 1.5, 1, 7), 0);
        // Free drafts that pass: the most allowed; the floor is kept.
        assert_eq!(best_length(0.9, 0.0, 1, 7), 7);
        assert_eq!(best_length(0.9, 0.01, 3, 5), 5);
        assert_eq!(best_length(0.75, 0.54, 3, 7), 3);
        assert_eq!(best_length(0.75, 0.54, 4, 7), 0);
        assert_eq!(best_length(1.0, 0.1, 1, 4), 4);
    }

    #[test]
    fn acceptance_follows_the_verify_steps() {
        let mut l = DraftLength::default();
        for _ in 0..40 {
            l.record(3, 4); // three pass, the fourth fails: a = 3/4
        }
        assert!((l.acceptance() - 0.75).abs() < 1e-3, "{}", l.acceptance());
        for _ in 0..40 {
            l.record(0, 2);
        }
        assert!(l.acceptance() < 0.01, "{}", l.acceptance());
        for _ in 0..40 {
            l.record(5, 5); // every draft passes: no rejection
        }
        assert!(l.acceptance() > 0.99, "{}", l.acceptance());
    }

    #[test]
    fn the_cost_rule_stops_drafting_that_loses_and_probes_less_and_less() {
        let mut l = DraftLength::default();
        for _ in 0..40 {
            l.record(0, 3);
        }
        let picks: Vec<usize> = (0..20 * PROBE_AFTER)
            .map(|_| l.next(DraftPolicy::Cost, Some(0.5), 2, 7))
            .collect();
        let probes: Vec<usize> = picks
            .iter()
            .enumerate()
            .filter(|(_, &k)| k > 0)
            .map(|(i, _)| i)
            .collect();
        // After 16 steps, then 32 more, 64, 128, then every 256.
        let mut want = Vec::new();
        let (mut at, mut wait) = (0, PROBE_AFTER);
        while at + wait < picks.len() {
            want.push(at + wait);
            at += wait + 1;
            wait = (2 * wait).min(MAX_PROBE_AFTER);
        }
        assert_eq!(probes, want, "{picks:?}");
        assert_eq!(&want[..3], [16, 49, 114]);
        assert!(picks.iter().all(|&k| k == 0 || k == 2));
        // Unmeasured costs, or the length rule: twice the recent acceptance plus one.
        let mut l = DraftLength::default();
        assert_eq!(l.next(DraftPolicy::Cost, None, 1, 7), 5);
        assert_eq!(l.next(DraftPolicy::Length, Some(10.0), 1, 7), 5);
        assert_eq!(l.next(DraftPolicy::Length, None, 1, 3), 3);
        assert_eq!(l.next(DraftPolicy::Cost, Some(0.0), 4, 3), 0);
    }

    #[test]
    fn new_sequences_start_from_the_engines_acceptance() {
        let mut c = SpecCosts::default();
        assert!((c.acceptance() - 2.0 / 3.0).abs() < 1e-6);
        for _ in 0..100 {
            c.record_verify(0, 3);
        }
        assert!(c.acceptance() < 0.01, "{}", c.acceptance());
        // A sequence starting there does not draft at a draft's cost of half a step, where
        // one starting from 2/3 would.
        let mut fresh = DraftLength::starting_at(c.acceptance());
        assert_eq!(fresh.next(DraftPolicy::Cost, Some(0.5), 1, 7), 0);
        assert_eq!(
            DraftLength::default().next(DraftPolicy::Cost, Some(0.5), 1, 7),
            1
        );
        // Its own verify steps soon outweigh the start.
        for _ in 0..10 {
            fresh.record(4, 4);
        }
        assert!(fresh.acceptance() > 0.9, "{}", fresh.acceptance());
        for _ in 0..100 {
            c.record_verify(2, 2);
        }
        assert!(c.acceptance() > 0.99, "{}", c.acceptance());
        let a = DraftLength::starting_at(0.75).acceptance();
        assert!((a - 0.75).abs() < 1e-6, "{a}");
    }

    #[test]
    fn step_costs_give_a_drafts_share_of_a_plain_step() {
        let mut c = SpecCosts::default();
        assert_eq!(c.ratio(1), None);
        // Cycles before plain steps of their size are measured are not used.
        c.record_cycle(1, 4, 0.010);
        // The first steps of a size (eager, then captured) are slow; three are needed.
        for secs in [0.050, 0.020] {
            c.record_plain(1, secs);
            assert_eq!(c.plain(1), None);
        }
        c.record_plain(1, 0.002);
        assert_eq!(c.plain(1), Some(0.020));
        c.record_plain(1, 0.002);
        c.record_plain(1, 0.002);
        assert_eq!(c.plain(1), Some(0.002));
        for _ in 0..2 {
            c.record_cycle(1, 4, 0.006);
            assert_eq!(c.ratio(1), None);
        }
        c.record_cycle(1, 4, 0.006);
        assert!((c.ratio(1).unwrap() - 0.5).abs() < 1e-9);
        // An odd slow cycle does not move the median; a run of them does.
        c.record_cycle(1, 2, 0.100);
        assert!((c.ratio(1).unwrap() - 0.5).abs() < 1e-9);
        for _ in 0..8 {
            c.record_cycle(1, 2, 0.006);
        }
        assert!((c.ratio(1).unwrap() - 1.0).abs() < 1e-9);
        // Each row count apart.
        assert_eq!(c.ratio(2), None);
        for _ in 0..3 {
            c.record_plain(3, 0.004);
        }
        assert_eq!(c.plain(2), None);
        assert!((c.ratio(3).unwrap() - 0.5).abs() < 1e-9);
        // Cycles faster than plain (noise) count as free drafts, not negative ones.
        for _ in 0..9 {
            c.record_cycle(3, 1, 0.001);
        }
        assert_eq!(c.ratio(3), Some(0.0));
        c.record_plain(0, 1.0);
    }
}
