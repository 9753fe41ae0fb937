//! The tensor-parallel partition (Megatron-LM's): which rows and columns of each weight
//! matrix rank `r` of `world` holds, checked once for the whole model before any rank
//! starts, and the rank's share of a [`Decoder`] built from views of the same file.
//!
//! - Attention: rank `r` takes query heads `r*H/N ..` and the KV heads they read
//!   (`r*Hkv/N ..`: contiguous query heads share their KV heads, so grouped-query
//!   attention stays within a rank): rows of wq, wk, wv (and their biases). wo takes the
//!   matching columns; each rank's wo product is a partial sum of the output, all-reduced.
//! - FFN: rows of gate and up (columns of the hidden layer), the matching columns of down,
//!   all-reduced. Experts alike, each expert split the same way; the router is replicated.
//! - Output head: the vocabulary's rows in equal shares of `ceil(V/N)` (the last rank's
//!   padded), gathered before sampling. The embedding and the norms are replicated.
//!
//! Row shares of a row-major quantized matrix are free (any row boundary is a block
//! boundary). Column shares (wo, down) must start and end on the quant blocks of the
//! matrix (32 or 256 weights): a model where they would not is refused.
//!
//! KV heads that do not divide by N are refused rather than replicated (vLLM replicates
//! them when N is a multiple of Hkv): replication multiplies the KV cache, which is what
//! limits batch size, and the models this is for (Llama 3 8B/70B: 8 KV heads) divide by
//! 1, 2, 4 and 8.

use std::ops::Range;

use super::ParallelError;
use crate::models::layers::{Decoder, Ffn, Layer};
use crate::models::weights::{Linear, WeightRows};

/// Rank `rank`'s share of `n` items in `world` equal parts (`n` divisible by `world`).
fn share(n: usize, world: usize, rank: usize) -> Range<usize> {
    let per = n / world;
    rank * per..(rank + 1) * per
}

/// Rows of the vocabulary each rank's output head holds, padded: `ceil(V / N)`.
pub fn vocab_share(n_vocab: usize, world: usize) -> usize {
    n_vocab.div_ceil(world)
}

/// The vocabulary rows rank `rank` computes logits for (the last ranks' may be short).
pub fn vocab_range(n_vocab: usize, world: usize, rank: usize) -> Range<usize> {
    let per = vocab_share(n_vocab, world);
    (rank * per).min(n_vocab)..((rank + 1) * per).min(n_vocab)
}

/// Checks that `decoder` splits over `world` ranks; the first reason it does not.
pub fn check(decoder: &Decoder, world: usize) -> Result<(), ParallelError> {
    let hp = &decoder.hp;
    if world == 0 {
        return Err(ParallelError::World(world));
    }
    for (what, n) in [("attention", hp.n_head), ("KV", hp.n_head_kv)] {
        if n % world != 0 {
            return Err(ParallelError::Heads { what, n, world });
        }
    }
    for l in &decoder.layers {
        columns_split(&l.wo, world)?;
        for (gate, down) in ffn_pairs(l) {
            if gate.n_out() % world != 0 {
                return Err(ParallelError::FfnWidth {
                    tensor: gate.name().to_string(),
                    n: gate.n_out(),
                    world,
                });
            }
            columns_split(down, world)?;
        }
    }
    Ok(())
}

/// Each gated FFN of a layer as (gate, down): the dense one, or every expert.
fn ffn_pairs(l: &Layer) -> Vec<(&Linear, &Linear)> {
    match &l.ffn {
        Ffn::Dense { gate, down, .. } => vec![(gate, down)],
        Ffn::Experts { gate, down, .. } => gate.iter().zip(down).collect(),
    }
}

/// Whether `w`'s columns split into `world` shares on its block boundaries.
fn columns_split(w: &Linear, world: usize) -> Result<(), ParallelError> {
    let block = w.ty().block_size();
    let cols = w.n_in() / world;
    if w.n_in() % world != 0 || cols % block != 0 {
        return Err(ParallelError::Blocks {
            tensor: w.name().to_string(),
            ty: w.ty(),
            block,
            n_in: w.n_in(),
            world,
        });
    }
    Ok(())
}

/// Rank `rank`'s share of `decoder` over `world` ranks (checked by [`check`] first): its
/// hyperparameters count its heads and FFN width; `n_vocab` stays the model's (the
/// embedding is whole), its output head holds [`vocab_range`].
pub fn shard(decoder: &Decoder, world: usize, rank: usize) -> Result<Decoder, ParallelError> {
    check(decoder, world)?;
    if rank >= world {
        return Err(ParallelError::Rank { rank, world });
    }
    let hp = &decoder.hp;
    let (dk, dv) = (hp.head_dim_k, hp.head_dim_v);
    let heads = share(hp.n_head, world, rank);
    let kv_heads = share(hp.n_head_kv, world, rank);
    let rows =
        |w: &Linear, heads: &Range<usize>, dim: usize| w.rows(heads.start * dim, heads.len() * dim);
    let slice = |b: &Option<Vec<f32>>, heads: &Range<usize>, dim: usize| {
        b.as_ref()
            .map(|b| b[heads.start * dim..heads.end * dim].to_vec())
    };
    let cols = |w: &Linear| {
        let r = share(w.n_in(), world, rank);
        w.columns(r.start, r.len()).expect("checked by check()")
    };
    let ffn_rows = |w: &Linear| {
        let r = share(w.n_out(), world, rank);
        w.rows(r.start, r.len())
    };
    let layers = decoder
        .layers
        .iter()
        .map(|l| Layer {
            attn_norm: l.attn_norm.clone(),
            wq: rows(&l.wq, &heads, dk),
            wk: rows(&l.wk, &kv_heads, dk),
            wv: rows(&l.wv, &kv_heads, dv),
            bq: slice(&l.bq, &heads, dk),
            bk: slice(&l.bk, &kv_heads, dk),
            bv: slice(&l.bv, &kv_heads, dv),
            // Per-head norms: one weight vector every head shares.
            q_norm: l.q_norm.clone(),
            k_norm: l.k_norm.clone(),
            wo: cols(&l.wo),
            post_attn_norm: l.post_attn_norm.clone(),
            ffn_norm: l.ffn_norm.clone(),
            ffn: match &l.ffn {
                Ffn::Dense { gate, up, down } => Ffn::Dense {
                    gate: ffn_rows(gate),
                    up: ffn_rows(up),
                    down: cols(down),
                },
                Ffn::Experts {
                    router,
                    gate,
                    up,
                    down,
                    n_used,
                    normalize,
                } => Ffn::Experts {
                    router: router.clone(),
                    gate: gate.iter().map(ffn_rows).collect(),
                    up: up.iter().map(ffn_rows).collect(),
                    down: down.iter().map(cols).collect(),
                    n_used: *n_used,
                    normalize: *normalize,
                },
            },
            post_ffn_norm: l.post_ffn_norm.clone(),
            rope: l.rope.clone(),
            window: l.window,
        })
        .collect();
    let vocab = vocab_range(hp.n_vocab, world, rank);
    let mut local = hp.clone();
    local.n_head /= world;
    local.n_head_kv /= world;
    local.n_ff /= world;
    Ok(Decoder {
        hp: local,
        token_embd: decoder.token_embd.clone(),
        embd_scale: decoder.embd_scale,
        layers,
        output_norm: decoder.output_norm.clone(),
        output: decoder.output.rows(vocab.start, vocab.len()),
        activation: decoder.activation,
        attn_scale: decoder.attn_scale,
        final_logit_softcap: decoder.final_logit_softcap,
        exact_activations: decoder.exact_activations,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vocab_shares_cover_the_vocabulary_once() {
        for (v, n) in [(267, 2), (267, 4), (3, 8), (151_936, 8)] {
            let ranges: Vec<_> = (0..n).map(|r| vocab_range(v, n, r)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[n - 1].end, v);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            assert!(ranges.iter().all(|r| r.len() <= vocab_share(v, n)));
        }
        assert_eq!(vocab_range(267, 2, 1), 134..267);
        assert_eq!(vocab_range(3, 8, 5), 3..3);
    }

    #[test]
    fn head_shares_are_contiguous_and_disjoint() {
        assert_eq!(share(32, 4, 0), 0..8);
        assert_eq!(share(32, 4, 3), 24..32);
        assert_eq!(share(8, 4, 2), 4..6);
    }
}
