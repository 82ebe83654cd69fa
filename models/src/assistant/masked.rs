//! HF's `Gemma4AssistantMaskedEmbedder`: the assistant's lm_head over the tokens of a few
//! clusters. The vocabulary is ordered into `num_centroids` clusters of equal size
//! (`token_ordering`); the final hidden state picks the `centroid_intermediate_top_k` clusters
//! whose centroids it scores highest, and only their tokens are scored against the (tied)
//! embedding table. Every other token gets the smallest computed logit minus one.

use super::config::OrderedEmbeddings;
use crate::{
    embedding::Embedding,
    projection::{Projection, WeightSettings},
    weights::{host_values, WeightKind, WeightSource},
    ModelError,
};
use burn::{
    module::Module,
    tensor::{DType, IndexingUpdateOp, Int, Tensor, TensorData},
};
use burn_gemma_kernels::GemmaBackend;

/// The centroid-masked lm_head.
#[derive(Module, Debug)]
pub struct MaskedEmbedder<B: GemmaBackend> {
    /// `centroids`: `[num_centroids, hidden]`.
    pub centroids: Projection<B>,
    /// `token_ordering` as `[num_centroids, tokens_per_centroid]`: the ids of each cluster.
    pub token_ordering: Tensor<B, 2, Int>,
    #[module(skip)]
    pub top_k: usize,
}

impl<B: GemmaBackend> MaskedEmbedder<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        ordered: OrderedEmbeddings,
        (vocab, hidden): (usize, usize),
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let OrderedEmbeddings { num_centroids, centroid_intermediate_top_k } = ordered;
        let centroids =
            Projection::load(source, &[("masked_embedding.centroids", num_centroids)], hidden, settings, device)?;
        let name = "masked_embedding.token_ordering";
        let ordering: Tensor<B, 1> = source.load(name, [vocab], WeightKind::Indices, DType::F32, device)?;
        let ids = host_values(ordering, name)?;
        // A permutation of the vocabulary: every id once (a repeated id would be scored twice
        // and another never).
        let mut seen = vec![false; vocab];
        let mut order = Vec::with_capacity(vocab);
        for &v in &ids {
            let id = v as usize;
            if v < 0.0 || v.fract() != 0.0 || id >= vocab || std::mem::replace(&mut seen[id], true) {
                return Err(ModelError::Source(
                    format!("{name} is not a permutation of the {vocab} token ids (found {v})").into(),
                ));
            }
            order.push(id as i64);
        }
        let per = ordered.tokens_per_centroid(vocab);
        let token_ordering = Tensor::from_data(TensorData::new(order, [num_centroids, per]), device);
        Ok(Self { centroids, token_ordering, top_k: centroid_intermediate_top_k })
    }

    /// Logits `[n, vocab]` (f32) of final hidden states `[n, hidden]`, `lm_head` the tied
    /// embedding table.
    pub fn logits(&self, hidden: Tensor<B, 2>, lm_head: &Embedding<B>) -> Tensor<B, 2> {
        let [n, width] = hidden.dims();
        let [clusters, per] = self.token_ordering.dims();
        let vocab = clusters * per;
        let scores = self.centroids.forward(hidden.clone().reshape([n, 1, width])).reshape([n, clusters]);
        let (_, best) = scores.cast(DType::F32).topk_with_indices(self.top_k, 1);
        let chosen =
            self.token_ordering.clone().select(0, best.reshape([n * self.top_k])).reshape([n, self.top_k * per]);
        // The chosen tokens' rows of the table, scored against each hidden state.
        let rows = lm_head.embed(chosen.clone(), 1.0, hidden.dtype());
        // Products and sums in f32 by Burn's element-wise operations, not its matmul (CUDA's f32
        // matmul rounds through TF32: the drafts' logits came out 1.2e-4 from HF's on the H200).
        let scored = (rows.cast(DType::F32) * hidden.cast(DType::F32).reshape([n, 1, width]))
            .sum_dim(2)
            .reshape([n, self.top_k * per]);
        let floor = scored.clone().min().reshape([1, 1]) - 1.0;
        let device = scored.device();
        let zeros = || Tensor::<B, 2>::zeros([n, vocab], (&device, DType::F32));
        let placed = zeros().scatter(1, chosen.clone(), scored, IndexingUpdateOp::Add);
        let chosen_mask = zeros().scatter(
            1,
            chosen,
            Tensor::ones([n, self.top_k * per], (&device, DType::F32)),
            IndexingUpdateOp::Add,
        );
        // Exact: a chosen token keeps its logit (plus 0), the others get the floor (0 + 1 * floor).
        placed + (chosen_mask.neg() + 1.0) * floor
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.centroids.device_bytes() + self.token_ordering.dims().iter().product::<usize>() * 8
    }
}
