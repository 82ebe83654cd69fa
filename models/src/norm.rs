//! RMSNorm, and the residual stream that carries a pending add into the next norm.

use crate::{weights::WeightKind, weights::WeightSource, ModelError};
use burn::{
    module::{Module, Param},
    tensor::{DType, Tensor},
};
use burn_gemma_kernels::{AddNorm, GemmaBackend};

/// RMSNorm with Gemma's `1 + w` scale; `weight` is kept in f32.
#[derive(Module, Debug)]
pub struct RmsNorm<B: GemmaBackend> {
    pub weight: Param<Tensor<B, 1>>,
    #[module(skip)]
    pub eps: f64,
}

impl<B: GemmaBackend> RmsNorm<B> {
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        name: &str,
        size: usize,
        eps: f64,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let weight = source.load(&format!("{name}.weight"), [size], WeightKind::Norm, DType::F32, device)?;
        Ok(Self { weight: Param::from_tensor(weight), eps })
    }

    /// Normalizes the last dimension.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        B::rms_norm(x, self.weight.val(), self.eps)
    }
}

/// The residual stream between the blocks of the decoder, `[batch, seq, hidden]`: the
/// embeddings as they come (in the activation dtype), then f32 from the first add on (Gemma
/// activations overflow f16; the fused add reads either).
///
/// A block's output is not added at once: [`ResidualStream::add`] keeps it (with its post-norm)
/// pending, and the next [`ResidualStream::norm`] adds it and normalizes the sum in one kernel
/// ([`GemmaBackend::add_rms_norm`]), as HF's `residual + post_norm(h)` followed by the next
/// block's `pre_norm(residual)`.
#[derive(Debug)]
pub struct ResidualStream<'a, B: GemmaBackend> {
    residual: Tensor<B, 3>,
    pending: Option<(Tensor<B, 3>, Option<&'a RmsNorm<B>>)>,
    /// The activation dtype the norms return.
    dtype: DType,
}

impl<'a, B: GemmaBackend> ResidualStream<'a, B> {
    /// A stream starting at `x` (the scaled embeddings); norms return `dtype`.
    pub fn new(x: Tensor<B, 3>, dtype: DType) -> Self {
        Self { residual: x, pending: None, dtype }
    }

    /// `residual + post_norm(h)`, applied by the next [`ResidualStream::norm`].
    pub fn add(self, h: Tensor<B, 3>, post_norm: Option<&'a RmsNorm<B>>) -> Self {
        let stream = self.settle();
        Self { pending: Some((h, post_norm)), ..stream }
    }

    /// The stream (pending add applied) and `norm(stream)` in the activation dtype.
    pub fn norm(self, norm: &RmsNorm<B>) -> (Self, Tensor<B, 3>) {
        let dtype = self.dtype;
        match self.pending {
            None => {
                let normed = norm.forward(self.residual.clone()).cast(dtype);
                (self, normed)
            }
            Some((h, post)) => {
                let norms = AddNorm {
                    post: post.map(|n| n.weight.val()),
                    weight: norm.weight.val(),
                    eps: norm.eps,
                    out_dtype: dtype,
                };
                let (residual, normed) = B::add_rms_norm(self.residual, h, &norms);
                (Self { residual, pending: None, dtype }, normed)
            }
        }
    }

    /// The stream with a pending add applied unfused (two adds in a row; the decoder never
    /// does this).
    fn settle(self) -> Self {
        match self.pending {
            None => self,
            Some((h, post)) => {
                let h = match post {
                    Some(n) => n.forward(h),
                    None => h,
                };
                Self { residual: self.residual.cast(DType::F32) + h.cast(DType::F32), pending: None, dtype: self.dtype }
            }
        }
    }
}
