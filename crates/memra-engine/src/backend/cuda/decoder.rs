//! The decoder on the GPU, one token at a time: weights uploaded in their quantized form,
//! an f32 KV cache, and the kernels of this backend. It runs the same [`Decoder`] the CPU
//! engine runs (every dense architecture), and is checked against it.
//!
//! First version: prompts go through token by token (no prompt GEMM yet), every kernel is
//! launched eagerly (no CUDA graph yet), logits come back to the host each step.

use cudarc::driver::CudaSlice;

use super::matvec::{kernel_for, mmvq, DeviceActs};
use super::ops::{self, DecodeAttention, DeviceRope};
use super::{CudaDevice, CudaError};
use crate::backend::cpu::matmul::WeightRows;
use crate::backend::cpu::ops::RopeLayout;
use crate::models::layers::{Activation, Decoder, Ffn};
use crate::models::weights::Linear;

struct GpuLinear {
    w: CudaSlice<u8>,
    ty: memra_gguf::GgmlType,
    n_in: usize,
    n_out: usize,
}

struct GpuLayer {
    attn_norm: CudaSlice<f32>,
    wq: GpuLinear,
    wk: GpuLinear,
    wv: GpuLinear,
    bq: Option<CudaSlice<f32>>,
    bk: Option<CudaSlice<f32>>,
    bv: Option<CudaSlice<f32>>,
    q_norm: Option<CudaSlice<f32>>,
    k_norm: Option<CudaSlice<f32>>,
    wo: GpuLinear,
    post_attn_norm: Option<CudaSlice<f32>>,
    ffn_norm: CudaSlice<f32>,
    gate: GpuLinear,
    up: GpuLinear,
    down: GpuLinear,
    post_ffn_norm: Option<CudaSlice<f32>>,
    rope: DeviceRope,
    window: Option<usize>,
}

/// Per-step buffers, allocated once.
struct Scratch {
    x: CudaSlice<f32>,
    q: CudaSlice<f32>,
    k: CudaSlice<f32>,
    v: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    o: CudaSlice<f32>,
    g: CudaSlice<f32>,
    u: CudaSlice<f32>,
    logits: CudaSlice<f32>,
    acts: DeviceActs,
}

/// Copies an f32 vector to the device, counting the bytes.
type Upload<'a> = dyn FnMut(&[f32]) -> Result<CudaSlice<f32>, CudaError> + 'a;

pub struct GpuDecoder<'m> {
    dev: CudaDevice,
    model: &'m Decoder,
    layers: Vec<GpuLayer>,
    output_norm: CudaSlice<f32>,
    output: GpuLinear,
    k_cache: Vec<CudaSlice<f32>>,
    v_cache: Vec<CudaSlice<f32>>,
    scratch: Scratch,
    n_ctx: usize,
    len: usize,
    /// Device bytes held: weights, cache and scratch.
    pub device_bytes: usize,
}

impl<'m> GpuDecoder<'m> {
    /// Uploads `model` to GPU `ordinal` with room for `n_ctx` positions.
    pub fn new(
        ordinal: usize,
        model: &'m Decoder,
        n_ctx: usize,
    ) -> Result<GpuDecoder<'m>, CudaError> {
        let dev = CudaDevice::new(ordinal)?;
        let hp = &model.hp;
        let mut weight_bytes = model.output.bytes().len();
        for l in &model.layers {
            weight_bytes += [&l.wq, &l.wk, &l.wv, &l.wo]
                .iter()
                .map(|w| w.bytes().len())
                .sum::<usize>();
            if let Ffn::Dense { gate, up, down } = &l.ffn {
                weight_bytes += gate.bytes().len() + up.bytes().len() + down.bytes().len();
            }
        }
        let cache_bytes = 4 * n_ctx * hp.n_layer * hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v);
        let (free, _) = dev.ctx.mem_get_info()?;
        if weight_bytes + cache_bytes > free {
            return Err(CudaError::Invalid(format!(
                "the model needs at least {} MiB of GPU memory ({} MiB weights, {} MiB KV cache); {} MiB are free",
                (weight_bytes + cache_bytes) >> 20,
                weight_bytes >> 20,
                cache_bytes >> 20,
                free >> 20
            )));
        }
        let mut bytes = 0usize;
        let mut up_f32 = |v: &[f32]| -> Result<CudaSlice<f32>, CudaError> {
            bytes += 4 * v.len();
            Ok(dev.stream.clone_htod(v)?)
        };
        let mut linears = 0usize;
        let mut upload = |l: &Linear| -> Result<GpuLinear, CudaError> {
            if kernel_for(l.ty()).is_none() {
                return Err(CudaError::Unsupported {
                    op: "matvec",
                    ty: l.ty(),
                });
            }
            linears += l.bytes().len();
            Ok(GpuLinear {
                w: dev.stream.clone_htod(l.bytes())?,
                ty: l.ty(),
                n_in: l.n_in(),
                n_out: l.n_out(),
            })
        };
        let mut layers = Vec::with_capacity(model.layers.len());
        for l in &model.layers {
            let Ffn::Dense { gate, up, down } = &l.ffn else {
                return Err(CudaError::Invalid(
                    "mixture-of-experts layers do not run on the GPU yet".into(),
                ));
            };
            let opt = |v: &Option<Vec<f32>>, up: &mut Upload| v.as_deref().map(up).transpose();
            layers.push(GpuLayer {
                attn_norm: up_f32(&l.attn_norm)?,
                wq: upload(&l.wq)?,
                wk: upload(&l.wk)?,
                wv: upload(&l.wv)?,
                bq: opt(&l.bq, &mut up_f32)?,
                bk: opt(&l.bk, &mut up_f32)?,
                bv: opt(&l.bv, &mut up_f32)?,
                q_norm: opt(&l.q_norm, &mut up_f32)?,
                k_norm: opt(&l.k_norm, &mut up_f32)?,
                wo: upload(&l.wo)?,
                post_attn_norm: opt(&l.post_attn_norm, &mut up_f32)?,
                ffn_norm: up_f32(&l.ffn_norm)?,
                gate: upload(gate)?,
                up: upload(up)?,
                down: upload(down)?,
                post_ffn_norm: opt(&l.post_ffn_norm, &mut up_f32)?,
                rope: DeviceRope {
                    halves: l.rope.layout == RopeLayout::Halves,
                    n_dims: l.rope.n_dims,
                    base: l.rope.base,
                    freq_scale: l.rope.freq_scale,
                    freq_factors: opt(&l.rope.freq_factors, &mut up_f32)?,
                },
                window: l.window,
            });
        }
        let output_norm = up_f32(&model.output_norm)?;
        let output = upload(&model.output)?;
        let kv_k = n_ctx * hp.n_head_kv * hp.head_dim_k;
        let kv_v = n_ctx * hp.n_head_kv * hp.head_dim_v;
        let mut k_cache = Vec::with_capacity(hp.n_layer);
        let mut v_cache = Vec::with_capacity(hp.n_layer);
        for _ in 0..hp.n_layer {
            k_cache.push(dev.stream.alloc_zeros(kv_k)?);
            v_cache.push(dev.stream.alloc_zeros(kv_v)?);
        }
        let (e, f) = (hp.n_embd, layers.first().map_or(0, |l| l.gate.n_out));
        let q_len = hp.n_head * hp.head_dim_k;
        let widest = e.max(f).max(hp.n_head * hp.head_dim_v);
        let s = &dev.stream;
        let scratch = Scratch {
            x: s.alloc_zeros(e)?,
            q: s.alloc_zeros(q_len)?,
            k: s.alloc_zeros(hp.n_head_kv * hp.head_dim_k)?,
            v: s.alloc_zeros(hp.n_head_kv * hp.head_dim_v)?,
            attn: s.alloc_zeros(hp.n_head * hp.head_dim_v)?,
            o: s.alloc_zeros(e)?,
            g: s.alloc_zeros(f.max(1))?,
            u: s.alloc_zeros(f.max(1))?,
            logits: s.alloc_zeros(hp.n_vocab)?,
            acts: DeviceActs::new(&dev, widest.div_ceil(32) * 32)?,
        };
        let device_bytes = bytes + linears + 4 * (kv_k + kv_v) * hp.n_layer;
        Ok(GpuDecoder {
            dev,
            model,
            layers,
            output_norm,
            output,
            k_cache,
            v_cache,
            scratch,
            n_ctx,
            len: 0,
            device_bytes,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Forgets the context (the cache is overwritten from position 0).
    pub fn reset(&mut self) {
        self.len = 0;
    }

    fn matvec(
        dev: &CudaDevice,
        w: &GpuLinear,
        acts: &mut DeviceActs,
        x: &CudaSlice<f32>,
        y: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        acts.quantize(dev, x, w.n_in)?;
        mmvq(dev, w.ty, &w.w, acts, y, w.n_in, w.n_out, 1)
    }

    /// Runs one token at the next position; returns its logits.
    pub fn forward_token(&mut self, id: u32) -> Result<Vec<f32>, CudaError> {
        let m = self.model;
        let hp = &m.hp;
        if self.len >= self.n_ctx {
            return Err(CudaError::Invalid(format!(
                "the context is full ({} positions)",
                self.n_ctx
            )));
        }
        if id as usize >= hp.n_vocab {
            return Err(CudaError::Invalid(format!(
                "token id {id} outside the vocabulary"
            )));
        }
        let pos = self.len;
        let dev = &self.dev;
        let s = &mut self.scratch;
        dev.stream.memcpy_htod(&m.embed(id), &mut s.x)?;
        let (e, dk, dv) = (hp.n_embd, hp.head_dim_k, hp.head_dim_v);
        let (kr, vr) = (hp.n_head_kv * dk, hp.n_head_kv * dv);
        let shape = DecodeAttention {
            n_head: hp.n_head,
            n_head_kv: hp.n_head_kv,
            dk,
            dv,
            scale: m.attn_scale,
        };
        // The output of the previous block, still to be added to the residual stream: each
        // add goes into the launch that normalizes and quantizes the next input.
        let mut pending = false;
        for (li, l) in self.layers.iter().enumerate() {
            s.acts.add_norm_quantize(
                dev,
                &mut s.x,
                pending.then_some(&s.o),
                &l.attn_norm,
                hp.rms_eps,
            )?;
            mmvq(dev, l.wq.ty, &l.wq.w, &s.acts, &mut s.q, e, l.wq.n_out, 1)?;
            mmvq(dev, l.wk.ty, &l.wk.w, &s.acts, &mut s.k, e, l.wk.n_out, 1)?;
            mmvq(dev, l.wv.ty, &l.wv.w, &s.acts, &mut s.v, e, l.wv.n_out, 1)?;
            if let Some(b) = &l.bq {
                ops::add_bias(dev, &mut s.q, b, b.len())?;
            }
            if let Some(b) = &l.bk {
                ops::add_bias(dev, &mut s.k, b, b.len())?;
            }
            if let Some(b) = &l.bv {
                ops::add_bias(dev, &mut s.v, b, b.len())?;
            }
            if let Some(w) = &l.q_norm {
                ops::rms_norm_inplace(dev, &mut s.q, w, hp.n_head, hp.rms_eps)?;
            }
            if let Some(w) = &l.k_norm {
                ops::rms_norm_inplace(dev, &mut s.k, w, hp.n_head_kv, hp.rms_eps)?;
            }
            ops::rope_qk_append(
                dev,
                &mut s.q,
                &s.k,
                &s.v,
                &mut self.k_cache[li],
                &mut self.v_cache[li],
                &shape,
                &l.rope,
                pos,
            )?;
            let first = l.window.map_or(0, |w| (pos + 1).saturating_sub(w));
            ops::attention_decode(
                dev,
                &shape,
                &s.q,
                &self.k_cache[li].slice(..(pos + 1) * kr),
                &self.v_cache[li].slice(..(pos + 1) * vr),
                &mut s.attn,
                first,
                pos + 1,
            )?;
            Self::matvec(dev, &l.wo, &mut s.acts, &s.attn, &mut s.o)?;
            if let Some(w) = &l.post_attn_norm {
                ops::rms_norm_inplace(dev, &mut s.o, w, 1, hp.rms_eps)?;
            }
            s.acts
                .add_norm_quantize(dev, &mut s.x, Some(&s.o), &l.ffn_norm, hp.rms_eps)?;
            mmvq(
                dev,
                l.gate.ty,
                &l.gate.w,
                &s.acts,
                &mut s.g,
                e,
                l.gate.n_out,
                1,
            )?;
            mmvq(dev, l.up.ty, &l.up.w, &s.acts, &mut s.u, e, l.up.n_out, 1)?;
            let gelu = m.activation == Activation::GeluTanh;
            s.acts.gated_quantize(dev, &s.g, &s.u, l.gate.n_out, gelu)?;
            let down = &l.down;
            mmvq(
                dev, down.ty, &down.w, &s.acts, &mut s.o, down.n_in, down.n_out, 1,
            )?;
            if let Some(w) = &l.post_ffn_norm {
                ops::rms_norm_inplace(dev, &mut s.o, w, 1, hp.rms_eps)?;
            }
            pending = true;
        }
        s.acts.add_norm_quantize(
            dev,
            &mut s.x,
            pending.then_some(&s.o),
            &self.output_norm,
            hp.rms_eps,
        )?;
        let out = &self.output;
        mmvq(
            dev,
            out.ty,
            &out.w,
            &s.acts,
            &mut s.logits,
            out.n_in,
            out.n_out,
            1,
        )?;
        let mut logits = dev.stream.clone_dtoh(&s.logits)?;
        if let Some(cap) = m.final_logit_softcap {
            logits.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh());
        }
        self.len += 1;
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::{LogitRows, Model};

    fn rms(v: impl Iterator<Item = f64>) -> f64 {
        let (s, n) = v.fold((0f64, 0usize), |(s, n), x| (s + x * x, n + 1));
        (s / n.max(1) as f64).sqrt()
    }

    /// GPU logits against the CPU engine's, step by step on the same tokens, for the models
    /// in `MEMRA_GPU_TEST_MODELS` (comma-separated paths; scripts/device-check.sh makes
    /// synthetic ones). The engines quantize activations differently (CPU: llama.cpp's
    /// Q8_0/Q8_K; GPU: int8 per 32 with an f32 scale), so logits differ by rounding; the
    /// best token must agree wherever the CPU's margin between its two best clearly exceeds
    /// that difference.
    #[test]
    #[ignore = "needs an NVIDIA GPU and MEMRA_GPU_TEST_MODELS"]
    fn gpu_decoder_matches_cpu_logits() {
        let paths = std::env::var("MEMRA_GPU_TEST_MODELS").expect("MEMRA_GPU_TEST_MODELS");
        let mut failures = Vec::new();
        for path in paths.split(',') {
            let model = Model::load(std::path::Path::new(path)).unwrap();
            let d = &model.decoder;
            let text = "Hello world, this is a test of the decoder.";
            let tokens = model.tokenizer.encode(text, true, true).unwrap();
            let mut cache = d.new_cache(64);
            let mut gpu = GpuDecoder::new(0, d, 64).unwrap();
            let (mut worst, mut agree, mut ties) = (0f64, 0, 0);
            for &t in &tokens {
                let cpu = d.forward(&mut cache, &[t], LogitRows::Last).unwrap();
                let g = gpu.forward_token(t).unwrap();
                let diff = rms(cpu.iter().zip(&g).map(|(a, b)| f64::from(a - b)));
                worst = worst.max(diff / rms(cpu.iter().map(|&a| f64::from(a))));
                let best = |v: &[f32]| crate::sampler::argmax(v) as usize;
                if best(&cpu) == best(&g) {
                    agree += 1;
                    continue;
                }
                let mut rest = cpu.clone();
                rest[best(&cpu)] = f32::NEG_INFINITY;
                let margin = f64::from(cpu[best(&cpu)] - rest[best(&rest)]);
                if margin > 4.0 * diff {
                    failures.push(format!(
                        "{path}: best tokens differ at a margin of {margin:.4} (RMS difference {diff:.4})"
                    ));
                }
                ties += 1;
            }
            eprintln!(
                "{path}: {} steps, best token agrees at {agree}, near-ties {ties}; \
                 RMS logit difference {:.2}% of the logits' RMS",
                tokens.len(),
                100.0 * worst
            );
            if worst > 0.05 {
                failures.push(format!(
                    "{path}: logits differ by {:.2}% RMS",
                    100.0 * worst
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
