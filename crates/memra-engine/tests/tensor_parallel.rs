//! Tensor parallelism on the CPU over the in-process collective: N ranks give the logits
//! and greedy tokens of the whole model (f32 sums in another order: the activations are
//! quantized in the same blocks, since shares end on block boundaries), and models that
//! do not split are refused with the reason.

mod common;

use memra_engine::backend::cpu::kv::KvPool;
use memra_engine::batch::ForwardBatch;
use memra_engine::models::weights::WeightRows;
use memra_engine::models::Model;
use memra_engine::parallel::{CpuTensorParallel, ParallelError};
use memra_engine::sampler::argmax;
use memra_engine::synth::shapes::{shape, QuantMix, Shape};
use memra_engine::synth::write_model;
use memra_gguf::quant::dequantize_to_vec;
use memra_gguf::GgmlType;

const BLOCK: usize = 16;
const BLOCKS: usize = 8;

/// Two sequences of different lengths in one batch, every row's logits asked for.
fn prompt_batch() -> ForwardBatch {
    let mut b = ForwardBatch::new(BLOCK);
    let a: Vec<u32> = (0..21).map(|i| (i * 37 + 5) % 250).collect();
    let c: Vec<u32> = (0..7).map(|i| (i * 11 + 3) % 250).collect();
    b.push(&a, 0, &[0, 1], 0..a.len());
    b.push(&c, 0, &[5], 0..c.len());
    b
}

/// Anything that runs a forward over a batch: the whole model or its ranks.
trait Forward {
    fn run(&mut self, batch: &ForwardBatch) -> Vec<f32>;
}

struct Whole<'a>(&'a Model, KvPool);

impl Forward for Whole<'_> {
    fn run(&mut self, batch: &ForwardBatch) -> Vec<f32> {
        self.0.decoder.forward_batch(&mut self.1, batch).unwrap()
    }
}

impl Forward for CpuTensorParallel {
    fn run(&mut self, batch: &ForwardBatch) -> Vec<f32> {
        self.forward_batch(batch).unwrap()
    }
}

/// The prompt batch's logits, then `n` greedy tokens of its first sequence.
fn run(f: &mut dyn Forward, n_vocab: usize, n: usize) -> (Vec<f32>, Vec<u32>) {
    let batch = prompt_batch();
    let logits = f.run(&batch);
    let p0 = batch.seq_tokens(0).len();
    let mut tok = argmax(&logits[(p0 - 1) * n_vocab..p0 * n_vocab]);
    let mut out = vec![tok];
    for pos in p0..p0 + n - 1 {
        let mut step = ForwardBatch::new(BLOCK);
        step.push(&[tok], pos, &[0, 1, 2], 0..1);
        tok = argmax(&f.run(&step));
        out.push(tok);
    }
    (logits, out)
}

/// Largest difference relative to the largest logit.
fn rel_max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

/// `world` ranks against the whole model, with f32 activations and with llama.cpp's Q8
/// rounding of them. f32: only the order of the sums of partial products differs, logits
/// within 1e-4 of the largest (measured 1e-7 to 1e-6). Q8: a value that moves by a
/// rounding error can land in the next quantization step, so the difference grows to
/// about 3e-3 of the largest logit (measured on the synthetic llama at 2 ranks); the
/// bound is 2e-2. Greedy tokens equal in both.
fn check_equal(model: &mut Model, world: usize) {
    for (exact, bound) in [(true, 1e-4), (false, 2e-2)] {
        model.decoder.exact_activations = exact;
        let nv = model.decoder.hp.n_vocab;
        let pool = model.decoder.new_pool(BLOCKS, BLOCK);
        let (want_logits, want_tokens) = run(&mut Whole(model, pool), nv, 8);
        let mut tp = CpuTensorParallel::new(&model.decoder, world, BLOCKS, BLOCK).unwrap();
        let (logits, tokens) = run(&mut tp, nv, 8);
        let d = rel_max_diff(&want_logits, &logits);
        eprintln!(
            "{} at {world} ranks, f32 activations {exact}: logits differ by {d:.2e} of the largest",
            model.name
        );
        assert!(d < bound, "{}: {d}", model.name);
        assert_eq!(tokens, want_tokens, "{}", model.name);
        // Not a trivial model: the logits vary.
        assert!(want_logits.iter().any(|&v| v != want_logits[0]));
    }
}

#[test]
fn tiny_qwen3_at_two_ranks_equals_one() {
    // The only tiny model whose wo and ffn_down split on their blocks at 2 ranks (the
    // llama and qwen2 ones have an IQ4_XS wo of 256 columns: refused below).
    let mut model = Model::load(&common::model_path("tiny-qwen3")).unwrap();
    check_equal(&mut model, 2);
    // One rank is the same code with nobody to exchange with.
    check_equal(&mut model, 1);
}

/// A small synthetic model written to a temporary file.
fn synth(shape: &Shape, mix: QuantMix, tag: &str) -> Model {
    let dir = std::env::temp_dir().join(format!("memra-tp-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.gguf");
    write_model(&path, shape, mix, 7, |_, _| {}).unwrap();
    let model = Model::load(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    model
}

#[test]
fn llama3_1b_heads_at_two_four_and_eight_ranks_equal_one() {
    // llama3-1b's 32 query and 8 KV heads, in a small width: heads of 16, 2 layers, FFN
    // 1024 (Q4_0: 32-weight blocks; shares of wo and down end on them at 8 ranks).
    let small = Shape {
        n_embd: 512,
        n_layer: 2,
        n_ff: 1024,
        head_dim: 16,
        vocab: 4096,
        ..shape("llama3-1b").unwrap().clone()
    };
    let mut model = synth(&small, QuantMix::Q4_0, "llama");
    for world in [2, 4, 8] {
        check_equal(&mut model, world);
    }
}

#[test]
fn experts_and_qk_norms_at_two_ranks_equal_one() {
    // qwen3-30b-a3b's routed experts and QK-norms, small: every expert's FFN split.
    let small = Shape {
        n_embd: 256,
        n_layer: 2,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 128,
        head_dim: 64,
        vocab: 1024,
        experts: Some((8, 2)),
        ..shape("qwen3-30b-a3b").unwrap().clone()
    };
    let mut model = synth(&small, QuantMix::Q8_0, "moe");
    check_equal(&mut model, 2);
}

fn refusal(name: &str, world: usize) -> ParallelError {
    let model = Model::load(&common::model_path(name)).unwrap();
    CpuTensorParallel::new(&model.decoder, world, BLOCKS, BLOCK)
        .err()
        .expect("refused")
}

#[test]
fn models_that_do_not_split_are_refused_with_the_reason() {
    // Gemma's one KV head: never split (KV heads are not replicated).
    let e = refusal("tiny-gemma3", 2);
    assert!(
        matches!(
            e,
            ParallelError::Heads {
                what: "KV",
                n: 1,
                world: 2
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string()
            .contains("1 KV heads do not split over 2 ranks"),
        "{e}"
    );
    // 4 query heads over 3 ranks.
    let e = refusal("tiny-llama", 3);
    assert!(
        matches!(
            e,
            ParallelError::Heads {
                what: "attention",
                n: 4,
                world: 3
            }
        ),
        "{e}"
    );
    // tiny-llama's 2 KV heads at 4 ranks.
    let e = refusal("tiny-llama", 4);
    assert!(
        matches!(
            e,
            ParallelError::Heads {
                what: "KV",
                n: 2,
                world: 4
            }
        ),
        "{e}"
    );
    // The MoE tiny model's experts are Q4_K (256-weight blocks) over 256 columns: halves
    // would cut every block of ffn_down_exps.
    let e = refusal("tiny-qwen3moe", 2);
    match &e {
        ParallelError::Blocks {
            tensor,
            block: 256,
            n_in: 256,
            world: 2,
            ..
        } => {
            assert_eq!(tensor, "blk.0.ffn_down_exps.weight")
        }
        _ => panic!("{e}"),
    }
    assert!(e.to_string().contains("cut its quant blocks"), "{e}");
    // Layer 1's wo is IQ4_XS (256-weight blocks) over 256 columns.
    for name in ["tiny-llama", "tiny-qwen2"] {
        let e = refusal(name, 2);
        match &e {
            ParallelError::Blocks {
                tensor,
                block: 256,
                n_in: 256,
                ..
            } => {
                assert_eq!(tensor, "blk.1.attn_output.weight")
            }
            _ => panic!("{e}"),
        }
    }
    let e = refusal("tiny-llama", 0);
    assert!(matches!(e, ParallelError::World(0)), "{e}");
}

#[test]
fn a_column_share_holds_those_columns_of_every_row() {
    let model = Model::load(&common::model_path("tiny-qwen3")).unwrap();
    let wo = &model.decoder.layers[0].wo; // Q5_0, 512 columns, 256 rows
    assert_eq!((wo.ty(), wo.n_in(), wo.n_out()), (GgmlType::Q5_0, 512, 256));
    let share = wo.columns(256, 256).unwrap();
    let packed = share.packed();
    let rb = packed.len() / share.n_out();
    for r in [0, 7, 255] {
        let part = dequantize_to_vec(wo.ty(), &packed[r * rb..(r + 1) * rb]).unwrap();
        assert_eq!(part, wo.row_f32(r)[256..512]);
    }
    let rows = wo.rows(8, 4);
    assert_eq!(rows.row_f32(0), wo.row_f32(8));
    assert!(
        wo.columns(16, 256).is_none(),
        "cuts Q5_0's 32-weight blocks"
    );
    assert!(wo.columns(256, 288).is_none(), "past the row");
}
