//! Picking the next token on the device (`cu/sampling.cu`), so that only its id comes
//! back: the greedy pick, and sampling as [`Sampler::sample`] does it (bias, penalties,
//! top-k, top-p, min-p, temperature, and a draw with the host generator's number).

use cudarc::driver::{CudaSlice, PushKernelArg};

use super::ops::{blocks, check, grid_1d};
use super::{CudaDevice, CudaError};
use crate::sampler::DevicePlan;

/// Blocks of the first argmax pass (their partial results live in an [`ArgmaxParts`]).
pub const ARGMAX_BLOCKS: usize = 64;
/// Candidates the sampling kernels keep at most (their top-k): `MAX_CANDIDATES` in the .cu.
pub const MAX_CANDIDATES: usize = 1024;
/// Logits per block of the first sampling stage (`SLICE` in the .cu).
const SLICE: usize = 4096;

/// The partial results of [`argmax`]'s first pass.
pub struct ArgmaxParts {
    values: CudaSlice<f32>,
    indices: CudaSlice<i32>,
}

impl ArgmaxParts {
    pub fn new(dev: &CudaDevice) -> Result<ArgmaxParts, CudaError> {
        Ok(ArgmaxParts {
            values: dev.stream.alloc_zeros(ARGMAX_BLOCKS)?,
            indices: dev.stream.alloc_zeros(ARGMAX_BLOCKS)?,
        })
    }
}

/// The argmax of each of `rows` rows of `n` values of `x` into `out[..rows]`, in one launch.
pub fn argmax_rows(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    rows: usize,
    n: usize,
    out: &mut CudaSlice<i32>,
) -> Result<(), CudaError> {
    check(
        x.len() >= rows * n && n > 0 && rows > 0 && out.len() >= rows,
        "argmax_rows: shapes",
    )?;
    let f = dev.function("sampling", "argmax_rows")?;
    let n_i = n as i32;
    // SAFETY: rows x n values in, rows ids out (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(x)
            .arg(&n_i)
            .arg(out)
            .launch(blocks(rows, 1024))?;
    }
    Ok(())
}

/// The index of the largest of the first `n` values of `x` (the first on ties), into
/// `out` (one i32), in two launches.
pub fn argmax(
    dev: &CudaDevice,
    x: &CudaSlice<f32>,
    n: usize,
    parts: &mut ArgmaxParts,
    out: &mut CudaSlice<i32>,
) -> Result<(), CudaError> {
    check(x.len() >= n && n > 0 && !out.is_empty(), "argmax: shapes")?;
    let partial = dev.function("sampling", "argmax_partial")?;
    let last = dev.function("sampling", "argmax_final")?;
    let cfg = |grid: usize| blocks(grid, 1024);
    let (n_i, parts_i) = (n as i32, ARGMAX_BLOCKS as i32);
    // SAFETY: n values of x; ARGMAX_BLOCKS partials; one output.
    unsafe {
        dev.stream
            .launch_builder(&partial)
            .arg(x)
            .arg(&n_i)
            .arg(&mut parts.values)
            .arg(&mut parts.indices)
            .launch(cfg(ARGMAX_BLOCKS))?;
        dev.stream
            .launch_builder(&last)
            .arg(&parts.values)
            .arg(&parts.indices)
            .arg(&parts_i)
            .arg(out)
            .launch(cfg(1))?;
    }
    Ok(())
}

/// Sets to minus infinity each of the first `n` logits of `x` whose bit in the first
/// `n_words` words of `mask` is clear (token `t`: bit `t % 32` of word `t / 32`; tokens at
/// or past `32 * n_words` are banned), in one launch.
pub fn apply_token_mask(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    n: usize,
    mask: &CudaSlice<u32>,
    n_words: usize,
) -> Result<(), CudaError> {
    check(
        x.len() >= n && n > 0 && mask.len() >= n_words,
        "apply_token_mask: shapes",
    )?;
    let f = dev.function("sampling", "apply_token_mask")?;
    let (n_i, words_i) = (n as i32, n_words as i32);
    // SAFETY: n logits of x, n_words words of mask (checked above).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(x)
            .arg(&n_i)
            .arg(mask)
            .arg(&words_i)
            .launch(grid_1d(n))?;
    }
    Ok(())
}

/// The masks of several rows of `x` (rows of `n` logits) in one launch: `list` holds the
/// `n_rows` row numbers, then `n_rows` masks of `n.div_ceil(32)` words each (token `t` of
/// row `list[j]` stays where bit `t % 32` of word `t / 32` of mask `j` is set).
pub fn apply_token_masks(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    n: usize,
    list: &CudaSlice<u32>,
    n_rows: usize,
) -> Result<(), CudaError> {
    let words = n.div_ceil(32);
    check(
        n > 0 && n_rows > 0 && list.len() >= n_rows * (1 + words),
        "apply_token_masks: shapes",
    )?;
    // The rows are checked on the host side of the copy: the caller's row numbers.
    let f = dev.function("sampling", "apply_token_masks")?;
    let (n_i, rows_i, words_i) = (n as i32, n_rows as i32, words as i32);
    let mut cfg = grid_1d(n);
    cfg.grid_dim.1 = n_rows as u32;
    // SAFETY: the list holds n_rows rows and masks (checked above); every row number is
    // below x.len() / n (the caller's contract, `mask_rows_on_device`).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(x)
            .arg(&n_i)
            .arg(list)
            .arg(&rows_i)
            .arg(&words_i)
            .launch(cfg)?;
    }
    Ok(())
}

/// Bans what `masks` ban in rows `rows` of `x` (rows of `n` logits), uploading them
/// through `list` (grown as needed) in one copy: each mask padded with zero words (tokens
/// past a mask are banned) or cut to the vocabulary's words.
pub fn mask_rows_on_device(
    dev: &CudaDevice,
    x: &mut CudaSlice<f32>,
    n: usize,
    list: &mut CudaSlice<u32>,
    rows: &[usize],
    masks: &[&[u32]],
) -> Result<(), CudaError> {
    let words = n.div_ceil(32);
    check(
        rows.len() == masks.len() && rows.iter().all(|&r| (r + 1) * n <= x.len()),
        "mask_rows_on_device: rows",
    )?;
    if rows.is_empty() {
        return Ok(());
    }
    let mut host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    for m in masks {
        let at = host.len();
        host.resize(at + words, 0);
        let k = m.len().min(words);
        host[at..at + k].copy_from_slice(&m[..k]);
    }
    if list.len() < host.len() {
        *list = dev.stream.alloc_zeros(host.len().next_power_of_two())?;
    }
    dev.stream
        .memcpy_htod(&host, &mut list.slice_mut(..host.len()))?;
    apply_token_masks(dev, x, n, list, rows.len())
}

/// Buffers of the device sampler: the logit adjustments of a step and the result.
pub struct DeviceSampler {
    ids: CudaSlice<i32>,
    bias: CudaSlice<f32>,
    counts: CudaSlice<i32>,
    /// The first stage's candidates: per block of SLICE logits, up to top-k keys and ids,
    /// and how many.
    cand_keys: CudaSlice<u32>,
    cand_ids: CudaSlice<i32>,
    cand_counts: CudaSlice<i32>,
    /// The token, and whether the draw was used.
    out: CudaSlice<i32>,
    parts: ArgmaxParts,
    /// A constrained row's token bitmask (grown to the vocabulary's words at first use).
    mask: CudaSlice<u32>,
}

/// What the device picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DevicePick {
    /// The token, and whether the host's uniform number was used for it.
    Token { id: u32, drew: bool },
    /// No logit is finite: the host sampler decides.
    NoFinite,
}

impl DeviceSampler {
    pub fn new(dev: &CudaDevice) -> Result<DeviceSampler, CudaError> {
        Ok(DeviceSampler {
            ids: dev.stream.alloc_zeros(1)?,
            bias: dev.stream.alloc_zeros(1)?,
            counts: dev.stream.alloc_zeros(1)?,
            cand_keys: dev.stream.alloc_zeros(1)?,
            cand_ids: dev.stream.alloc_zeros(1)?,
            cand_counts: dev.stream.alloc_zeros(1)?,
            out: dev.stream.alloc_zeros(2)?,
            parts: ArgmaxParts::new(dev)?,
            mask: dev.stream.alloc_zeros(1)?,
        })
    }

    /// Sets to minus infinity each of the first `n` logits that `mask` does not allow
    /// (bit `t % 32` of word `t / 32` for token `t`; tokens past the mask's words are not
    /// allowed), as [`crate::constraint::apply_mask`] does on the host: the mask goes up
    /// (n / 8 bytes: 16 KB for 128,256 tokens) and one launch applies it.
    pub fn apply_mask(
        &mut self,
        dev: &CudaDevice,
        logits: &mut CudaSlice<f32>,
        n: usize,
        mask: &[u32],
    ) -> Result<(), CudaError> {
        check(
            logits.len() >= n && n > 0 && !mask.is_empty(),
            "apply_mask: shapes",
        )?;
        if self.mask.len() < mask.len() {
            self.mask = dev.stream.alloc_zeros(mask.len())?;
        }
        dev.stream.memcpy_htod(mask, &mut self.mask)?;
        apply_token_mask(dev, logits, n, &self.mask, mask.len())
    }

    /// Picks from the first `n` logits by `plan` (which may change them), `u` being the
    /// uniform number of the draw.
    pub fn pick(
        &mut self,
        dev: &CudaDevice,
        logits: &mut CudaSlice<f32>,
        n: usize,
        plan: &DevicePlan,
        u: f64,
    ) -> Result<DevicePick, CudaError> {
        check(logits.len() >= n && n > 0, "sample: shapes")?;
        let m = plan.adjust.len();
        if m > 0 {
            check(
                plan.adjust.iter().all(|a| (a.0 as usize) < n),
                "sample: token ids of the adjustments",
            )?;
            if self.ids.len() < m {
                self.ids = dev.stream.alloc_zeros(m.next_power_of_two())?;
                self.bias = dev.stream.alloc_zeros(m.next_power_of_two())?;
                self.counts = dev.stream.alloc_zeros(m.next_power_of_two())?;
            }
            let ids: Vec<i32> = plan.adjust.iter().map(|a| a.0 as i32).collect();
            let bias: Vec<f32> = plan.adjust.iter().map(|a| a.1).collect();
            let counts: Vec<i32> = plan.adjust.iter().map(|a| a.2 as i32).collect();
            dev.stream.memcpy_htod(&ids, &mut self.ids)?;
            dev.stream.memcpy_htod(&bias, &mut self.bias)?;
            dev.stream.memcpy_htod(&counts, &mut self.counts)?;
            let f = dev.function("sampling", "sample_adjust")?;
            let m_i = m as i32;
            // SAFETY: m entries in each list (allocated above), ids below n (checked).
            unsafe {
                dev.stream
                    .launch_builder(&f)
                    .arg(&mut *logits)
                    .arg(&self.ids)
                    .arg(&self.bias)
                    .arg(&self.counts)
                    .arg(&m_i)
                    .arg(&plan.repeat_penalty)
                    .arg(&plan.frequency_penalty)
                    .arg(&plan.presence_penalty)
                    .launch(grid_1d(m))?;
            }
        }
        let Some(fl) = plan.filters else {
            argmax(dev, logits, n, &mut self.parts, &mut self.out)?;
            let out = dev.stream.clone_dtoh(&self.out.slice(..1))?;
            return Ok(DevicePick::Token {
                id: out[0] as u32,
                drew: false,
            });
        };
        check(
            (1..=MAX_CANDIDATES).contains(&fl.top_k) && fl.temperature > 0.0,
            "sample: top-k and temperature",
        )?;
        let n_blocks = n.div_ceil(SLICE);
        let k = fl.top_k;
        if self.cand_keys.len() < n_blocks * k {
            self.cand_keys = dev.stream.alloc_zeros(n_blocks * k)?;
            self.cand_ids = dev.stream.alloc_zeros(n_blocks * k)?;
        }
        if self.cand_counts.len() < n_blocks {
            self.cand_counts = dev.stream.alloc_zeros(n_blocks)?;
        }
        let first = dev.function("sampling", "sample_candidates")?;
        let pick = dev.function("sampling", "sample_pick")?;
        let (n_i, k_i, blocks_i) = (n as i32, k as i32, n_blocks as i32);
        let cfg = |grid: usize| blocks(grid, 1024);
        // SAFETY: n logits; n_blocks x k candidates and n_blocks counts (allocated above);
        // two outputs.
        unsafe {
            dev.stream
                .launch_builder(&first)
                .arg(&*logits)
                .arg(&n_i)
                .arg(&k_i)
                .arg(&mut self.cand_keys)
                .arg(&mut self.cand_ids)
                .arg(&mut self.cand_counts)
                .launch(cfg(n_blocks))?;
            dev.stream
                .launch_builder(&pick)
                .arg(&self.cand_keys)
                .arg(&self.cand_ids)
                .arg(&self.cand_counts)
                .arg(&blocks_i)
                .arg(&k_i)
                .arg(&fl.top_p)
                .arg(&fl.min_p)
                .arg(&fl.temperature)
                .arg(&u)
                .arg(&mut self.out)
                .launch(cfg(1))?;
        }
        let out = dev.stream.clone_dtoh(&self.out)?;
        Ok(if out[0] < 0 {
            DevicePick::NoFinite
        } else {
            DevicePick::Token {
                id: out[0] as u32,
                drew: out[1] != 0,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::matvec::tests::lcg;
    use super::*;
    use crate::sampler::{Sampler, SamplerConfig};

    /// The device's token mask against the host's (`constraint::apply_mask`) on fresh
    /// random logits and masks (dense, sparse, a single token, masks shorter than the
    /// vocabulary), then the greedy pick and the sampled pick after each against the CPU's
    /// on the masked logits: same values (exactly: -inf or untouched), same tokens, and
    /// every pick an allowed token.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_token_masks_of_rows_match_the_cpu_masking() {
        use crate::constraint::apply_mask;
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 17u64;
        let mut rnd = |m: u64| lcg(&mut seed) % m;
        let mut list = dev.stream.alloc_zeros::<u32>(1).unwrap();
        let mut best = dev.stream.alloc_zeros::<i32>(64).unwrap();
        for case in 0..24 {
            let n = [1000usize, 32000, 128256, 151936][case % 4];
            let n_rows = 1 + rnd(64) as usize;
            let logits: Vec<f32> = (0..n_rows * n)
                .map(|_| rnd(1_000_000) as f32 / 1e5 - 5.0)
                .collect();
            // Some rows masked, with masks of every length: the vocabulary's words, fewer
            // (the rest banned), more (cut).
            let rows: Vec<usize> = (0..n_rows).filter(|_| rnd(3) != 0).collect();
            let masks: Vec<Vec<u32>> = rows
                .iter()
                .map(|_| {
                    let words = (n.div_ceil(32) as i64 + rnd(7) as i64 - 3).max(1) as usize;
                    let mut m: Vec<u32> = (0..words).map(|_| rnd(1 << 32) as u32).collect();
                    m[0] |= 1;
                    m
                })
                .collect();
            let mut want = logits.clone();
            for (&r, m) in rows.iter().zip(&masks) {
                apply_mask(&mut want[r * n..(r + 1) * n], m);
            }
            let mut ld = dev.stream.clone_htod(&logits).unwrap();
            let refs: Vec<&[u32]> = masks.iter().map(Vec::as_slice).collect();
            mask_rows_on_device(&dev, &mut ld, n, &mut list, &rows, &refs).unwrap();
            let got = dev.stream.clone_dtoh(&ld).unwrap();
            assert!(
                want.iter()
                    .zip(&got)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "case {case}: {n_rows} rows of {n}, {} masked: logits differ",
                rows.len()
            );
            argmax_rows(&dev, &ld, n_rows, n, &mut best).unwrap();
            let got = dev.stream.clone_dtoh(&best).unwrap();
            for r in 0..n_rows {
                let w = crate::sampler::argmax(&want[r * n..(r + 1) * n]);
                assert_eq!(got[r] as u32, w, "case {case}: row {r}'s greedy pick");
            }
        }
        // A row past the logits is refused before anything runs.
        let mut ld = dev.stream.alloc_zeros::<f32>(2 * 1000).unwrap();
        let m = [u32::MAX; 32];
        assert!(mask_rows_on_device(&dev, &mut ld, 1000, &mut list, &[2], &[&m]).is_err());
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_argmax_rows_picks_the_first_largest() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 23u64;
        let mut rnd = |m: u64| lcg(&mut seed) % m;
        // Lengths below a block, around one turn of the kernel's 16 x 1024 loads, and
        // vocabularies; values from a small set so that the largest is often tied.
        for (case, &n) in [1usize, 7, 1023, 16_383, 16_384, 16_385, 32_000, 151_936]
            .iter()
            .enumerate()
        {
            let rows = 1 + case % 5 * 4;
            let mut x: Vec<f32> = (0..rows * n).map(|_| rnd(50) as f32 - 25.0).collect();
            for r in 0..rows {
                let row = &mut x[r * n..(r + 1) * n];
                match r % 4 {
                    // The largest at both ends of the row: the first wins.
                    1 => {
                        row[0] = 100.0;
                        row[n - 1] = 100.0;
                    }
                    // NaN is never the pick; an all-NaN row gives 0, as all -inf does.
                    2 if n > 2 => row[n / 2] = f32::NAN,
                    3 => row.fill(if case % 2 == 0 {
                        f32::NAN
                    } else {
                        f32::NEG_INFINITY
                    }),
                    _ => {}
                }
            }
            let want: Vec<i32> = x
                .chunks(n)
                .map(|row| {
                    let mut at = None::<usize>;
                    for (i, &v) in row.iter().enumerate() {
                        if !v.is_nan() && at.is_none_or(|a| v > row[a]) {
                            at = Some(i);
                        }
                    }
                    at.unwrap_or(0) as i32
                })
                .collect();
            let xd = dev.stream.clone_htod(&x).unwrap();
            let mut best = dev.stream.alloc_zeros::<i32>(rows).unwrap();
            argmax_rows(&dev, &xd, rows, n, &mut best).unwrap();
            let got = dev.stream.clone_dtoh(&best).unwrap();
            assert_eq!(got, want, "{rows} rows of {n}");
        }
        let xd = dev.stream.alloc_zeros::<f32>(100).unwrap();
        let mut best = dev.stream.alloc_zeros::<i32>(2).unwrap();
        assert!(
            argmax_rows(&dev, &xd, 2, 51, &mut best).is_err(),
            "rows past x"
        );
        assert!(
            argmax_rows(&dev, &xd, 3, 10, &mut best).is_err(),
            "rows past out"
        );
    }

    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_token_mask_matches_the_cpu_masking() {
        use crate::constraint::{allows, apply_mask};
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 11u64;
        let mut ds = DeviceSampler::new(&dev).unwrap();
        let mut parts = ArgmaxParts::new(&dev).unwrap();
        let mut best = dev.stream.alloc_zeros::<i32>(1).unwrap();
        let mut rnd = |m: u64| lcg(&mut seed) % m;
        for case in 0..120 {
            let n = [1000usize, 32000, 128256, 151936][case % 4];
            let logits: Vec<f32> = (0..n).map(|_| rnd(1_000_000) as f32 / 1e5 - 5.0).collect();
            // Words for the whole vocabulary or fewer (the rest banned).
            let n_words = match case % 5 {
                4 => n.div_ceil(32) - 3,
                _ => n.div_ceil(32),
            };
            // Allowed tokens are below n: at least one logit stays finite.
            let mut mask = vec![0u32; n_words];
            match case % 3 {
                0 => mask.iter_mut().for_each(|w| *w = rnd(1 << 32) as u32 | 1),
                1 => {
                    for _ in 0..1 + rnd(50) {
                        let t = rnd(n.min(n_words * 32) as u64) as usize;
                        mask[t / 32] |= 1 << (t % 32);
                    }
                }
                _ => {
                    let t = rnd(n.min(n_words * 32) as u64) as usize;
                    mask[t / 32] |= 1 << (t % 32);
                }
            }
            let mut want = logits.clone();
            apply_mask(&mut want, &mask);
            let mut ld = dev.stream.clone_htod(&logits).unwrap();
            ds.apply_mask(&dev, &mut ld, n, &mask).unwrap();
            let got = dev.stream.clone_dtoh(&ld).unwrap();
            let same = want
                .iter()
                .zip(&got)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "case {case}: n {n}, {n_words} words: masked logits differ"
            );
            // The greedy pick on the masked logits.
            argmax(&dev, &ld, n, &mut parts, &mut best).unwrap();
            let g = dev.stream.clone_dtoh(&best).unwrap()[0] as usize;
            if want.iter().any(|v| v.is_finite()) {
                assert_eq!(
                    g as u32,
                    crate::sampler::argmax(&want),
                    "case {case}: greedy"
                );
                assert!(allows(&mask, g), "case {case}: greedy pick {g} not allowed");
            }
            // A sampled pick on the masked logits, as the engine's device path does it.
            let config = SamplerConfig {
                temperature: 0.8,
                top_k: 40,
                seed: case as u64,
                ..SamplerConfig::default()
            };
            let mut cpu = Sampler::new(config.clone()).unwrap();
            let gpu = Sampler::new(config).unwrap();
            let want_tok = cpu.sample(&want);
            let plan = gpu.device_plan(n, MAX_CANDIDATES).expect("a device plan");
            let mut ld = dev.stream.clone_htod(&logits).unwrap();
            ds.apply_mask(&dev, &mut ld, n, &mask).unwrap();
            let u = gpu.peek_uniform();
            let got_tok = match ds.pick(&dev, &mut ld, n, &plan, u).unwrap() {
                DevicePick::Token { id, .. } => id,
                DevicePick::NoFinite => panic!("case {case}: an allowed token is finite"),
            };
            assert_eq!(got_tok, want_tok, "case {case}: sampled");
            assert!(
                allows(&mask, got_tok as usize),
                "case {case}: sampled pick not allowed"
            );
        }
        // A mask of no words is an error, not a launch.
        let mut ld = dev.stream.alloc_zeros::<f32>(1000).unwrap();
        assert!(ds.apply_mask(&dev, &mut ld, 1000, &[]).is_err());
    }

    /// The device sampler against the CPU sampler on the same logits, recent tokens and
    /// seed: fresh random logits (ties, banned and NaN logits among them), every filter,
    /// bias and penalties, and the cases with more equal logits than places and with no
    /// finite logit. Both must pick the same token and use the same random numbers.
    #[test]
    #[ignore = "needs an NVIDIA GPU"]
    fn gpu_sampling_matches_the_cpu_sampler() {
        let dev = CudaDevice::new(0).expect("GPU");
        let mut seed = 5u64;
        let mut ds = DeviceSampler::new(&dev).unwrap();
        let mut rnd = |m: u64| lcg(&mut seed) % m;
        let mut drew = 0;
        let mut timings = Vec::new();
        for case in 0..400 {
            let n = [1000usize, 32000, 128256][case % 3];
            // Logits on a coarse grid (many ties) or spread; some banned, some NaN.
            let coarse = case % 4 == 0;
            let mut logits: Vec<f32> = (0..n)
                .map(|_| {
                    let r = rnd(1_000_000) as f32 / 1e5 - 5.0;
                    if coarse {
                        r.round()
                    } else {
                        r
                    }
                })
                .collect();
            for _ in 0..rnd(20) {
                logits[rnd(n as u64) as usize] = f32::NEG_INFINITY;
            }
            if case % 7 == 0 {
                logits[rnd(n as u64) as usize] = f32::NAN;
            }
            if case == 5 {
                logits.iter_mut().for_each(|v| *v = 1.0); // every logit equal
            }
            if case == 6 {
                logits.iter_mut().for_each(|v| *v = f32::NEG_INFINITY); // none finite
            }
            let mut config = SamplerConfig {
                temperature: [0.0, 0.3, 0.8, 1.5][rnd(4) as usize],
                top_k: [1usize, 2, 40, 100, 1024][rnd(5) as usize],
                top_p: [1.0, 0.95, 0.5][rnd(3) as usize],
                min_p: [0.0, 0.05, 0.3][rnd(3) as usize],
                repeat_penalty: [1.0, 1.1, 1.5][rnd(3) as usize],
                presence_penalty: [0.0, 0.5][rnd(2) as usize],
                frequency_penalty: [0.0, 0.25][rnd(2) as usize],
                penalty_last_n: 64,
                seed: case as u64,
                ..SamplerConfig::default()
            };
            for _ in 0..rnd(4) {
                let b = [-1e30f32, -2.0, 3.0, f32::NEG_INFINITY][rnd(4) as usize];
                config.logit_bias.insert(rnd(n as u64 + 10) as u32, b);
            }
            let mut cpu = Sampler::new(config.clone()).unwrap();
            let mut gpu = Sampler::new(config).unwrap();
            for _ in 0..rnd(100) {
                let t = rnd(n as u64 / 10 + 1) as u32;
                cpu.accept(t);
                gpu.accept(t);
            }
            let want = cpu.sample(&logits);
            let plan = gpu
                .device_plan(n, MAX_CANDIDATES)
                .expect("top-k within the device's");
            let u = gpu.peek_uniform();
            let mut ld = dev.stream.clone_htod(&logits).unwrap();
            let start = std::time::Instant::now();
            let got = match ds.pick(&dev, &mut ld, n, &plan, u).unwrap() {
                DevicePick::Token { id, drew: d } => {
                    if d {
                        gpu.consume_uniform();
                        drew += 1;
                    }
                    id
                }
                DevicePick::NoFinite => {
                    crate::sampler::argmax(&dev.stream.clone_dtoh(&ld).unwrap())
                }
            };
            if n == 128256 && plan.adjust.is_empty() && plan.filters.is_some() {
                timings.push(start.elapsed().as_secs_f64() * 1e6);
            }
            assert_eq!(got, want, "case {case}: n {n}, plan {plan:?}");
            assert_eq!(
                gpu.peek_uniform(),
                cpu.peek_uniform(),
                "case {case}: random numbers used differently"
            );
        }
        assert!(drew > 100, "too few draws exercised: {drew}");
        timings.sort_by(f64::total_cmp);
        if !timings.is_empty() {
            eprintln!(
                "device sampling over 128256 logits, with the copy of the result: median {:.0} us",
                timings[timings.len() / 2]
            );
        }
        // A bad plan is an error, not a launch.
        let bad = DevicePlan {
            adjust: vec![(5000, 1.0, 0)],
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            filters: None,
        };
        let mut ld = dev.stream.alloc_zeros::<f32>(1000).unwrap();
        assert!(ds.pick(&dev, &mut ld, 1000, &bad, 0.5).is_err());
    }
}
