//! A batch's mixture-of-experts FFN with its tokens grouped by expert: the routing on the
//! device, the (token, expert) pairs sorted into slots by expert and cut into tiles
//! (`moe_group`), gate and up as one grouped tensor-core product each over the experts'
//! tile copies (`qgemm.rs`), the gated activations in f16, the down product grouped the
//! same way, and the weighted sum of each token's experts in choice order. Each expert's
//! weights are read once a tile of up to 64 of its tokens, where the decode kernels read
//! them once a token; nothing waits on the host, so the batch stays asynchronous.

use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use half::f16;

use super::buffers::{GroupedMoe, MoeBuffers};
use super::ops::{self, check};
use super::qgemm::TileMatrix;
use super::qgemm::{n_tiles, qgemm_grouped, ExpertTiles};
use super::weights::{GpuExpertWeights, GpuExperts};
use super::{CudaDevice, CudaError};

/// Whether `x`'s prompt-pass batches take the grouped path: whenever its projections have
/// tile copies, whatever the batch's size, because a token's result must not depend on how
/// many tokens share its batch (a prompt chunk of 5 tokens and one of 500 give each token
/// the same logits; the decode kernels quantize activations to int8, these keep f16).
pub(super) fn grouped(x: &GpuExperts, moe: &MoeBuffers) -> bool {
    moe.grouped.is_some() && [&x.gate, &x.up, &x.down].iter().all(|e| e.tiles.is_some())
}

/// `o (n x n_embd) = the experts' FFN of xh (n x n_embd, normed, f16)`, the router's
/// logits in `moe.router` already. `g`, `u` take the slots' gate and up products, `xh`
/// (consumed) their gated activations.
#[allow(clippy::too_many_arguments)]
pub(super) fn grouped_ffn(
    dev: &CudaDevice,
    x: &GpuExperts,
    xh: &mut CudaSlice<f16>,
    g: &mut CudaSlice<f32>,
    u: &mut CudaSlice<f32>,
    moe: &mut MoeBuffers,
    o: &mut CudaSlice<f32>,
    n: usize,
    gelu: bool,
) -> Result<(), CudaError> {
    let (n_exp, k) = (x.gate.n_expert, x.n_used);
    let (e, f) = (x.gate.n_in, x.gate.n_out);
    fn tiles(w: &GpuExpertWeights) -> &TileMatrix {
        w.tiles.as_ref().expect("checked by grouped()")
    }
    ops::moe_route(
        dev,
        &moe.router,
        &mut moe.ids,
        &mut moe.weights,
        n,
        n_exp,
        k,
        x.normalize,
    )?;
    let pairs = n * k;
    // Tiles of 16, 32 or 64 slots by the mean slots an expert.
    let nt = n_tiles(pairs.div_ceil(n_exp));
    let max_tiles = pairs.div_ceil(8 * nt) + n_exp.min(pairs);
    let gm = moe.grouped.as_mut().expect("checked by grouped()");
    moe_group(dev, &moe.ids, gm, pairs, k, n_exp, 8 * nt)?;
    fn et(gm: &GroupedMoe, max_tiles: usize, nt: usize) -> ExpertTiles<'_> {
        ExpertTiles {
            tiles: &gm.tiles,
            tiles_n: &gm.tiles_n,
            max_tiles,
            nt,
        }
    }
    let xv = xh.slice(..n * e);
    for (w, out) in [(&x.gate, &mut *g), (&x.up, &mut *u)] {
        let idx = Some(&gm.slot_tok);
        qgemm_grouped(dev, tiles(w), &xv, idx, &et(gm, max_tiles, nt), out, pairs)?;
    }
    let (gv, uv) = (g.slice(..), u.slice(..));
    ops::gated_f16(dev, &gv, &uv, f, xh, &mut gm.scale, pairs, f, gelu)?;
    let xv = xh.slice(..pairs * f);
    qgemm_grouped(
        dev,
        tiles(&x.down),
        &xv,
        None,
        &et(gm, max_tiles, nt),
        &mut moe.y,
        pairs,
    )?;
    combine_slots(dev, &moe.y, gm, &moe.weights, o, n, k, e)
}

/// `moe_group`: the pairs of `ids` (n x n_used) sorted into slots by expert, tiles of at
/// most `bn` slots.
fn moe_group(
    dev: &CudaDevice,
    ids: &CudaSlice<i32>,
    gm: &mut GroupedMoe,
    pairs: usize,
    n_used: usize,
    n_exp: usize,
    bn: usize,
) -> Result<(), CudaError> {
    check(
        ids.len() >= pairs
            && gm.slot_tok.len() >= pairs
            && gm.slot_of.len() >= pairs
            && gm.tiles.len() >= 3 * GroupedMoe::max_tiles(pairs, n_exp)
            && bn >= 16
            && n_exp > 0,
        "moe_group: shapes",
    )?;
    let f = dev.function("moe", "moe_group")?;
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1024, 1, 1),
        shared_mem_bytes: (3 * n_exp * 4) as u32,
    };
    let (p, nu, ne, b) = (pairs as i32, n_used as i32, n_exp as i32, bn as i32);
    // SAFETY: sizes checked above; ids come from moe_route (below n_exp).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(ids)
            .arg(&mut gm.slot_tok)
            .arg(&mut gm.slot_of)
            .arg(&mut gm.tiles)
            .arg(&mut gm.tiles_n)
            .arg(&p)
            .arg(&nu)
            .arg(&ne)
            .arg(&b)
            .launch(cfg)?;
    }
    Ok(())
}

/// `out[t] = sum_k weights[t][k] * scale[s] * y[s]`, `s` the slot of (t, k).
#[allow(clippy::too_many_arguments)]
fn combine_slots(
    dev: &CudaDevice,
    y: &CudaSlice<f32>,
    gm: &GroupedMoe,
    weights: &CudaSlice<f32>,
    out: &mut CudaSlice<f32>,
    n_tok: usize,
    n_used: usize,
    n: usize,
) -> Result<(), CudaError> {
    let pairs = n_tok * n_used;
    check(
        y.len() >= pairs * n
            && weights.len() >= pairs
            && gm.slot_of.len() >= pairs
            && gm.scale.len() >= pairs
            && out.len() >= n_tok * n
            && (1..=16).contains(&n_used),
        "moe_combine_slots: shapes",
    )?;
    let f = dev.function("moe", "moe_combine_slots")?;
    let cfg = LaunchConfig {
        grid_dim: (n.div_ceil(256) as u32, n_tok as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (nu, n_i) = (n_used as i32, n as i32);
    // SAFETY: shapes checked above; slot_of holds slots below `pairs` (moe_group).
    unsafe {
        dev.stream
            .launch_builder(&f)
            .arg(y)
            .arg(&gm.slot_of)
            .arg(weights)
            .arg(&gm.scale)
            .arg(out)
            .arg(&nu)
            .arg(&n_i)
            .launch(cfg)?;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    /// `moe_group` for the grouped products' test (qgemm.rs).
    pub(in super::super) fn group(
        dev: &CudaDevice,
        ids: &CudaSlice<i32>,
        gm: &mut GroupedMoe,
        pairs: usize,
        n_used: usize,
        n_exp: usize,
        bn: usize,
    ) {
        moe_group(dev, ids, gm, pairs, n_used, n_exp, bn).unwrap();
    }
}
