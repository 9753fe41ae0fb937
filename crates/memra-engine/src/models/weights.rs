//! Weights as views into the mapped GGUF file, found by GGUF tensor name and checked
//! against the shapes the architecture expects.

use std::sync::Arc;

use memra_gguf::quant::{can_dequantize, dequantize_to_vec};
use memra_gguf::{GgmlType, GgufFile, TensorInfo};

use super::ModelError;

/// A weight matrix of `n_out` rows of `n_in` elements, in its file encoding.
pub trait WeightRows: Sync {
    fn ty(&self) -> GgmlType;
    fn n_in(&self) -> usize;
    fn n_out(&self) -> usize;
    /// The encoded bytes of row `r`.
    fn row(&self, r: usize) -> &[u8];
}

/// A tensor of the model file (zero-copy).
#[derive(Clone)]
pub struct Tensor {
    file: Arc<GgufFile>,
    pub info: TensorInfo,
}

impl Tensor {
    pub fn bytes(&self) -> &[u8] {
        self.file.tensor_data(&self.info)
    }

    pub fn to_f32(&self) -> Vec<f32> {
        dequantize_to_vec(self.info.ty, self.bytes()).expect("checked at load")
    }
}

/// Finds tensors by name and checks their shapes.
pub struct TensorSource<'a> {
    pub file: &'a Arc<GgufFile>,
}

impl TensorSource<'_> {
    pub fn optional(&self, name: &str, dims: &[u64]) -> Result<Option<Tensor>, ModelError> {
        let Some(info) = self.file.tensor(name) else {
            return Ok(None);
        };
        if info.dims != dims {
            return Err(ModelError::Shape {
                tensor: name.to_string(),
                expected: dims.to_vec(),
                found: info.dims.clone(),
            });
        }
        if !can_dequantize(info.ty) {
            return Err(ModelError::UnsupportedType {
                tensor: name.to_string(),
                ty: info.ty,
            });
        }
        Ok(Some(Tensor {
            file: self.file.clone(),
            info: info.clone(),
        }))
    }

    pub fn required(&self, name: &str, dims: &[u64]) -> Result<Tensor, ModelError> {
        self.optional(name, dims)?
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))
    }

    /// A norm or bias vector, as f32.
    pub fn vector(&self, name: &str, n: u64) -> Result<Vec<f32>, ModelError> {
        Ok(self.required(name, &[n])?.to_f32())
    }

    pub fn optional_vector(&self, name: &str, n: u64) -> Result<Option<Vec<f32>>, ModelError> {
        Ok(self.optional(name, &[n])?.map(|t| t.to_f32()))
    }

    /// A weight matrix mapping `n_in` to `n_out` (GGUF dims `[n_in, n_out]`).
    pub fn linear(&self, name: &str, n_in: u64, n_out: u64) -> Result<Linear, ModelError> {
        Ok(Linear::new(
            self.required(name, &[n_in, n_out])?,
            0,
            n_out as usize,
        ))
    }

    /// A stack of expert matrices (GGUF dims `[n_in, n_out, n_expert]`).
    pub fn experts(
        &self,
        name: &str,
        n_in: u64,
        n_out: u64,
        n_expert: u64,
    ) -> Result<Vec<Linear>, ModelError> {
        let t = self.required(name, &[n_in, n_out, n_expert])?;
        Ok((0..n_expert as usize)
            .map(|e| Linear::new(t.clone(), e * n_out as usize, n_out as usize))
            .collect())
    }
}

/// A weight matrix: rows `first_row .. first_row + n_out` of a tensor.
#[derive(Clone)]
pub struct Linear {
    tensor: Tensor,
    first_row: usize,
    n_out: usize,
    row_bytes: usize,
}

impl Linear {
    fn new(tensor: Tensor, first_row: usize, n_out: usize) -> Linear {
        let row_bytes = tensor
            .info
            .ty
            .row_bytes(tensor.info.dims[0])
            .expect("checked by the reader") as usize;
        Linear {
            tensor,
            first_row,
            n_out,
            row_bytes,
        }
    }

    /// The rows' bytes, contiguous in the file.
    pub fn bytes(&self) -> &[u8] {
        let start = self.first_row * self.row_bytes;
        &self.tensor.bytes()[start..start + self.n_out * self.row_bytes]
    }

    /// Row `r` dequantized (embedding lookup).
    pub fn row_f32(&self, r: usize) -> Vec<f32> {
        dequantize_to_vec(self.ty(), self.row(r)).expect("checked at load")
    }
}

impl WeightRows for Linear {
    fn ty(&self) -> GgmlType {
        self.tensor.info.ty
    }
    fn n_in(&self) -> usize {
        self.tensor.info.dims[0] as usize
    }
    fn n_out(&self) -> usize {
        self.n_out
    }
    fn row(&self, r: usize) -> &[u8] {
        let start = (self.first_row + r) * self.row_bytes;
        &self.tensor.bytes()[start..start + self.row_bytes]
    }
}
