//! Token sampling: logit bias, repetition / presence / frequency penalties, top-k, top-p,
//! min-p and temperature, in llama.cpp's default order, with a seeded generator so a run
//! can be repeated exactly. Temperature 0 is greedy.

use std::collections::HashMap;

#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// 0 (or below) picks the most likely token.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0.0 disables.
    pub min_p: f32,
    /// 1.0 disables; divides positive logits and multiplies negative ones of recent tokens.
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at.
    pub penalty_last_n: usize,
    pub logit_bias: HashMap<u32, f32>,
    pub seed: u64,
}

impl SamplerConfig {
    /// Whether sampling is the plain most-likely pick (no temperature, penalties or bias),
    /// which a device can make without sending the logits back.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0
            && self.logit_bias.is_empty()
            && (self.penalty_last_n == 0
                || (self.repeat_penalty == 1.0
                    && self.presence_penalty == 0.0
                    && self.frequency_penalty == 0.0))
    }
}

impl Default for SamplerConfig {
    /// llama.cpp's defaults.
    fn default() -> SamplerConfig {
        SamplerConfig {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            logit_bias: HashMap::new(),
            seed: 0,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SamplerError {
    #[error("invalid sampling parameter: {0}")]
    Invalid(String),
}

impl SamplerConfig {
    pub fn validate(&self) -> Result<(), SamplerError> {
        let bad = |m: &str| Err(SamplerError::Invalid(m.to_string()));
        if !self.temperature.is_finite() {
            return bad("temperature must be a finite number");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad("top-p must be within [0, 1]");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min-p must be within [0, 1]");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad("repeat penalty must be positive");
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return bad("penalties must be finite");
        }
        if self.logit_bias.values().any(|b| b.is_nan()) {
            return bad("logit bias must not be NaN");
        }
        Ok(())
    }
}

/// xoshiro256**, seeded through splitmix64.
#[derive(Clone, Debug)]
struct Rng([u64; 4]);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Rng([next(), next(), next(), next()])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// What a device needs to pick the next token as [`Sampler::sample`] would, keeping the
/// logits where they are ([`Sampler::device_plan`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DevicePlan {
    /// Token ids whose logits change, each once: (id, bias, times among the recent tokens).
    /// A logit gets its bias, then, if counted, the penalties.
    pub adjust: Vec<(u32, f32, u32)>,
    pub repeat_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// `None`: the most likely token after the adjustments (temperature 0).
    pub filters: Option<DeviceFilters>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceFilters {
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    pub temperature: f32,
}

/// What a row's next token is drawn from ([`Sampler::distribution`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Distribution {
    /// Temperature 0: this token.
    Greedy(u32),
    /// These tokens with these probabilities, best first.
    Candidates(Vec<(u32, f32)>),
}

pub struct Sampler {
    config: SamplerConfig,
    rng: Rng,
    recent: Vec<u32>,
}

impl Sampler {
    pub fn new(config: SamplerConfig) -> Result<Sampler, SamplerError> {
        config.validate()?;
        let rng = Rng::new(config.seed);
        Ok(Sampler {
            config,
            rng,
            recent: Vec::new(),
        })
    }

    /// Records a token the penalties should see (prompt tokens and sampled ones).
    pub fn accept(&mut self, id: u32) {
        self.recent.push(id);
        let keep = self.config.penalty_last_n;
        if self.recent.len() > keep.max(1) * 2 {
            self.recent.drain(..self.recent.len() - keep);
        }
    }

    /// The next pick as a plan for a device that keeps at most `max_candidates` candidates,
    /// over `n_vocab` logits; `None` where it cannot follow [`Sampler::sample`] (top-k off or
    /// above `max_candidates` when drawing).
    pub fn device_plan(&self, n_vocab: usize, max_candidates: usize) -> Option<DevicePlan> {
        let c = &self.config;
        let filters = if c.temperature <= 0.0 {
            None
        } else if (1..=max_candidates).contains(&c.top_k) {
            Some(DeviceFilters {
                top_k: c.top_k,
                top_p: c.top_p,
                min_p: c.min_p,
                temperature: c.temperature,
            })
        } else {
            return None;
        };
        let mut adjust: HashMap<u32, (f32, u32)> = HashMap::new();
        for (&id, &b) in &c.logit_bias {
            adjust.entry(id).or_default().0 += b;
        }
        for (id, n) in self.penalty_counts() {
            adjust.entry(id).or_default().1 = n;
        }
        let mut adjust: Vec<_> = adjust
            .into_iter()
            .filter(|&(id, _)| (id as usize) < n_vocab)
            .map(|(id, (b, n))| (id, b, n))
            .collect();
        adjust.sort_unstable_by_key(|a| a.0);
        Some(DevicePlan {
            adjust,
            repeat_penalty: c.repeat_penalty,
            frequency_penalty: c.frequency_penalty,
            presence_penalty: c.presence_penalty,
            filters,
        })
    }

    /// Whether picks are the plain most likely token ([`SamplerConfig::is_plain_greedy`]).
    pub fn is_plain_greedy(&self) -> bool {
        self.config.is_plain_greedy()
    }

    /// The uniform number the next draw uses, left for the draw to consume.
    pub fn peek_uniform(&self) -> f64 {
        self.rng.clone().next_f64()
    }

    /// Consumes the number [`Sampler::peek_uniform`] showed (a device drew with it).
    pub fn consume_uniform(&mut self) {
        self.rng.next_f64();
    }

    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.distribution(logits) {
            Distribution::Greedy(id) => id,
            Distribution::Candidates(cand) => self.draw(&cand),
        }
    }

    /// What [`Sampler::sample`] draws from for one row of logits, with the penalties of the
    /// tokens accepted so far: the adjusted logits' best token at temperature 0, else the
    /// candidates the filters leave, best first, with their probabilities.
    pub fn distribution(&self, logits: &[f32]) -> Distribution {
        let c = &self.config;
        let mut l = logits.to_vec();
        for (&id, &b) in &c.logit_bias {
            if let Some(v) = l.get_mut(id as usize) {
                *v += b;
            }
        }
        self.apply_penalties(&mut l);
        if c.temperature <= 0.0 {
            return Distribution::Greedy(argmax(&l));
        }
        // Candidates sorted by logit, best first (ties: lower id first).
        let mut cand: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, &v)| (i as u32, v))
            .collect();
        if cand.is_empty() {
            return Distribution::Greedy(argmax(&l));
        }
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.select_nth_unstable_by(c.top_k - 1, by_logit);
            cand.truncate(c.top_k);
        }
        cand.sort_unstable_by(by_logit);
        let probs = softmax(&cand);
        let mut keep = cand.len();
        if c.top_p < 1.0 {
            // The smallest prefix whose probability reaches top_p (at least one token).
            let mut cum = 0f64;
            for (i, &p) in probs.iter().enumerate() {
                cum += f64::from(p);
                if cum >= f64::from(c.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if c.min_p > 0.0 {
            let floor = probs[0] * c.min_p;
            keep = keep.min(probs.iter().take_while(|&&p| p >= floor).count().max(1));
        }
        cand.truncate(keep);
        for v in cand.iter_mut() {
            v.1 /= c.temperature;
        }
        let probs = softmax(&cand);
        Distribution::Candidates(
            cand.iter()
                .zip(probs)
                .map(|(&(id, _), p)| (id, p))
                .collect(),
        )
    }

    /// Draws from candidates with probabilities (summing to 1).
    pub fn draw(&mut self, cand: &[(u32, f32)]) -> u32 {
        let r = self.uniform();
        let mut cum = 0f64;
        for &(id, p) in cand {
            cum += f64::from(p);
            if r < cum {
                return id;
            }
        }
        cand.last().expect("non-empty").0
    }

    /// A uniform number in [0, 1) from the sampler's generator.
    pub fn uniform(&mut self) -> f64 {
        self.rng.next_f64()
    }

    /// How often each token appears among the recent ones the penalties look at (none
    /// when the penalties are off).
    fn penalty_counts(&self) -> HashMap<u32, u32> {
        let c = &self.config;
        let neutral =
            c.repeat_penalty == 1.0 && c.presence_penalty == 0.0 && c.frequency_penalty == 0.0;
        let mut counts: HashMap<u32, u32> = HashMap::new();
        if neutral || c.penalty_last_n == 0 {
            return counts;
        }
        let start = self.recent.len().saturating_sub(c.penalty_last_n);
        for &id in &self.recent[start..] {
            *counts.entry(id).or_default() += 1;
        }
        counts
    }

    fn apply_penalties(&self, l: &mut [f32]) {
        let c = &self.config;
        for (&id, &n) in &self.penalty_counts() {
            let Some(v) = l.get_mut(id as usize) else {
                continue;
            };
            if *v > 0.0 {
                *v /= c.repeat_penalty;
            } else {
                *v *= c.repeat_penalty;
            }
            *v -= n as f32 * c.frequency_penalty + c.presence_penalty;
        }
    }
}

/// `log softmax(row)[id]`, in f64: a token's log-probability under raw logits.
pub fn log_prob(row: &[f32], id: u32) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let lse = f64::from(max)
        + row
            .iter()
            .map(|&v| f64::from(v - max).exp())
            .sum::<f64>()
            .ln();
    f64::from(row[id as usize]) - lse
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

fn softmax(cand: &[(u32, f32)]) -> Vec<f32> {
    let max = cand.iter().fold(f32::NEG_INFINITY, |m, c| m.max(c.1));
    let e: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let z: f32 = e.iter().sum();
    e.into_iter().map(|x| x / z).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 6] = [2.0, 1.5, 1.0, 0.5, 0.0, -1.0];

    /// Expected probabilities after the filters, computed independently of the sampler.
    fn expected(temp: f32, keep: usize) -> Vec<f64> {
        let e: Vec<f64> = LOGITS[..keep]
            .iter()
            .map(|&l| (f64::from(l) / f64::from(temp)).exp())
            .collect();
        let z: f64 = e.iter().sum();
        let mut p: Vec<f64> = e.iter().map(|x| x / z).collect();
        p.resize(LOGITS.len(), 0.0);
        p
    }

    /// Pearson chi-square of `n` draws against `probs`; fails above the 0.1% critical value.
    fn chi_square(config: SamplerConfig, probs: &[f64]) {
        let n = 40_000;
        let mut s = Sampler::new(config).unwrap();
        let mut counts = vec![0usize; LOGITS.len()];
        for _ in 0..n {
            counts[s.sample(&LOGITS) as usize] += 1;
        }
        let mut chi = 0.0;
        let mut categories = 0;
        for (c, &p) in counts.iter().zip(probs) {
            if p == 0.0 {
                assert_eq!(*c, 0, "a filtered token was drawn: {counts:?}");
                continue;
            }
            let e = p * n as f64;
            chi += (*c as f64 - e).powi(2) / e;
            categories += 1;
        }
        // 0.1% critical values of chi-square for 1..5 degrees of freedom (categories - 1).
        let critical = [10.83, 13.82, 16.27, 18.47, 20.52][categories - 2];
        assert!(
            chi < critical,
            "chi-square {chi:.2} >= {critical} for {counts:?} vs {probs:?}"
        );
    }

    fn plain(temp: f32) -> SamplerConfig {
        SamplerConfig {
            temperature: temp,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 1234,
            ..Default::default()
        }
    }

    #[test]
    fn temperature_shapes_the_distribution() {
        chi_square(plain(1.0), &expected(1.0, 6));
        chi_square(plain(0.5), &expected(0.5, 6));
        chi_square(plain(2.0), &expected(2.0, 6));
    }

    #[test]
    fn top_k_keeps_the_k_best() {
        chi_square(
            SamplerConfig {
                top_k: 3,
                ..plain(1.0)
            },
            &expected(1.0, 3),
        );
    }

    #[test]
    fn top_p_keeps_the_smallest_prefix_reaching_p() {
        // Probabilities at T=1: 0.420 0.255 0.154 0.094 0.057 0.021: 0.75 needs 3 tokens,
        // 0.6 needs 2.
        chi_square(
            SamplerConfig {
                top_p: 0.75,
                ..plain(1.0)
            },
            &expected(1.0, 3),
        );
        chi_square(
            SamplerConfig {
                top_p: 0.6,
                ..plain(1.0)
            },
            &expected(1.0, 2),
        );
    }

    #[test]
    fn min_p_drops_tokens_below_a_share_of_the_best() {
        // p_i / p_0 = exp(l_i - 2): 1, .61, .37, .22, .14, .05 -> min-p 0.2 keeps 4.
        chi_square(
            SamplerConfig {
                min_p: 0.2,
                ..plain(1.0)
            },
            &expected(1.0, 4),
        );
    }

    #[test]
    fn greedy_penalties_bias_and_seeds() {
        let mut s = Sampler::new(plain(0.0)).unwrap();
        assert_eq!(s.sample(&LOGITS), 0);
        let mut bias = HashMap::new();
        bias.insert(3, 10.0);
        let mut s = Sampler::new(SamplerConfig {
            logit_bias: bias,
            ..plain(0.0)
        })
        .unwrap();
        assert_eq!(s.sample(&LOGITS), 3);
        let mut s = Sampler::new(SamplerConfig {
            repeat_penalty: 4.0,
            ..plain(0.0)
        })
        .unwrap();
        s.accept(0);
        assert_eq!(s.sample(&LOGITS), 1, "2.0 / 4 = 0.5 falls below 1.5");
        let mut s = Sampler::new(SamplerConfig {
            presence_penalty: 0.6,
            frequency_penalty: 0.1,
            ..plain(0.0)
        })
        .unwrap();
        s.accept(0);
        assert_eq!(s.sample(&LOGITS), 1, "2.0 - 0.7 = 1.3 < 1.5");

        let draw = |seed| {
            let mut s = Sampler::new(SamplerConfig { seed, ..plain(1.0) }).unwrap();
            (0..50).map(|_| s.sample(&LOGITS)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn invalid_parameters_are_refused() {
        for c in [
            SamplerConfig {
                top_p: 1.5,
                ..Default::default()
            },
            SamplerConfig {
                min_p: -0.1,
                ..Default::default()
            },
            SamplerConfig {
                temperature: f32::NAN,
                ..Default::default()
            },
            SamplerConfig {
                repeat_penalty: 0.0,
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(c).is_err());
        }
    }

    /// The plan a device samples by: the bias and penalty counts per token (ids outside
    /// the vocabulary dropped), the filters, and `None` where top-k is off or too large.
    #[test]
    fn device_plan_lists_what_sample_applies() {
        let mut config = SamplerConfig {
            repeat_penalty: 1.1,
            penalty_last_n: 4,
            ..SamplerConfig::default()
        };
        config.logit_bias.insert(3, 1.0);
        config.logit_bias.insert(9999, 2.0);
        let mut s = Sampler::new(config.clone()).unwrap();
        for t in [1, 2, 2, 3, 5] {
            s.accept(t);
        }
        let plan = s.device_plan(100, 1024).unwrap();
        assert_eq!(plan.adjust, vec![(2, 0.0, 2), (3, 1.0, 1), (5, 0.0, 1)]);
        assert_eq!(plan.repeat_penalty, 1.1);
        assert_eq!(
            plan.filters,
            Some(DeviceFilters {
                top_k: 40,
                top_p: 0.95,
                min_p: 0.05,
                temperature: 0.8
            })
        );
        // Applying the plan by hand gives the logits `sample` filters.
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 - 50.0) / 10.0).collect();
        let mut adjusted = logits.clone();
        for &(id, b, n) in &plan.adjust {
            let v = &mut adjusted[id as usize];
            *v += b;
            if n > 0 {
                *v = if *v > 0.0 { *v / 1.1 } else { *v * 1.1 };
            }
        }
        let mut by_hand = logits.clone();
        by_hand[3] += 1.0;
        s.apply_penalties(&mut by_hand);
        assert_eq!(adjusted, by_hand);

        assert!(s.device_plan(100, 20).is_none(), "top-k 40 above 20");
        let off = Sampler::new(SamplerConfig {
            top_k: 0,
            ..config.clone()
        })
        .unwrap();
        assert!(off.device_plan(100, 1024).is_none(), "top-k off");
        let greedy = Sampler::new(SamplerConfig {
            temperature: 0.0,
            top_k: 0,
            ..config
        })
        .unwrap();
        assert_eq!(greedy.device_plan(100, 1024).unwrap().filters, None);
    }

    /// `peek_uniform` shows the number the next draw takes without taking it.
    #[test]
    fn peek_uniform_is_the_next_draw() {
        let config = SamplerConfig {
            seed: 42,
            ..SamplerConfig::default()
        };
        let mut a = Sampler::new(config.clone()).unwrap();
        let mut b = Sampler::new(config).unwrap();
        let u = a.peek_uniform();
        assert_eq!(a.peek_uniform(), u);
        assert!((0.0..1.0).contains(&u));
        a.sample(&LOGITS);
        assert_ne!(a.peek_uniform(), u);
        b.consume_uniform();
        assert_eq!(a.peek_uniform(), b.peek_uniform());
    }
}
