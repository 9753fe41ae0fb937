//! Weights as views into the mapped GGUF file, found by GGUF tensor name and checked
//! against the shapes the architecture expects.

use std::borrow::Cow;
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

/// A weight matrix: rows `first_row .. first_row + n_out` of a tensor, and of each row the
/// `n_in` columns from `first_col` (all of them, except in a tensor-parallel shard).
#[derive(Clone)]
pub struct Linear {
    tensor: Tensor,
    first_row: usize,
    n_out: usize,
    /// Bytes of a whole row of the tensor.
    row_bytes: usize,
    first_col: usize,
    n_in: usize,
}

impl Linear {
    fn new(tensor: Tensor, first_row: usize, n_out: usize) -> Linear {
        let row_bytes = tensor
            .info
            .ty
            .row_bytes(tensor.info.dims[0])
            .expect("checked by the reader") as usize;
        let n_in = tensor.info.dims[0] as usize;
        Linear {
            tensor,
            first_row,
            n_out,
            row_bytes,
            first_col: 0,
            n_in,
        }
    }

    /// The GGUF tensor this matrix is (part of).
    pub fn name(&self) -> &str {
        &self.tensor.info.name
    }

    /// Whether each row is whole (not a shard's share of the columns).
    pub fn full_width(&self) -> bool {
        self.n_in == self.tensor.info.dims[0] as usize
    }

    /// Bytes of the rows (of this matrix's columns).
    pub fn byte_len(&self) -> usize {
        self.n_out
            * self
                .ty()
                .row_bytes(self.n_in as u64)
                .expect("block-aligned") as usize
    }

    /// The rows' bytes, one after the other: borrowed from the file for whole rows,
    /// copied together for a column share (a tensor-parallel rank's wo and down), whose
    /// rows are apart in the file.
    pub fn packed(&self) -> Cow<'_, [u8]> {
        if self.full_width() {
            let start = self.first_row * self.row_bytes;
            return Cow::Borrowed(&self.tensor.bytes()[start..start + self.n_out * self.row_bytes]);
        }
        Cow::Owned((0..self.n_out).flat_map(|r| self.row(r)).copied().collect())
    }

    /// Rows `first .. first + n` of this matrix (a row-major quantized matrix splits
    /// between any two rows).
    pub fn rows(&self, first: usize, n: usize) -> Linear {
        assert!(
            first + n <= self.n_out,
            "rows {first}+{n} of {}",
            self.n_out
        );
        Linear {
            first_row: self.first_row + first,
            n_out: n,
            ..self.clone()
        }
    }

    /// Columns `first .. first + n` of every row. A quantized row is a sequence of blocks
    /// of `ty().block_size()` weights, so the share must start and end on block boundaries;
    /// `None` when it would cut a block.
    pub fn columns(&self, first: usize, n: usize) -> Option<Linear> {
        let block = self.ty().block_size();
        if first % block != 0 || n % block != 0 || first + n > self.n_in {
            return None;
        }
        Some(Linear {
            first_col: self.first_col + first,
            n_in: n,
            ..self.clone()
        })
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
        self.n_in
    }
    fn n_out(&self) -> usize {
        self.n_out
    }
    fn row(&self, r: usize) -> &[u8] {
        let ty = self.ty();
        // Block-aligned columns (checked by `columns`), so these are whole blocks.
        let skip = ty.row_bytes(self.first_col as u64).expect("block-aligned") as usize;
        let len = ty.row_bytes(self.n_in as u64).expect("block-aligned") as usize;
        let start = (self.first_row + r) * self.row_bytes + skip;
        &self.tensor.bytes()[start..start + len]
    }
}
