//! The forward pass, written once: every architecture is a [`Decoder`](super::Decoder)
//! (pre-norm attention and FFN blocks with per-architecture options), and every backend
//! runs it through the same sequence of coarse operations over one
//! [`ForwardBatch`](crate::batch::ForwardBatch). The operations are coarse (a whole
//! attention or FFN block) so that each backend fuses inside them as it likes: the GPU
//! folds the residual add into the next block's norm and its activation quantization, the
//! CPU quantizes activations once for the projections that share them.

use super::layers::Hyper;

/// What a backend provides to run [`forward`] over a batch it was given. The batch, the
/// KV pool and the weights are the backend's; the operations say which layer.
pub trait LayerOps {
    type Error;
    /// Each token's embedding row (scaled where the architecture asks) into the residual
    /// stream.
    fn embed(&mut self) -> Result<(), Self::Error>;
    /// Layer `layer`'s attention block: norm, q/k/v projections (biases, QK-norms),
    /// rotary embedding, the batch's keys and values into their pool slots, causal
    /// attention of each token over its sequence's blocks, the output projection (and
    /// post-norm), added to the residual stream.
    fn attention(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// Layer `layer`'s FFN block (dense gated, or routed experts): norm, projections, the
    /// gated activation (and post-norm), added to the residual stream.
    fn ffn(&mut self, layer: usize) -> Result<(), Self::Error>;
    /// The final norm and output projection of the batch's logit rows (and the final soft
    /// cap where the architecture has one, or where the backend applies it later).
    fn head(&mut self) -> Result<(), Self::Error>;
}

/// One forward pass: embed, each layer's attention and FFN blocks, the output head.
pub fn forward<B: LayerOps>(hp: &Hyper, ops: &mut B) -> Result<(), B::Error> {
    ops.embed()?;
    for layer in 0..hp.n_layer {
        ops.attention(layer)?;
        ops.ffn(layer)?;
    }
    ops.head()
}
