//! `memra synth`: random-weight GGUF models with real shapes and quant mixes, for
//! benchmarks (speed does not depend on weight values). Quant blocks are random bytes
//! with small positive f16 scales; norms are near 1; the tokenizer is a working byte-level
//! BPE vocabulary of the shape's size. Tensor bytes are generated in parallel and streamed
//! to disk, so a 5 GB model takes about as long as the disk needs to write it.

mod rng;
pub mod shapes;
pub mod vocab;

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use half::f16;
use memra_gguf::quant::f16_scale_fields;
use memra_gguf::{string_array, GgufBuilder, Layout, TensorSpec, Value, ValueType};
use rayon::prelude::*;

use rng::Rng;
pub use shapes::{shape, QuantMix, Shape, SHAPES};
use shapes::{Fill, SynthTensor};

/// Bytes handed to the writer at a time.
const CHUNK_BYTES: usize = 16 << 20;
/// Bytes one parallel task generates.
const TASK_BYTES: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Write(#[from] memra_gguf::WriteError),
}

/// The GGUF header content (metadata and tensor specs) of a synthetic model.
pub fn builder(shape: &Shape, mix: QuantMix, seed: u64) -> (GgufBuilder, Vec<SynthTensor>) {
    let tensors = shapes::tensors(shape, mix);
    let mut b = GgufBuilder::new();
    let m = &mut b.metadata;
    let arch = shape.arch;
    let u32v = |v: u64| Value::U32(v as u32);
    m.set("general.architecture", Value::String(arch.into()));
    m.set(
        "general.name",
        Value::String(format!("synthetic {} {}", shape.name, mix.name())),
    );
    m.set("general.file_type", Value::U32(mix.file_type()));
    m.set("general.quantization_version", Value::U32(2));
    m.set(format!("{arch}.context_length"), u32v(shape.context));
    m.set(format!("{arch}.embedding_length"), u32v(shape.n_embd));
    m.set(format!("{arch}.block_count"), u32v(shape.n_layer));
    m.set(format!("{arch}.attention.head_count"), u32v(shape.n_head));
    m.set(
        format!("{arch}.attention.head_count_kv"),
        u32v(shape.n_head_kv),
    );
    m.set(format!("{arch}.attention.key_length"), u32v(shape.head_dim));
    m.set(
        format!("{arch}.attention.value_length"),
        u32v(shape.head_dim),
    );
    m.set(format!("{arch}.rope.dimension_count"), u32v(shape.head_dim));
    m.set(
        format!("{arch}.rope.freq_base"),
        Value::F32(shape.rope_base),
    );
    m.set(
        format!("{arch}.attention.layer_norm_rms_epsilon"),
        Value::F32(shape.rms_eps),
    );
    m.set(format!("{arch}.vocab_size"), u32v(shape.vocab));
    match shape.experts {
        None => m.set(format!("{arch}.feed_forward_length"), u32v(shape.n_ff)),
        Some((n, used)) => {
            m.set(format!("{arch}.expert_count"), u32v(n));
            m.set(format!("{arch}.expert_used_count"), u32v(used));
            m.set(
                format!("{arch}.expert_feed_forward_length"),
                u32v(shape.n_ff),
            );
        }
    }
    let vocab = vocab::byte_level_bpe(shape.vocab as usize, shape.pre, seed);
    m.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    m.set("tokenizer.ggml.pre", Value::String(shape.pre.into()));
    m.set("tokenizer.ggml.tokens", string_array(vocab.tokens));
    m.set(
        "tokenizer.ggml.token_type",
        Value::Array(
            ValueType::I32,
            vocab.token_types.into_iter().map(Value::I32).collect(),
        ),
    );
    m.set("tokenizer.ggml.merges", string_array(vocab.merges));
    m.set("tokenizer.ggml.bos_token_id", Value::U32(vocab.bos));
    m.set("tokenizer.ggml.eos_token_id", Value::U32(vocab.eos));
    m.set(
        "tokenizer.ggml.add_bos_token",
        Value::Bool(shape.pre != "qwen2"),
    );
    b.tensors = tensors
        .iter()
        .map(|t| TensorSpec::new(t.name.clone(), t.ty, &t.dims))
        .collect();
    (b, tensors)
}

/// Small positive f16 scales, indexed by a random byte: 2^-11 .. 2^-9.
fn scale_table() -> [[u8; 2]; 256] {
    std::array::from_fn(|i| f16::from_f32((1.0 + 3.0 * i as f32 / 255.0) / 2048.0).to_le_bytes())
}

/// Fills `chunk`, the bytes at `offset` of tensor `t`, deterministically from `seed`.
fn fill_chunk(t: &SynthTensor, index: usize, offset: u64, chunk: &mut [u8], seed: u64) {
    let block = t.ty.type_size();
    let task = (TASK_BYTES / block).max(1) * block;
    let scales = scale_table();
    chunk
        .par_chunks_mut(task)
        .enumerate()
        .for_each(|(k, part)| {
            let at = offset + (k * task) as u64;
            let mut rng = Rng::new(seed ^ ((index as u64) << 40), at);
            match t.fill {
                Fill::Blocks => {
                    rng.fill_bytes(part);
                    let fields = f16_scale_fields(t.ty);
                    for b in part.chunks_exact_mut(block) {
                        for &f in fields {
                            // The block's own random byte picks its scale.
                            let s = scales[b[f] as usize];
                            b[f..f + 2].copy_from_slice(&s);
                        }
                    }
                }
                Fill::Uniform { center, spread } => {
                    for v in part.chunks_exact_mut(4) {
                        let x = center + spread * (2.0 * rng.next_f32() - 1.0);
                        v.copy_from_slice(&x.to_le_bytes());
                    }
                }
            }
        });
}

/// Writes a synthetic model to `path`, calling `progress(bytes_written, total)` as it goes.
/// Returns the file layout. A partly written file is removed on error.
pub fn write_model(
    path: &Path,
    shape: &Shape,
    mix: QuantMix,
    seed: u64,
    mut progress: impl FnMut(u64, u64),
) -> Result<Layout, SynthError> {
    let (builder, tensors) = builder(shape, mix, seed);
    let total = builder.layout()?.file_size;
    let io = |source| SynthError::Io {
        path: path.display().to_string(),
        source,
    };
    let file = File::create(path).map_err(io)?;
    let mut out = BufWriter::with_capacity(CHUNK_BYTES, file);
    let mut done = 0u64;
    let result = builder
        .write_streaming(&mut out, CHUNK_BYTES, |i, offset, chunk| {
            fill_chunk(&tensors[i], i, offset, chunk, seed);
            done += chunk.len() as u64;
            progress(done, total);
        })
        .map_err(SynthError::from)
        .and_then(|layout| {
            out.flush().map_err(io)?;
            Ok(layout)
        });
    if result.is_err() {
        let _ = std::fs::remove_file(path);
    }
    result
}
