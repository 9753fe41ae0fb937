//! Verifying drafted tokens against the target model's rows for them.

use std::collections::HashMap;

use crate::sampler::{Distribution, Sampler};

/// What a verify step gives a sequence: its first `accepted` drafts, then `next` (the
/// target's own token where a draft was rejected, or one more after all of them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub next: u32,
}

/// Verifies `drafts` against `rows`, the target's logits for the step's tokens (the
/// sequence's last token, then the drafts): row `i` is the distribution of the token after
/// `i` of them, so it judges draft `i` and `rows.len() == drafts.len() + 1`. `q` holds the
/// drafts' distributions where a model drew them; drafts without one (prompt lookup) count
/// as certain (q = 1 for the drafted token). The sampler records every token it returns,
/// in order, so its penalties see them as plain decoding's would.
pub fn verify(
    sampler: &mut Sampler,
    rows: &[&[f32]],
    drafts: &[u32],
    q: Option<&[Distribution]>,
) -> Verdict {
    assert_eq!(rows.len(), drafts.len() + 1, "a row per draft and one more");
    for (i, &d) in drafts.iter().enumerate() {
        let p = sampler.distribution(rows[i]);
        let cand = match p {
            Distribution::Greedy(best) => {
                sampler.accept(best);
                if best == d {
                    continue;
                }
                return Verdict {
                    accepted: i,
                    next: best,
                };
            }
            Distribution::Candidates(c) => c,
        };
        // The draft's probabilities by token (a lookup per candidate of p: a whole
        // vocabulary on each side must not cost its square).
        let qi: Option<HashMap<u32, f32>> = q.map(|q| match &q[i] {
            Distribution::Greedy(t) => HashMap::from([(*t, 1.0)]),
            Distribution::Candidates(c) => c.iter().copied().collect(),
        });
        let q_of = |id: u32| match &qi {
            Some(m) => m.get(&id).copied().unwrap_or(0.0),
            None => f32::from(u8::from(id == d)),
        };
        let qd = q_of(d);
        let pd = cand.iter().find(|c| c.0 == d).map_or(0.0, |c| c.1);
        // Accept with probability min(1, p(d) / q(d)).
        if qd > 0.0 && sampler.uniform() < f64::from(pd / qd) {
            sampler.accept(d);
            continue;
        }
        // Rejected: draw from max(0, p - q), normalized.
        let residual: Vec<(u32, f32)> = cand
            .iter()
            .map(|&(id, p)| (id, (p - q_of(id)).max(0.0)))
            .filter(|c| c.1 > 0.0)
            .collect();
        let z: f32 = residual.iter().map(|c| c.1).sum();
        let next = if z > 0.0 {
            let r: Vec<(u32, f32)> = residual.iter().map(|&(id, p)| (id, p / z)).collect();
            sampler.draw(&r)
        } else {
            // p <= q everywhere means p == q: the draft would have been accepted; rounding
            // got here, so draw from p itself.
            sampler.draw(&cand)
        };
        sampler.accept(next);
        return Verdict { accepted: i, next };
    }
    let next = match sampler.distribution(rows[drafts.len()]) {
        Distribution::Greedy(best) => best,
        Distribution::Candidates(c) => sampler.draw(&c),
    };
    sampler.accept(next);
    Verdict {
        accepted: drafts.len(),
        next,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplerConfig;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *seed >> 33
    }

    fn config(temperature: f32, seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed,
            ..Default::default()
        }
    }

    /// Greedy (with repetition penalties, which depend on the accepted tokens): the tokens a
    /// verify step gives are exactly plain decoding's over the same rows, up to the first
    /// rejected draft.
    #[test]
    fn greedy_verification_gives_plain_decoding() {
        let mut seed = 5u64;
        for case in 0..500 {
            let k = 1 + (lcg(&mut seed) % 5) as usize;
            let rows: Vec<Vec<f32>> = (0..=k)
                .map(|_| {
                    (0..8)
                        .map(|_| (lcg(&mut seed) % 100) as f32 / 10.0)
                        .collect()
                })
                .collect();
            let c = SamplerConfig {
                repeat_penalty: 1.5,
                ..config(0.0, 0)
            };
            let mut plain = Sampler::new(c.clone()).unwrap();
            // Drafts: plain decoding's tokens, with one changed at a random place (or none).
            let mut want = Vec::new();
            let mut truth = Vec::new();
            for r in &rows {
                let t = plain.sample(r);
                plain.accept(t);
                truth.push(t);
            }
            let wrong = (lcg(&mut seed) % (k as u64 + 1)) as usize;
            let mut drafts = truth[..k].to_vec();
            if wrong < k {
                drafts[wrong] = (drafts[wrong] + 1) % 8;
            }
            for (i, &t) in truth.iter().enumerate() {
                want.push(t);
                if i < k && drafts[i] != t {
                    break;
                }
            }
            let mut s = Sampler::new(c).unwrap();
            let refs: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
            let v = verify(&mut s, &refs, &drafts, None);
            let mut got = drafts[..v.accepted].to_vec();
            got.push(v.next);
            assert_eq!(got, want, "case {case}: drafts {drafts:?}");
        }
    }

    /// Pearson chi-square of counts against probabilities, at the 0.1% level.
    fn chi_square(counts: &[usize], probs: &[f64]) {
        let n: usize = counts.iter().sum();
        let mut chi = 0.0;
        let mut dof = 0usize;
        for (&c, &p) in counts.iter().zip(probs) {
            if p == 0.0 {
                assert_eq!(c, 0, "a token of probability 0 was drawn: {counts:?}");
                continue;
            }
            let e = p * n as f64;
            chi += (c as f64 - e).powi(2) / e;
            dof += 1;
        }
        let critical = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32][dof - 2];
        assert!(
            chi < critical,
            "chi-square {chi:.2} >= {critical}: {counts:?} vs {probs:?}"
        );
    }

    fn softmax(row: &[f32], t: f32) -> Vec<f64> {
        let e: Vec<f64> = row
            .iter()
            .map(|&l| (f64::from(l) / f64::from(t)).exp())
            .collect();
        let z: f64 = e.iter().sum();
        e.iter().map(|x| x / z).collect()
    }

    /// Temperature above 0: the first token a verify step gives is distributed as the
    /// target's row, whether the draft is a fixed guess (prompt lookup) or drawn from a
    /// different distribution q (a draft model); and the second, after an accepted draft,
    /// as the next row.
    #[test]
    fn sampled_verification_keeps_the_target_distribution() {
        let p_row = [2.0f32, 1.5, 1.0, 0.5, 0.0, -1.0];
        let next_row = [0.0f32, 0.3, 1.2, -0.5, 0.8, 0.1];
        let q_row = [-1.0f32, 0.0, 2.0, 1.0, 0.0, 1.5];
        let t = 0.9;
        let p = softmax(&p_row, t);
        let n = 40_000;
        let q_dist = Sampler::new(config(t, 0)).unwrap().distribution(&q_row);
        for with_q in [false, true] {
            let mut first = vec![0usize; 6];
            let mut second = vec![0usize; 6];
            let mut drafter = Sampler::new(config(t, 77)).unwrap();
            let mut s = Sampler::new(config(t, 1234)).unwrap();
            for _ in 0..n {
                let d = if with_q { drafter.sample(&q_row) } else { 2 };
                let q = [q_dist.clone()];
                let v = verify(&mut s, &[&p_row, &next_row], &[d], with_q.then_some(&q[..]));
                match v.accepted {
                    1 => {
                        first[d as usize] += 1;
                        second[v.next as usize] += 1;
                    }
                    _ => first[v.next as usize] += 1,
                }
            }
            chi_square(&first, &p);
            chi_square(&second, &softmax(&next_row, t));
        }
    }
}
