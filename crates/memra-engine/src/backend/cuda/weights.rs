//! The model's weights on the GPU: every matrix uploaded in its quantized form (Q8_0 and
//! Q6_K regrouped for 16-byte loads, `matvec::upload_weights`), norms and biases as f32,
//! each mixture-of-experts projection's experts in one buffer; where memory allows, the
//! GEMMs' matrices also dequantized to f16 once ([`GpuWeights::keep_f16`]).

use cudarc::driver::CudaSlice;
use half::f16;

use super::buffers::{gemm_chunk_rows, GEMM_SCRATCH};
use super::matvec::{supported, upload_weights, ExpertWeights};
use super::ops::{self, check_shape, AttentionShape, DeviceRope};
use super::qgemm::{repack, HostTiles, TileMatrix};
use super::{CudaDevice, CudaError};
use crate::models::layers::{Decoder, Ffn};
use crate::models::rope::RopeLayout;
use crate::models::weights::{Linear, WeightRows};

pub(super) struct GpuLinear {
    pub(super) w: CudaSlice<u8>,
    pub(super) ty: memra_gguf::GgmlType,
    pub(super) n_in: usize,
    pub(super) n_out: usize,
    /// The matrix dequantized to f16 once, for the GEMMs of prompts and many decodes
    /// (which otherwise dequantize it into a scratch buffer at every batch).
    pub(super) f16: Option<CudaSlice<f16>>,
    /// Its f16 copy is rows of its layer's `qkv16` instead (q, k or v).
    pub(super) in_qkv: bool,
    /// The matrix in the tile layout, for the products of decode steps of a few dozen
    /// rows ([`GpuWeights::keep_dense_tiles`]).
    pub(super) tiles: Option<Box<TileMatrix>>,
}

impl GpuLinear {
    pub(super) fn row_bytes(&self) -> usize {
        self.ty
            .row_bytes(self.n_in as u64)
            .expect("checked at upload") as usize
    }

    /// Whether the GEMMs find the matrix in f16 (an F16 matrix, or an f16 copy): no
    /// dequantization into the scratch buffer.
    pub(super) fn has_f16(&self) -> bool {
        self.f16.is_some() || self.in_qkv || self.ty == memra_gguf::GgmlType::F16
    }

    /// Bytes an f16 copy takes (none for a matrix that is f16 already).
    fn f16_bytes(&self) -> usize {
        match self.ty {
            memra_gguf::GgmlType::F16 => 0,
            _ => 2 * self.n_in * self.n_out,
        }
    }
}

pub(super) struct GpuLayer {
    pub(super) attn_norm: CudaSlice<f32>,
    pub(super) wq: GpuLinear,
    pub(super) wk: GpuLinear,
    pub(super) wv: GpuLinear,
    pub(super) bq: Option<CudaSlice<f32>>,
    pub(super) bk: Option<CudaSlice<f32>>,
    pub(super) bv: Option<CudaSlice<f32>>,
    /// bq, bk and bv side by side (zeros for one a layer lacks), for the fused products'
    /// rows; None where the layer has none.
    pub(super) bqkv: Option<CudaSlice<f32>>,
    pub(super) q_norm: Option<CudaSlice<f32>>,
    pub(super) k_norm: Option<CudaSlice<f32>>,
    pub(super) wo: GpuLinear,
    pub(super) post_attn_norm: Option<CudaSlice<f32>>,
    pub(super) ffn_norm: CudaSlice<f32>,
    pub(super) ffn: GpuFfn,
    pub(super) post_ffn_norm: Option<CudaSlice<f32>>,
    pub(super) rope: DeviceRope,
    pub(super) attn: AttentionShape,
    /// f16 copies of wq, wk and wv as one matrix (their rows in that order), which one GEMM
    /// multiplies: cuBLAS ran k and v (1024 x 4096 for an 8B) alone at a third of a TB/s
    /// for batches of 2 to 256 rows (docs/cuda.md).
    pub(super) qkv16: Option<CudaSlice<f16>>,
    /// q, k and v in the tile layout for the decode steps that go through it, their rows in
    /// that order, one matrix for each run of them that shares a layout (all three in one
    /// where v's type is q's; empty without tile copies): a launch each, whose rows are
    /// 11-12 us on the H100 at 16 tokens whatever their size below a few thousand.
    pub(super) qkv_tiles: Vec<TileMatrix>,
    /// A dense FFN's gate and up likewise (their rows side by side in the products' rows).
    pub(super) gate_up_tiles: Vec<TileMatrix>,
}

pub(super) enum GpuFfn {
    Dense {
        gate: GpuLinear,
        up: GpuLinear,
        down: GpuLinear,
    },
    Experts(GpuExperts),
}

/// A mixture-of-experts FFN: the router, and each projection's experts in one buffer.
pub(super) struct GpuExperts {
    pub(super) router: GpuLinear,
    pub(super) gate: GpuExpertWeights,
    pub(super) up: GpuExpertWeights,
    pub(super) down: GpuExpertWeights,
    pub(super) n_used: usize,
    pub(super) normalize: bool,
}

pub(super) struct GpuExpertWeights {
    pub(super) w: CudaSlice<u8>,
    pub(super) ty: memra_gguf::GgmlType,
    pub(super) n_in: usize,
    pub(super) n_out: usize,
    pub(super) n_expert: usize,
    /// The experts in the tile layout, for the grouped products of batches
    /// ([`GpuWeights::keep_expert_tiles`]); boxed to keep the FFN enum's variants alike.
    pub(super) tiles: Option<Box<TileMatrix>>,
}

impl GpuExpertWeights {
    pub(super) fn view(&self) -> ExpertWeights<'_> {
        ExpertWeights {
            w: &self.w,
            ty: self.ty,
            n_in: self.n_in,
            n_out: self.n_out,
            n_expert: self.n_expert,
        }
    }
}

impl GpuFfn {
    /// Width of the gated activations of one token (all chosen experts').
    pub(super) fn width(&self) -> usize {
        match self {
            GpuFfn::Dense { gate, .. } => gate.n_out,
            GpuFfn::Experts(x) => x.n_used * x.gate.n_out,
        }
    }

    pub(super) fn experts(&self) -> Option<&GpuExperts> {
        match self {
            GpuFfn::Experts(x) => Some(x),
            GpuFfn::Dense { .. } => None,
        }
    }
}

/// Every weight of a decoder on the device.
pub(super) struct GpuWeights {
    pub(super) layers: Vec<GpuLayer>,
    pub(super) token_embd: GpuLinear,
    pub(super) output_norm: CudaSlice<f32>,
    pub(super) output: GpuLinear,
    /// Device bytes of the matrices, and of the norms, biases and rope factors.
    pub(super) matrix_bytes: usize,
    pub(super) small_bytes: usize,
    /// Device bytes of the f16 copies ([`GpuWeights::keep_f16`]) and of the experts' tile
    /// copies ([`GpuWeights::keep_expert_tiles`]).
    pub(super) f16_bytes: usize,
    pub(super) tile_bytes: usize,
}

impl GpuWeights {
    /// Whether every matrix of a decode step has tensor-core kernels (`matvec::mmq_supported`),
    /// so that a step takes up to `MAX_DECODE_ROWS` sequences; expert layers go through the
    /// expert mat-vec kernels, up to `MAX_MATVEC_ROWS`.
    pub(super) fn tensor_core_decode(&self) -> bool {
        let ok = |l: &GpuLinear| super::matvec::mmq_supported(l.ty, l.n_in);
        ok(&self.output)
            && self.layers.iter().all(|l| {
                let ffn = match &l.ffn {
                    GpuFfn::Dense { gate, up, down } => ok(gate) && ok(up) && ok(down),
                    GpuFfn::Experts(_) => false,
                };
                ffn && ok(&l.wq) && ok(&l.wk) && ok(&l.wv) && ok(&l.wo)
            })
    }
}

/// Bytes of `model`'s matrices in the file (what the upload will take).
pub(super) fn matrix_bytes(model: &Decoder) -> usize {
    let mut weight_bytes = model.output.byte_len() + model.token_embd.byte_len();
    for l in &model.layers {
        weight_bytes += [&l.wq, &l.wk, &l.wv, &l.wo]
            .iter()
            .map(|w| w.byte_len())
            .sum::<usize>();
        weight_bytes += match &l.ffn {
            Ffn::Dense { gate, up, down } => gate.byte_len() + up.byte_len() + down.byte_len(),
            Ffn::Experts {
                router,
                gate,
                up,
                down,
                ..
            } => {
                router.byte_len()
                    + [gate, up, down]
                        .iter()
                        .flat_map(|e| e.iter())
                        .map(|l| l.byte_len())
                        .sum::<usize>()
            }
        };
    }
    weight_bytes
}

impl GpuWeights {
    /// Uploads `model`: its matrices if every type has kernels and rows are multiples of
    /// 32 weights, else a clear error before anything large is allocated.
    pub(super) fn upload(dev: &CudaDevice, model: &Decoder) -> Result<GpuWeights, CudaError> {
        let mut small = 0usize;
        let mut up_f32 = |v: &[f32]| -> Result<CudaSlice<f32>, CudaError> {
            small += 4 * v.len();
            Ok(dev.stream.clone_htod(v)?)
        };
        let mut linears = 0usize;
        let mut expert_bytes = 0usize;
        let mut upload = |l: &Linear| -> Result<GpuLinear, CudaError> {
            if !supported(l.ty()) {
                return Err(CudaError::Unsupported {
                    op: "matvec",
                    ty: l.ty(),
                });
            }
            if l.n_in() % 32 != 0 {
                return Err(CudaError::Invalid(format!(
                    "rows of {} weights (the kernels take multiples of 32)",
                    l.n_in()
                )));
            }
            linears += l.byte_len();
            Ok(GpuLinear {
                w: upload_weights(dev, &l.packed(), l.ty(), l.n_in())?,
                ty: l.ty(),
                n_in: l.n_in(),
                n_out: l.n_out(),
                f16: None,
                in_qkv: false,
                tiles: None,
            })
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let ffn = match &l.ffn {
                Ffn::Dense { gate, up, down } => GpuFfn::Dense {
                    gate: upload(gate)?,
                    up: upload(up)?,
                    down: upload(down)?,
                },
                Ffn::Experts {
                    router,
                    gate,
                    up,
                    down,
                    n_used,
                    normalize,
                } => {
                    // Each projection's experts, one after the other, in one buffer.
                    let mut experts = |e: &[Linear]| -> Result<GpuExpertWeights, CudaError> {
                        let ty = e[0].ty();
                        if !supported(ty) {
                            return Err(CudaError::Unsupported {
                                op: "expert matvec",
                                ty,
                            });
                        }
                        let bytes = experts_bytes(e);
                        expert_bytes += bytes.len();
                        Ok(GpuExpertWeights {
                            w: upload_weights(dev, &bytes, ty, e[0].n_in())?,
                            ty,
                            n_in: e[0].n_in(),
                            n_out: e[0].n_out(),
                            n_expert: e.len(),
                            tiles: None,
                        })
                    };
                    let (gate, up, down) = (experts(gate)?, experts(up)?, experts(down)?);
                    GpuFfn::Experts(GpuExperts {
                        router: upload(router)?,
                        gate,
                        up,
                        down,
                        n_used: *n_used,
                        normalize: *normalize,
                    })
                }
            };
            type Upload<'a> = dyn FnMut(&[f32]) -> Result<CudaSlice<f32>, CudaError> + 'a;
            let opt = |v: &Option<Vec<f32>>, up: &mut Upload| v.as_deref().map(up).transpose();
            let attn = model.attention_shape(l);
            check_shape(&attn)?;
            layers.push(GpuLayer {
                attn_norm: up_f32(&l.attn_norm)?,
                wq: upload(&l.wq)?,
                wk: upload(&l.wk)?,
                wv: upload(&l.wv)?,
                bq: opt(&l.bq, &mut up_f32)?,
                bk: opt(&l.bk, &mut up_f32)?,
                bv: opt(&l.bv, &mut up_f32)?,
                bqkv: match (&l.bq, &l.bk, &l.bv) {
                    (None, None, None) => None,
                    (bq, bk, bv) => {
                        let mut b = Vec::new();
                        for (bias, w) in [(bq, &l.wq), (bk, &l.wk), (bv, &l.wv)] {
                            match bias {
                                Some(v) => b.extend_from_slice(v),
                                None => b.resize(b.len() + w.n_out(), 0.0),
                            }
                        }
                        Some(up_f32(&b)?)
                    }
                },
                q_norm: opt(&l.q_norm, &mut up_f32)?,
                k_norm: opt(&l.k_norm, &mut up_f32)?,
                wo: upload(&l.wo)?,
                post_attn_norm: opt(&l.post_attn_norm, &mut up_f32)?,
                ffn_norm: up_f32(&l.ffn_norm)?,
                ffn,
                post_ffn_norm: opt(&l.post_ffn_norm, &mut up_f32)?,
                rope: DeviceRope {
                    halves: l.rope.layout == RopeLayout::Halves,
                    n_dims: l.rope.n_dims,
                    base: l.rope.base,
                    freq_scale: l.rope.freq_scale,
                    freq_factors: opt(&l.rope.freq_factors, &mut up_f32)?,
                },
                attn,
                qkv16: None,
                qkv_tiles: Vec::new(),
                gate_up_tiles: Vec::new(),
            });
        }
        let output_norm = up_f32(&model.output_norm)?;
        let output = upload(&model.output)?;
        let token_embd = upload(&model.token_embd)?;
        Ok(GpuWeights {
            layers,
            token_embd,
            output_norm,
            output,
            matrix_bytes: linears + expert_bytes,
            small_bytes: small,
            f16_bytes: 0,
            tile_bytes: 0,
        })
    }

    /// The matrices the GEMMs multiply (every layer's projections, the experts' router and
    /// the output head; not the token embeddings, which are gathered, nor the experts,
    /// which go through the decode kernels).
    fn gemm_matrices(&mut self) -> impl Iterator<Item = &mut GpuLinear> {
        self.layers
            .iter_mut()
            .flat_map(|l| {
                let mut m = vec![&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo];
                match &mut l.ffn {
                    GpuFfn::Dense { gate, up, down } => m.extend([gate, up, down]),
                    GpuFfn::Experts(x) => m.push(&mut x.router),
                }
                m
            })
            .chain([&mut self.output])
    }

    /// Bytes that f16 copies of the GEMMs' matrices would take.
    pub(super) fn f16_copy_bytes(&mut self) -> usize {
        self.gemm_matrices().map(|w| w.f16_bytes()).sum()
    }

    /// Dequantizes every GEMM matrix to f16 and keeps the copies, so that a batch's GEMMs
    /// read 2 bytes a weight once instead of dequantizing (read 0.6, write and read 2)
    /// first: on the H200 that is the whole cost of a many-decode step (docs/cuda.md).
    pub(super) fn keep_f16(&mut self, dev: &CudaDevice) -> Result<(), CudaError> {
        let mut bytes = 0;
        // q, k and v in one copy where none is f16 already.
        for l in &mut self.layers {
            let qkv = [&mut l.wq, &mut l.wk, &mut l.wv];
            let n_in = qkv[0].n_in;
            if qkv
                .iter()
                .any(|w| w.f16_bytes() == 0 || w.n_in != n_in || w.has_f16())
            {
                continue;
            }
            let rows: usize = qkv.iter().map(|w| w.n_out).sum();
            let mut dq = dev.stream.alloc_zeros::<f16>(rows * n_in)?;
            let mut at = 0;
            for w in qkv {
                let mut out = dq.slice_mut(at * n_in..(at + w.n_out) * n_in);
                dequantize_rows_f16(dev, w, &mut out)?;
                at += w.n_out;
                bytes += w.f16_bytes();
                w.in_qkv = true;
            }
            l.qkv16 = Some(dq);
        }
        for w in self.gemm_matrices() {
            if w.f16_bytes() == 0 || w.has_f16() {
                continue;
            }
            let mut dq = dev.stream.alloc_zeros::<f16>(w.n_out * w.n_in)?;
            dequantize_rows_f16(dev, w, &mut dq.slice_mut(..))?;
            bytes += w.f16_bytes();
            w.f16 = Some(dq);
        }
        self.f16_bytes += bytes;
        Ok(())
    }
}

impl GpuWeights {
    /// Bytes the experts' tile copies would take (4 bits a level for the types whose levels
    /// span 16 values, else 8; f16 scale pairs per 32).
    pub(super) fn expert_tile_bytes(&self) -> usize {
        let experts = self.layers.iter().filter_map(|l| l.ffn.experts());
        experts
            .flat_map(|x| [&x.gate, &x.up, &x.down])
            .map(|e| tile_bytes(e.ty, e.n_expert, e.n_out, e.n_in))
            .sum()
    }

    /// Copies every expert projection into the tile layout of the grouped products
    /// (`qgemm.rs`), from the file's blocks; a projection the layout cannot take keeps none
    /// (its batches go through the decode kernels).
    pub(super) fn keep_expert_tiles(
        &mut self,
        dev: &CudaDevice,
        model: &Decoder,
    ) -> Result<(), CudaError> {
        for (l, ml) in self.layers.iter_mut().zip(&model.layers) {
            let (GpuFfn::Experts(x), Ffn::Experts { gate, up, down, .. }) = (&mut l.ffn, &ml.ffn)
            else {
                continue;
            };
            for (e, src) in [(&mut x.gate, gate), (&mut x.up, up), (&mut x.down, down)] {
                let bytes = experts_bytes(src);
                if let Some(h) = repack(e.ty, &bytes, e.n_in, e.n_out, e.n_expert) {
                    let t = TileMatrix::upload(dev, &h)?;
                    self.tile_bytes += t.bytes();
                    e.tiles = Some(Box::new(t));
                }
            }
        }
        Ok(())
    }
}

impl GpuWeights {
    /// Bytes the dense matrices' tile copies would take (as [`Self::expert_tile_bytes`]):
    /// every layer's projections and the output head.
    pub(super) fn dense_tile_bytes(&self) -> usize {
        let dense = |w: &GpuLinear| match w.ty {
            memra_gguf::GgmlType::F16 | memra_gguf::GgmlType::F32 => 0,
            ty => tile_bytes(ty, 1, w.n_out, w.n_in),
        };
        let layers = self.layers.iter().map(|l| {
            let ffn = match &l.ffn {
                GpuFfn::Dense { gate, up, down } => dense(gate) + dense(up) + dense(down),
                GpuFfn::Experts(_) => 0,
            };
            ffn + [&l.wq, &l.wk, &l.wv, &l.wo]
                .map(dense)
                .iter()
                .sum::<usize>()
        });
        layers.sum::<usize>() + dense(&self.output)
    }

    /// Copies every layer's dense projections and the output head into the tile layout
    /// (`qgemm.rs`) from the file's blocks, for the decode steps of a few dozen rows: read
    /// once for all rows at 0.6-1.2 bytes a weight, where the int8 kernels take 16 rows a
    /// pass and the f16 copies read 2 bytes. A matrix the layout cannot take keeps none.
    pub(super) fn keep_dense_tiles(
        &mut self,
        dev: &CudaDevice,
        model: &Decoder,
    ) -> Result<(), CudaError> {
        let mut keep = |g: &mut GpuLinear, l: &Linear| -> Result<(), CudaError> {
            if let Some(h) = repack(g.ty, &l.packed(), g.n_in, g.n_out, 1) {
                let t = TileMatrix::upload(dev, &h)?;
                self.tile_bytes += t.bytes();
                g.tiles = Some(Box::new(t));
            }
            Ok(())
        };
        let mut fused_bytes = 0;
        for (g, m) in self.layers.iter_mut().zip(&model.layers) {
            g.qkv_tiles = fused_runs(dev, &[(&g.wq, &m.wq), (&g.wk, &m.wk), (&g.wv, &m.wv)])?;
            keep(&mut g.wo, &m.wo)?;
            if let (
                GpuFfn::Dense { gate, up, down },
                Ffn::Dense {
                    gate: mg,
                    up: mu,
                    down: md,
                },
            ) = (&mut g.ffn, &m.ffn)
            {
                g.gate_up_tiles = fused_runs(dev, &[(gate, mg), (up, mu)])?;
                keep(down, md)?;
            }
            let fused = g.qkv_tiles.iter().chain(&g.gate_up_tiles);
            fused_bytes += fused.map(TileMatrix::bytes).sum::<usize>();
        }
        keep(&mut self.output, &model.output)?;
        self.tile_bytes += fused_bytes;
        Ok(())
    }
}

/// Matrices that multiply the same rows (a layer's q, k and v; gate and up) as tile
/// matrices of their rows in order, one for each run that shares a layout; none if one of
/// them cannot be copied (their products then go through the f16 path).
fn fused_runs(
    dev: &CudaDevice,
    parts: &[(&GpuLinear, &Linear)],
) -> Result<Vec<TileMatrix>, CudaError> {
    let hosts: Option<Vec<_>> = parts
        .iter()
        .map(|(g, l)| repack(g.ty, &l.packed(), g.n_in, g.n_out, 1))
        .collect();
    let mut runs: Vec<HostTiles> = Vec::new();
    for h in hosts.into_iter().flatten() {
        let h = match runs.last_mut() {
            Some(r) => match r.append(h) {
                Ok(()) => continue,
                Err(h) => h,
            },
            None => h,
        };
        runs.push(h);
    }
    runs.iter().map(|h| TileMatrix::upload(dev, h)).collect()
}

/// Bytes of `n_expert` matrices of `n_out` x `n_in` weights of `ty` in the tile layout: 4
/// bits a level for the types whose levels span 16 values, else 8; f16 scale pairs per 32
/// (per 16 for some files: an estimate).
fn tile_bytes(ty: memra_gguf::GgmlType, n_expert: usize, n_out: usize, n_in: usize) -> usize {
    use memra_gguf::GgmlType as G;
    let bits = match ty {
        G::Q4_0 | G::Q4_1 | G::Q4K | G::Q3K | G::Q2K => 4,
        _ => 8,
    };
    let weights = n_expert * n_out.next_multiple_of(64) * n_in;
    weights * bits / 8 + weights / 32 * 4
}

/// A projection's experts' blocks, one after the other (slice copies: a byte-by-byte
/// collect ran at 200 MB/s, 90 s of the 30B-A3B's load).
fn experts_bytes(e: &[Linear]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(e.iter().map(|l| l.packed().len()).sum());
    for l in e {
        bytes.extend_from_slice(&l.packed());
    }
    bytes
}

/// `w` dequantized to f16 into `out` (its n_out x n_in values), in chunks the size of the
/// prompt path's scratch, as that path dequantizes.
fn dequantize_rows_f16(
    dev: &CudaDevice,
    w: &GpuLinear,
    out: &mut cudarc::driver::CudaViewMut<f16>,
) -> Result<(), CudaError> {
    let (rb, chunk) = (w.row_bytes(), gemm_chunk_rows(GEMM_SCRATCH, w.n_in));
    for r0 in (0..w.n_out).step_by(chunk) {
        let m = chunk.min(w.n_out - r0);
        let rows = w.w.slice(r0 * rb..(r0 + m) * rb);
        let mut part = out.slice_mut(r0 * w.n_in..(r0 + m) * w.n_in);
        ops::dequantize_f16(dev, &rows, w.ty, &mut part, m, w.n_in)?;
    }
    Ok(())
}
