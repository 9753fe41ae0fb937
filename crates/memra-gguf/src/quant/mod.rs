//! ggml quant blocks on the CPU: `#[repr(C)]` block layouts, scalar dequantization, and
//! the activation-quantize + integer dot-product pairs llama.cpp's CPU backend uses
//! (Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for the k-quants,
//! IQ4_XS and the ternary types). These are the reference every faster kernel is tested
//! against, so they favour plain code over speed.

/// `WeightBlock` for block types that decode to [`kquants::Decoded`] with a `decode` method;
/// `=> fast` names an inherent `unpack_fast` method to use for unpacking instead.
macro_rules! weight_via_decode {
    (@unpack $self:ident, $l:ident, $s:ident, $m:ident) => {
        $self.decode().unpack($l, $s, $m)
    };
    (@unpack $self:ident, $l:ident, $s:ident, $m:ident, fast) => {
        $self.unpack_fast($l, $s, $m)
    };
    ($($block:ty => $ty:expr $(=> $fast:ident)?),* $(,)?) => {$(
        impl WeightBlock for $block {
            const TYPE: GgmlType = $ty;
            type Act = BlockQ8K;
            fn dequantize(&self, out: &mut [f32]) {
                self.decode().dequantize(out)
            }
            fn dot(&self, a: &BlockQ8K) -> f32 {
                self.decode().dot(a)
            }
            fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]) {
                weight_via_decode!(@unpack self, levels, scale16, min16 $(, $fast)?)
            }
        }
    )*};
}

mod iq_grids;
pub mod iquants;
pub mod kquants;
pub mod legacy;

use std::borrow::Cow;

use bytemuck::Pod;
use half::{bf16, f16};

use crate::types::GgmlType;
pub use iquants::*;
pub use kquants::*;
pub use legacy::*;

/// A quantized weight block: `TYPE.block_size()` elements in `TYPE.type_size()` bytes.
pub trait WeightBlock: Pod {
    const TYPE: GgmlType;
    /// The activation block type this weight is multiplied with (ggml `vec_dot_type`).
    type Act: ActBlock;
    /// Writes the block's `TYPE.block_size()` values to `out`.
    fn dequantize(&self, out: &mut [f32]);
    /// Dot product of this block with a block of quantized activations.
    fn dot(&self, a: &Self::Act) -> f32;
    /// The block as int8 levels with an affine map per 16 elements:
    /// `value[i] = scale16[i / 16] * levels[i] - min16[i / 16]`. Every format fits this
    /// form, which lets one SIMD kernel multiply all of them (`memra-engine`'s CPU matmul).
    fn unpack(&self, levels: &mut [i8], scale16: &mut [f32], min16: &mut [f32]);
}

/// A block format activations are quantized to before an integer dot product.
pub trait ActBlock: WeightBlock {
    /// Quantizes exactly one block's worth of values.
    fn quantize(x: &[f32]) -> Self;
}

/// Why a quant operation cannot run.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum QuantError {
    #[error("{0} is not supported by the CPU quant kernels")]
    Unsupported(GgmlType),
    #[error("{ty}: {elements} elements is not a whole number of {block}-element blocks")]
    NotBlockMultiple {
        ty: GgmlType,
        elements: usize,
        block: usize,
    },
    #[error("{ty}: {elements} elements need {expected} bytes, got {got}")]
    ByteLength {
        ty: GgmlType,
        elements: usize,
        expected: usize,
        got: usize,
    },
}

/// Calls `$body` with `$B` bound to the block struct of `$ty`, or evaluates `$otherwise`.
macro_rules! with_block_type {
    ($ty:expr, $B:ident => $body:expr, _ => $otherwise:expr) => {
        match $ty {
            GgmlType::Q4_0 => {
                type $B = BlockQ4_0;
                $body
            }
            GgmlType::Q4_1 => {
                type $B = BlockQ4_1;
                $body
            }
            GgmlType::Q5_0 => {
                type $B = BlockQ5_0;
                $body
            }
            GgmlType::Q5_1 => {
                type $B = BlockQ5_1;
                $body
            }
            GgmlType::Q8_0 => {
                type $B = BlockQ8_0;
                $body
            }
            GgmlType::Q8_1 => {
                type $B = BlockQ8_1;
                $body
            }
            GgmlType::Iq4Nl => {
                type $B = BlockIq4Nl;
                $body
            }
            GgmlType::Mxfp4 => {
                type $B = BlockMxfp4;
                $body
            }
            GgmlType::Q2K => {
                type $B = BlockQ2K;
                $body
            }
            GgmlType::Q3K => {
                type $B = BlockQ3K;
                $body
            }
            GgmlType::Q4K => {
                type $B = BlockQ4K;
                $body
            }
            GgmlType::Q5K => {
                type $B = BlockQ5K;
                $body
            }
            GgmlType::Q6K => {
                type $B = BlockQ6K;
                $body
            }
            GgmlType::Q8K => {
                type $B = BlockQ8K;
                $body
            }
            GgmlType::Iq4Xs => {
                type $B = BlockIq4Xs;
                $body
            }
            GgmlType::Tq1_0 => {
                type $B = BlockTq1_0;
                $body
            }
            GgmlType::Tq2_0 => {
                type $B = BlockTq2_0;
                $body
            }
            GgmlType::Iq2Xxs => {
                type $B = BlockIq2Xxs;
                $body
            }
            GgmlType::Iq2Xs => {
                type $B = BlockIq2Xs;
                $body
            }
            GgmlType::Iq2S => {
                type $B = BlockIq2S;
                $body
            }
            GgmlType::Iq3Xxs => {
                type $B = BlockIq3Xxs;
                $body
            }
            GgmlType::Iq3S => {
                type $B = BlockIq3S;
                $body
            }
            GgmlType::Iq1S => {
                type $B = BlockIq1S;
                $body
            }
            GgmlType::Iq1M => {
                type $B = BlockIq1M;
                $body
            }
            _ => $otherwise,
        }
    };
}

/// Byte offsets of the f16 scale fields inside a block of `ty` (ggml-common.h layouts).
/// Tests and `memra synth` write small finite scales there when they make random blocks.
pub fn f16_scale_fields(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 | Iq4Nl | Iq4Xs | Iq2Xxs | Iq2Xs | Iq2S | Iq3Xxs | Iq3S | Iq1S => &[0],
        Q4_1 | Q5_1 | Q8_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
        Tq1_0 => &[52],
        Tq2_0 => &[64],
        _ => &[],
    }
}

/// Views bytes as blocks without copying when they are aligned; copies otherwise.
/// The caller has checked the length.
pub fn as_blocks<T: Pod + Clone>(bytes: &[u8]) -> Cow<'_, [T]> {
    match bytemuck::try_cast_slice(bytes) {
        Ok(s) => Cow::Borrowed(s),
        Err(_) => {
            let mut v = vec![T::zeroed(); bytes.len() / size_of::<T>()];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
            Cow::Owned(v)
        }
    }
}

fn check_lengths(ty: GgmlType, elements: usize, bytes: usize) -> Result<(), QuantError> {
    let block = ty.block_size();
    if elements % block != 0 {
        return Err(QuantError::NotBlockMultiple {
            ty,
            elements,
            block,
        });
    }
    let expected = elements / block * ty.type_size();
    if bytes != expected {
        return Err(QuantError::ByteLength {
            ty,
            elements,
            expected,
            got: bytes,
        });
    }
    Ok(())
}

/// Whether [`dequantize`] handles `ty`.
pub fn can_dequantize(ty: GgmlType) -> bool {
    with_block_type!(ty, B => { let _ = B::TYPE; true }, _ => matches!(
        ty,
        GgmlType::F32
            | GgmlType::F16
            | GgmlType::Bf16
            | GgmlType::F64
            | GgmlType::I8
            | GgmlType::I16
            | GgmlType::I32
            | GgmlType::I64
    ))
}

fn scalars<const N: usize>(src: &[u8], dst: &mut [f32], conv: impl Fn([u8; N]) -> f32) {
    for (o, c) in dst.iter_mut().zip(src.chunks_exact(N)) {
        *o = conv(c.try_into().expect("N bytes"));
    }
}

/// Decodes `dst.len()` elements of type `ty` from `src`.
pub fn dequantize(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(ty, dst.len(), src.len())?;
    with_block_type!(ty, B => {
        let n = B::TYPE.block_size();
        for (b, out) in as_blocks::<B>(src).iter().zip(dst.chunks_exact_mut(n)) {
            b.dequantize(out);
        }
    }, _ => match ty {
        GgmlType::F32 => scalars(src, dst, f32::from_le_bytes),
        GgmlType::F16 => scalars(src, dst, |b| f16::from_le_bytes(b).to_f32()),
        GgmlType::Bf16 => scalars(src, dst, |b| bf16::from_le_bytes(b).to_f32()),
        GgmlType::F64 => scalars(src, dst, |b| f64::from_le_bytes(b) as f32),
        GgmlType::I8 => scalars(src, dst, |b: [u8; 1]| f32::from(b[0] as i8)),
        GgmlType::I16 => scalars(src, dst, |b| f32::from(i16::from_le_bytes(b))),
        GgmlType::I32 => scalars(src, dst, |b| i32::from_le_bytes(b) as f32),
        GgmlType::I64 => scalars(src, dst, |b| i64::from_le_bytes(b) as f32),
        _ => return Err(QuantError::Unsupported(ty)),
    });
    Ok(())
}

/// Unpacks a row of `ty` into int8 levels and per-16 scales and mins (see
/// [`WeightBlock::unpack`]). `levels` has one entry per element, the others one per 16.
pub fn unpack_row(
    ty: GgmlType,
    src: &[u8],
    levels: &mut [i8],
    scale16: &mut [f32],
    min16: &mut [f32],
) -> Result<(), QuantError> {
    check_lengths(ty, levels.len(), src.len())?;
    with_block_type!(ty, B => {
        let n = B::TYPE.block_size();
        let g = n / 16;
        let blocks = as_blocks::<B>(src);
        for (i, b) in blocks.iter().enumerate() {
            b.unpack(
                &mut levels[i * n..(i + 1) * n],
                &mut scale16[i * g..(i + 1) * g],
                &mut min16[i * g..(i + 1) * g],
            );
        }
        Ok(())
    }, _ => Err(QuantError::Unsupported(ty)))
}

/// Decodes a whole buffer of `ty` into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, src: &[u8]) -> Result<Vec<f32>, QuantError> {
    let blocks = src.len() / ty.type_size();
    let mut out = vec![0f32; blocks * ty.block_size()];
    dequantize(ty, src, &mut out)?;
    Ok(out)
}

/// The block format activations are quantized to for an integer dot product with weights
/// of type `ty` (ggml `vec_dot_type`); `None` when `ty` has no integer dot product here
/// (the float types, whose products run in f32).
pub fn activation_type(ty: GgmlType) -> Option<GgmlType> {
    with_block_type!(ty, B => Some(<B as WeightBlock>::Act::TYPE), _ => None)
}

/// Quantizes `x` to the activation format `act` (Q8_0, Q8_1 or Q8_K), appending to `out`.
pub fn quantize_activations(act: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<(), QuantError> {
    fn run<A: ActBlock>(x: &[f32], out: &mut Vec<u8>) {
        for chunk in x.chunks_exact(A::TYPE.block_size()) {
            out.extend_from_slice(bytemuck::bytes_of(&A::quantize(chunk)));
        }
    }
    let block = act.block_size();
    if x.len() % block != 0 {
        return Err(QuantError::NotBlockMultiple {
            ty: act,
            elements: x.len(),
            block,
        });
    }
    match act {
        GgmlType::Q8_0 => run::<BlockQ8_0>(x, out),
        GgmlType::Q8_1 => run::<BlockQ8_1>(x, out),
        GgmlType::Q8K => run::<BlockQ8K>(x, out),
        _ => return Err(QuantError::Unsupported(act)),
    }
    Ok(())
}

/// Dot product of a row of `n` weights of type `ty` with the same `n` activations already
/// quantized to `activation_type(ty)`.
pub fn vec_dot(ty: GgmlType, n: usize, weights: &[u8], acts: &[u8]) -> Result<f32, QuantError> {
    check_lengths(ty, n, weights.len())?;
    with_block_type!(ty, B => {
        let act_ty = <B as WeightBlock>::Act::TYPE;
        check_lengths(act_ty, n, acts.len())?;
        let w = as_blocks::<B>(weights);
        let a = as_blocks::<<B as WeightBlock>::Act>(acts);
        Ok(w.iter().zip(a.iter()).map(|(w, a)| w.dot(a)).sum())
    }, _ => Err(QuantError::Unsupported(ty)))
}

/// Dot product of a row of F32, F16 or BF16 weights with f32 activations.
pub fn vec_dot_f32(ty: GgmlType, weights: &[u8], x: &[f32]) -> Result<f32, QuantError> {
    check_lengths(ty, x.len(), weights.len())?;
    fn run<const N: usize>(w: &[u8], x: &[f32], conv: impl Fn([u8; N]) -> f32) -> f32 {
        w.chunks_exact(N)
            .zip(x)
            .map(|(c, &x)| conv(c.try_into().expect("N bytes")) * x)
            .sum()
    }
    Ok(match ty {
        GgmlType::F32 => run(weights, x, f32::from_le_bytes),
        GgmlType::F16 => run(weights, x, |b| f16::from_le_bytes(b).to_f32()),
        GgmlType::Bf16 => run(weights, x, |b| bf16::from_le_bytes(b).to_f32()),
        _ => return Err(QuantError::Unsupported(ty)),
    })
}
