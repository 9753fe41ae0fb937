//! The benchmark model shapes and quant mixes (`../shared/models/README.md`), and the
//! tensor list each combination produces.

use memra_gguf::GgmlType;

/// A model shape: hyperparameters of a real model family, weights left to chance.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    pub name: &'static str,
    pub arch: &'static str,
    pub n_embd: u64,
    pub n_layer: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    /// Dense FFN width, or each expert's width for MoE shapes.
    pub n_ff: u64,
    pub head_dim: u64,
    pub vocab: u64,
    pub rope_base: f32,
    pub rms_eps: f32,
    pub context: u64,
    /// (experts, experts used per token) for MoE shapes.
    pub experts: Option<(u64, u64)>,
    /// q/k/v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// RMS norms on q and k per head (Qwen3).
    pub qk_norm: bool,
    /// Tokenizer pre-tokenizer name (`tokenizer.ggml.pre`).
    pub pre: &'static str,
}

const LLAMA3: Shape = Shape {
    name: "",
    arch: "llama",
    n_embd: 0,
    n_layer: 0,
    n_head: 0,
    n_head_kv: 0,
    n_ff: 0,
    head_dim: 128,
    vocab: 151_936,
    rope_base: 500_000.0,
    rms_eps: 1e-5,
    context: 8192,
    experts: None,
    qkv_bias: false,
    qk_norm: false,
    pre: "llama-bpe",
};

/// Every shape `memra synth` knows.
pub const SHAPES: [Shape; 6] = [
    Shape {
        name: "llama3-8b",
        n_embd: 4096,
        n_layer: 32,
        n_head: 32,
        n_head_kv: 8,
        n_ff: 14336,
        ..LLAMA3
    },
    Shape {
        name: "llama3-1b",
        n_embd: 2048,
        n_layer: 16,
        n_head: 32,
        n_head_kv: 8,
        n_ff: 8192,
        head_dim: 64,
        ..LLAMA3
    },
    Shape {
        name: "qwen2.5-7b",
        arch: "qwen2",
        n_embd: 3584,
        n_layer: 28,
        n_head: 28,
        n_head_kv: 4,
        n_ff: 18944,
        vocab: 152_064,
        context: 32768,
        qkv_bias: true,
        pre: "qwen2",
        ..LLAMA3
    },
    // Qwen2.5(-Coder) 0.5B: rows of 896 are not whole K-quant blocks, so its Q4_K_M file
    // is mostly Q5_0 and Q8_0 (the fallback rule in `tensors`); the small-model decode row.
    Shape {
        name: "qwen2.5-0.5b",
        arch: "qwen2",
        n_embd: 896,
        n_layer: 24,
        n_head: 14,
        n_head_kv: 2,
        n_ff: 4864,
        head_dim: 64,
        rope_base: 1_000_000.0,
        rms_eps: 1e-6,
        context: 32768,
        qkv_bias: true,
        pre: "qwen2",
        ..LLAMA3
    },
    Shape {
        name: "llama3-70b",
        n_embd: 8192,
        n_layer: 80,
        n_head: 64,
        n_head_kv: 8,
        n_ff: 28672,
        ..LLAMA3
    },
    Shape {
        name: "qwen3-30b-a3b",
        arch: "qwen3moe",
        n_embd: 2048,
        n_layer: 48,
        n_head: 32,
        n_head_kv: 4,
        n_ff: 768,
        rope_base: 1_000_000.0,
        rms_eps: 1e-6,
        context: 32768,
        experts: Some((128, 8)),
        qk_norm: true,
        pre: "qwen2",
        ..LLAMA3
    },
];

pub fn shape(name: &str) -> Option<&'static Shape> {
    SHAPES.iter().find(|s| s.name == name)
}

/// How weight matrices are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMix {
    /// Every matrix Q8_0.
    Q8_0,
    /// Every matrix Q4_0, output Q6_K.
    Q4_0,
    /// llama.cpp's Q4_K_M: output Q6_K, attn_v and ffn_down Q6_K in some layers, Q4_K else.
    Q4KM,
}

impl QuantMix {
    pub const NAMES: [&'static str; 3] = ["q8_0", "q4_0", "q4_k_m"];

    pub fn from_name(name: &str) -> Option<QuantMix> {
        match name.to_ascii_lowercase().as_str() {
            "q8_0" => Some(QuantMix::Q8_0),
            "q4_0" => Some(QuantMix::Q4_0),
            "q4_k_m" => Some(QuantMix::Q4KM),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q8_0 => "q8_0",
            QuantMix::Q4_0 => "q4_0",
            QuantMix::Q4KM => "q4_k_m",
        }
    }

    /// ggml's `general.file_type` (`LLAMA_FTYPE_MOSTLY_*`).
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q8_0 => 7,
            QuantMix::Q4_0 => 2,
            QuantMix::Q4KM => 15,
        }
    }

    /// The type of a weight matrix, by its role and layer (`None` for non-layer tensors).
    fn matrix_type(self, role: &str, layer: Option<u64>, n_layer: u64) -> GgmlType {
        match self {
            QuantMix::Q8_0 => GgmlType::Q8_0,
            QuantMix::Q4_0 if role == "output" => GgmlType::Q6K,
            QuantMix::Q4_0 => GgmlType::Q4_0,
            QuantMix::Q4KM => {
                let wide = |i: u64| {
                    // llama.cpp's `use_more_bits`: the first and last eighth of the layers,
                    // and every third layer in between.
                    let l8 = n_layer / 8;
                    i < l8 || i >= 7 * n_layer / 8 || (i - l8) % 3 == 2
                };
                match (role, layer) {
                    ("output", _) => GgmlType::Q6K,
                    ("attn_v" | "ffn_down" | "ffn_down_exps", Some(i)) if wide(i) => GgmlType::Q6K,
                    _ => GgmlType::Q4K,
                }
            }
        }
    }
}

/// llama.cpp's fallback where rows are not whole blocks of 256 (`llama_tensor_get_type`):
/// Q4_K becomes Q5_0 and Q6_K becomes Q8_0.
fn fallback(ty: GgmlType, ncols: u64) -> GgmlType {
    match ty {
        GgmlType::Q4K if ncols % 256 != 0 => GgmlType::Q5_0,
        GgmlType::Q6K if ncols % 256 != 0 => GgmlType::Q8_0,
        ty => ty,
    }
}

/// What a tensor's values should look like when synthesized.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Random quant blocks with small positive scales.
    Blocks,
    /// F32 values uniform in `center ± spread`.
    Uniform { center: f32, spread: f32 },
}

/// One tensor of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthTensor {
    pub name: String,
    pub ty: GgmlType,
    pub dims: Vec<u64>,
    pub fill: Fill,
}

const NORM: Fill = Fill::Uniform {
    center: 1.0,
    spread: 0.1,
};
const BIAS: Fill = Fill::Uniform {
    center: 0.0,
    spread: 0.02,
};

/// The tensors of `shape` quantized with `mix`, in llama.cpp's file order.
pub fn tensors(shape: &Shape, mix: QuantMix) -> Vec<SynthTensor> {
    let mut out = Vec::new();
    let mut matrix = |name: String, role: &str, layer: Option<u64>, dims: &[u64]| {
        out.push(SynthTensor {
            name,
            ty: fallback(mix.matrix_type(role, layer, shape.n_layer), dims[0]),
            dims: dims.to_vec(),
            fill: Fill::Blocks,
        });
    };
    let (e, hd) = (shape.n_embd, shape.head_dim);
    let (q_out, kv_out) = (shape.n_head * hd, shape.n_head_kv * hd);
    matrix(
        "token_embd.weight".into(),
        "token_embd",
        None,
        &[e, shape.vocab],
    );
    let mut plain = Vec::new();
    for i in 0..shape.n_layer {
        let blk = |t: &str| format!("blk.{i}.{t}");
        plain.push((blk("attn_norm.weight"), vec![e], NORM));
        matrix(blk("attn_q.weight"), "attn_q", Some(i), &[e, q_out]);
        matrix(blk("attn_k.weight"), "attn_k", Some(i), &[e, kv_out]);
        matrix(blk("attn_v.weight"), "attn_v", Some(i), &[e, kv_out]);
        matrix(
            blk("attn_output.weight"),
            "attn_output",
            Some(i),
            &[q_out, e],
        );
        if shape.qkv_bias {
            plain.push((blk("attn_q.bias"), vec![q_out], BIAS));
            plain.push((blk("attn_k.bias"), vec![kv_out], BIAS));
            plain.push((blk("attn_v.bias"), vec![kv_out], BIAS));
        }
        if shape.qk_norm {
            plain.push((blk("attn_q_norm.weight"), vec![hd], NORM));
            plain.push((blk("attn_k_norm.weight"), vec![hd], NORM));
        }
        plain.push((blk("ffn_norm.weight"), vec![e], NORM));
        let f = shape.n_ff;
        match shape.experts {
            None => {
                matrix(blk("ffn_gate.weight"), "ffn_gate", Some(i), &[e, f]);
                matrix(blk("ffn_up.weight"), "ffn_up", Some(i), &[e, f]);
                matrix(blk("ffn_down.weight"), "ffn_down", Some(i), &[f, e]);
            }
            Some((n_exp, _)) => {
                plain.push((
                    blk("ffn_gate_inp.weight"),
                    vec![e, n_exp],
                    Fill::Uniform {
                        center: 0.0,
                        spread: 0.05,
                    },
                ));
                matrix(
                    blk("ffn_gate_exps.weight"),
                    "ffn_gate_exps",
                    Some(i),
                    &[e, f, n_exp],
                );
                matrix(
                    blk("ffn_up_exps.weight"),
                    "ffn_up_exps",
                    Some(i),
                    &[e, f, n_exp],
                );
                matrix(
                    blk("ffn_down_exps.weight"),
                    "ffn_down_exps",
                    Some(i),
                    &[f, e, n_exp],
                );
            }
        }
    }
    plain.push(("output_norm.weight".into(), vec![e], NORM));
    matrix("output.weight".into(), "output", None, &[e, shape.vocab]);
    out.extend(plain.into_iter().map(|(name, dims, fill)| SynthTensor {
        name,
        ty: GgmlType::F32,
        dims,
        fill,
    }));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(name: &str, mix: QuantMix) -> u64 {
        tensors(shape(name).unwrap(), mix)
            .iter()
            .map(|t| t.ty.row_bytes(t.dims.iter().product()).unwrap())
            .sum()
    }

    /// Tensor data sizes of the reference files (models/README.md file sizes minus their
    /// headers, which hold llama.cpp's 151,936-token vocabulary: 3-4 MB).
    #[test]
    fn sizes_match_the_reference_files() {
        for (name, mix, file_size) in [
            ("llama3-8b", QuantMix::Q4KM, 5_052_969_856u64),
            ("llama3-8b", QuantMix::Q8_0, 8_744_993_664),
            ("llama3-70b", QuantMix::Q4KM, 42_744_809_568),
            ("qwen3-30b-a3b", QuantMix::Q4KM, 18_556_684_032),
            // The real Qwen2.5-Coder 0.5B Q4_K_M (its attn_v widening differs a little).
            ("qwen2.5-0.5b", QuantMix::Q4KM, 491_400_064),
        ] {
            let data = bytes(name, mix);
            assert!(data < file_size, "{name} {mix:?}: {data} >= {file_size}");
            let header = file_size - data;
            assert!(
                (1_000_000..8_000_000).contains(&header),
                "{name} {mix:?}: data {data}, leaves {header} bytes for the header"
            );
        }
    }

    #[test]
    fn q4_k_m_widens_the_right_layers() {
        let t = tensors(shape("llama3-8b").unwrap(), QuantMix::Q4KM);
        let ty = |n: &str| t.iter().find(|x| x.name == n).unwrap().ty;
        // 32 layers: wide are 0..4, 28..32, and 4 + 3k + 2 = 6, 9, ..., 27.
        for (layer, wide) in [
            (0, true),
            (3, true),
            (4, false),
            (5, false),
            (6, true),
            (9, true),
            (27, true),
            (26, false),
            (28, true),
            (31, true),
        ] {
            let want = if wide { GgmlType::Q6K } else { GgmlType::Q4K };
            assert_eq!(
                ty(&format!("blk.{layer}.attn_v.weight")),
                want,
                "layer {layer}"
            );
            assert_eq!(
                ty(&format!("blk.{layer}.ffn_down.weight")),
                want,
                "layer {layer}"
            );
            assert_eq!(ty(&format!("blk.{layer}.attn_k.weight")), GgmlType::Q4K);
        }
        assert_eq!(ty("output.weight"), GgmlType::Q6K);
        assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
        assert_eq!(ty("output_norm.weight"), GgmlType::F32);
    }
}
