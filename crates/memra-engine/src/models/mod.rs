//! Model architectures. Each file reads one architecture's hyperparameters and tensors
//! (by GGUF key and tensor name) into the shared [`layers::Decoder`]; adding an
//! architecture is one file and one line in [`REGISTRY`].

pub mod forward;
mod gemma3;
pub mod layers;
mod llama;
mod qwen2;
mod qwen3;
mod qwen3moe;
pub mod rope;
pub mod weights;

use std::path::Path;
use std::sync::Arc;

use memra_gguf::{GgmlType, GgufError, GgufFile, MetadataError};

use crate::tokenizer::{Tokenizer, TokenizerError};
pub use layers::{Decoder, LogitRows};
use weights::TensorSource;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    File(#[from] GgufError),
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("unsupported architecture {0:?} (supported: {list})", list = supported_architectures().join(", "))]
    UnknownArchitecture(String),
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
    #[error("tensor {tensor:?} has shape {found:?}, expected {expected:?}")]
    Shape {
        tensor: String,
        expected: Vec<u64>,
        found: Vec<u64>,
    },
    #[error("tensor {tensor:?} is {ty}, which the CPU backend cannot decode")]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("invalid model: {0}")]
    Invalid(String),
    #[error("tensor-parallel exchange failed: {0}")]
    Collective(#[from] crate::parallel::CollectiveError),
    #[error("the context is full: {needed} positions needed, {n_ctx} available")]
    ContextFull { needed: usize, n_ctx: usize },
}

type Loader = fn(&Arc<GgufFile>, &layers::Hyper) -> Result<Decoder, ModelError>;

/// `general.architecture` values and their loaders.
const REGISTRY: [(&str, Loader); 5] = [
    ("llama", llama::load),
    ("qwen2", qwen2::load),
    ("qwen3", qwen3::load),
    ("qwen3moe", qwen3moe::load),
    ("gemma3", gemma3::load),
];

pub fn supported_architectures() -> Vec<&'static str> {
    REGISTRY.iter().map(|(a, _)| *a).collect()
}

/// A loaded model: the decoder, its tokenizer and what the file says about it.
pub struct Model {
    pub arch: String,
    pub name: String,
    pub decoder: Decoder,
    pub tokenizer: Tokenizer,
    pub file: Arc<GgufFile>,
    pub n_params: u64,
}

impl Model {
    pub fn load(path: &Path) -> Result<Model, ModelError> {
        Model::from_file(Arc::new(GgufFile::open(path)?))
    }

    pub fn from_file(file: Arc<GgufFile>) -> Result<Model, ModelError> {
        let m = &file.metadata;
        let arch = m.architecture()?.to_string();
        let Some((_, loader)) = REGISTRY.iter().find(|(a, _)| *a == arch) else {
            return Err(ModelError::UnknownArchitecture(arch));
        };
        let tokenizer = Tokenizer::from_metadata(m)?;
        let hp = layers::Hyper::read(m, &arch, tokenizer.n_vocab())?;
        let decoder = loader(&file, &hp)?;
        let name = m.get_str("general.name")?.unwrap_or(&arch).to_string();
        let n_params = file.tensors.iter().map(|t| t.n_elements()).sum();
        Ok(Model {
            arch,
            name,
            decoder,
            tokenizer,
            file,
            n_params,
        })
    }
}

/// The embedding, final norm and output projection (tied to the embedding when the file
/// has no `output.weight`).
fn embeddings(
    src: &TensorSource,
    hp: &layers::Hyper,
) -> Result<(weights::Linear, Vec<f32>, weights::Linear), ModelError> {
    let (e, v) = (hp.n_embd as u64, hp.n_vocab as u64);
    let token_embd = src.linear("token_embd.weight", e, v)?;
    let output = match src.optional("output.weight", &[e, v])? {
        Some(_) => src.linear("output.weight", e, v)?,
        None => token_embd.clone(),
    };
    Ok((token_embd, src.vector("output_norm.weight", e)?, output))
}

/// `MEMRA_CPU_F32_ACTIVATIONS=1`: load decoders with [`Decoder::exact_activations`] on.
pub(crate) fn exact_activations_from_env() -> bool {
    std::env::var("MEMRA_CPU_F32_ACTIVATIONS").is_ok_and(|v| v == "1")
}
