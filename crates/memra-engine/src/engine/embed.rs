//! Embeddings: a request that generates nothing and gets its prompt's last hidden states
//! (after the output norm, as llama.cpp's embeddings are) pooled into one vector.

use memra_gguf::{Metadata, MetadataError};

use crate::models::Model;

/// How an embedding request pools its prompt's hidden states.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every prompt token.
    Mean,
    /// The first token's.
    Cls,
    /// The last token's (decoder models trained for embeddings: Qwen3-Embedding).
    Last,
}

impl Pooling {
    /// llama-server's `--pooling` names.
    pub fn parse(s: &str) -> Option<Pooling> {
        match s {
            "mean" => Some(Pooling::Mean),
            "cls" => Some(Pooling::Cls),
            "last" => Some(Pooling::Last),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
        }
    }

    /// What the file says (`{arch}.pooling_type`, llama.cpp's numbering: 1 mean, 2 cls, 3
    /// last); `None` for a file that says nothing, or none (0), or a kind memra does not
    /// pool (rank).
    pub fn from_metadata(m: &Metadata, arch: &str) -> Result<Option<Pooling>, MetadataError> {
        Ok(match m.get_u32(&format!("{arch}.pooling_type"))? {
            Some(1) => Some(Pooling::Mean),
            Some(2) => Some(Pooling::Cls),
            Some(3) => Some(Pooling::Last),
            _ => None,
        })
    }

    /// How a model's embeddings pool: as `asked`, else as its file says, else by the last
    /// token (vLLM's pooling of decoder models); a reranker's file (rank pooling) must be
    /// asked for one. A model whose file says its attention is not causal
    /// (`{arch}.attention.causal` false: gte-Qwen2, the BERT family) is refused: memra's
    /// forward is causal, so its states would be wrong.
    pub fn for_model(model: &Model, asked: Option<Pooling>) -> Result<Pooling, String> {
        let m = &model.file.metadata;
        let key = format!("{}.attention.causal", model.arch);
        if m.get_bool(&key).map_err(|e| e.to_string())? == Some(false) {
            return Err(format!(
                "the model's attention is not causal ({key} false), which memra does not \
                 compute: its embeddings would be wrong"
            ));
        }
        if let Some(p) = asked {
            return Ok(p);
        }
        let key = format!("{}.pooling_type", model.arch);
        if m.get_u32(&key).map_err(|e| e.to_string())? == Some(4) {
            // A reranker's score comes from a classification head memra does not load.
            return Err(format!(
                "the model pools for ranking ({key} 4: a reranker), which memra does not \
                 compute; --pooling mean, cls or last chooses a pooling of its states"
            ));
        }
        Ok(Pooling::from_metadata(m, &model.arch)
            .map_err(|e| e.to_string())?
            .unwrap_or(Pooling::Last))
    }

    /// Whether the prefix cache may hold the prompt: only the last token's state is
    /// needed, and that token is always computed.
    pub(super) fn may_use_prefix_cache(self) -> bool {
        self == Pooling::Last
    }

    /// Which of a chunk's tokens (positions `start..start + n` of a prompt of `len`) give
    /// their hidden state, by index in the chunk.
    pub(super) fn rows(self, start: usize, n: usize, len: usize) -> Vec<usize> {
        match self {
            Pooling::Mean => (0..n).collect(),
            Pooling::Cls if start == 0 => vec![0],
            Pooling::Last if start + n == len => vec![n - 1],
            Pooling::Cls | Pooling::Last => Vec::new(),
        }
    }
}

/// llama.cpp's `common_embd_normalize`: `-1` leaves `v`, `0` scales its largest magnitude
/// to 32,760 (int16 range), `1` to a taxicab norm of 1, `2` a Euclidean norm of 1, `p` a
/// p-norm of 1. A zero vector stays zero.
pub fn normalize(v: &mut [f32], norm: i64) {
    let sum = match norm {
        -1 => return,
        0 => v.iter().fold(0f64, |m, &x| m.max(f64::from(x.abs()))) / 32_760.0,
        1 => v.iter().map(|&x| f64::from(x.abs())).sum(),
        2 => v
            .iter()
            .map(|&x| f64::from(x) * f64::from(x))
            .sum::<f64>()
            .sqrt(),
        p => {
            let p = p as f64;
            v.iter()
                .map(|&x| f64::from(x.abs()).powf(p))
                .sum::<f64>()
                .powf(1.0 / p)
        }
    };
    let scale = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    v.iter_mut()
        .for_each(|x| *x = (f64::from(*x) * scale) as f32);
}

/// A sequence's pooled states so far.
#[derive(Clone, Debug, Default)]
pub(super) struct Pooled {
    sum: Vec<f64>,
    n: usize,
}

impl Pooled {
    /// Adds a chunk's states; a chunk from position 0 starts over (a preempted sequence
    /// recomputes its prompt).
    pub(super) fn add(&mut self, start: usize, states: impl IntoIterator<Item = Vec<f32>>) {
        if start == 0 {
            *self = Pooled::default();
        }
        for s in states {
            if self.sum.is_empty() {
                self.sum = vec![0.0; s.len()];
            }
            self.sum
                .iter_mut()
                .zip(&s)
                .for_each(|(a, &b)| *a += f64::from(b));
            self.n += 1;
        }
    }

    /// The mean of what was added (for `Cls` and `Last`, the one state).
    pub(super) fn take(&mut self) -> Vec<f32> {
        let n = self.n.max(1) as f64;
        std::mem::take(&mut self.sum)
            .into_iter()
            .map(|v| (v / n) as f32)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_of_chunks_cover_what_each_pooling_needs() {
        // A prompt of 10 in chunks of 4, 4, 2.
        let chunks = [(0, 4), (4, 4), (8, 2)];
        let all = |p: Pooling| -> Vec<usize> {
            chunks
                .iter()
                .flat_map(|&(s, n)| p.rows(s, n, 10).into_iter().map(move |i| s + i))
                .collect()
        };
        assert_eq!(all(Pooling::Mean), (0..10).collect::<Vec<_>>());
        assert_eq!(all(Pooling::Cls), [0]);
        assert_eq!(all(Pooling::Last), [9]);
        assert_eq!(Pooling::Last.rows(0, 1, 1), [0]);
    }

    #[test]
    fn pooled_is_the_mean_and_starts_over_at_position_zero() {
        let mut p = Pooled::default();
        p.add(0, [vec![1.0, 2.0], vec![3.0, 6.0]]);
        p.add(2, [vec![5.0, 1.0]]);
        assert_eq!(p.take(), [3.0, 3.0]);
        p.add(0, [vec![9.0, 9.0]]);
        p.add(0, [vec![1.0, -1.0]]); // recomputed after a preemption
        assert_eq!(p.take(), [1.0, -1.0]);
    }

    #[test]
    fn norms_as_llama_cpp_computes_them() {
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, 2);
        assert_eq!(v, [0.6, -0.8]);
        let mut v = vec![3.0, -1.0];
        normalize(&mut v, 1);
        assert_eq!(v, [0.75, -0.25]);
        let mut v = vec![2.0, -1.0];
        normalize(&mut v, 0);
        assert_eq!(v, [32_760.0, -16_380.0]);
        let mut v = vec![3.0, -4.0];
        normalize(&mut v, -1);
        assert_eq!(v, [3.0, -4.0]);
        let mut v = vec![1.0, 1.0];
        normalize(&mut v, 4);
        let want = 0.5f64.powf(0.25) as f32;
        assert!((v[0] - want).abs() < 1e-6 && (v[1] - want).abs() < 1e-6);
        let mut z = vec![0.0, 0.0];
        normalize(&mut z, 2);
        assert_eq!(z, [0.0, 0.0]);
    }

    #[test]
    fn names_and_metadata_values() {
        for p in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
            assert_eq!(Pooling::parse(p.name()), Some(p));
        }
        assert_eq!(Pooling::parse("rank"), None);
    }
}
