//! RMSNorm, and the residual stream that carries a pending add into the next norm.

use crate::{config::NormScale, weights::WeightKind, weights::WeightSource, ModelError};
use burn::{
    module::{Module, Param},
    tensor::{DType, Tensor},
};
use burn_gemma_kernels::{AddNorm, GemmaBackend};

/// RMSNorm as the kernels apply it: scale `1 + weight`, `weight` kept in f32. Checkpoints whose
/// norms scale by `w` itself (Gemma 4, [`NormScale::Weight`]) are held as `w - 1`.
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
        scale: NormScale,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let weight = source.load(&format!("{name}.weight"), [size], WeightKind::Norm(scale), DType::F32, device)?;
        let weight = match scale {
            NormScale::OnePlusWeight => weight,
            NormScale::Weight => weight.sub_scalar(1.0),
        };
        Ok(Self { weight: Param::from_tensor(weight), eps })
    }

    /// A norm without a weight (scale 1): Gemma 4's value norm and its router's input norm.
    pub fn unit(size: usize, eps: f64, device: &B::Device) -> Self {
        Self { weight: Param::from_tensor(Tensor::zeros([size], (device, DType::F32))), eps }
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
    pending: Option<Pending<'a, B>>,
    /// The activation dtype the norms return.
    dtype: DType,
}

/// A block output waiting to be added: `(residual + post_norm(h)) * scale`.
#[derive(Debug)]
struct Pending<'a, B: GemmaBackend> {
    h: Tensor<B, 3>,
    post_norm: Option<&'a RmsNorm<B>>,
    /// Gemma 4's `layer_scalar` where the add ends a layer; 1 otherwise.
    scale: f64,
}

impl<B: GemmaBackend> Pending<'_, B> {
    /// The new residual (f32) and its `norm` in `dtype`, in one add + RMSNorm kernel.
    fn apply(self, residual: Tensor<B, 3>, norm: &RmsNorm<B>, dtype: DType) -> (Tensor<B, 3>, Tensor<B, 3>) {
        let norms = AddNorm {
            post: self.post_norm.map(|n| n.weight.val()),
            weight: norm.weight.val(),
            eps: norm.eps,
            scale: self.scale,
            out_dtype: dtype,
        };
        B::add_rms_norm(residual, self.h, &norms)
    }
}

impl<'a, B: GemmaBackend> ResidualStream<'a, B> {
    /// A stream starting at `x` (the scaled embeddings); norms return `dtype`.
    pub fn new(x: Tensor<B, 3>, dtype: DType) -> Self {
        Self { residual: x, pending: None, dtype }
    }

    /// `residual + post_norm(h)`, applied by the next [`ResidualStream::norm`].
    pub fn add(self, h: Tensor<B, 3>, post_norm: Option<&'a RmsNorm<B>>) -> Self {
        let stream = self.settle();
        Self { pending: Some(Pending { h, post_norm, scale: 1.0 }), ..stream }
    }

    /// The stream times `scale` (Gemma 4's `layer_scalar`): folded into the pending add, which
    /// the next norm's kernel applies.
    pub fn scaled(self, scale: f64) -> Self {
        match self.pending {
            Some(p) => Self { pending: Some(Pending { scale: p.scale * scale, ..p }), ..self },
            None => Self { residual: self.residual.cast(DType::F32).mul_scalar(scale), ..self },
        }
    }

    /// The stream, with the pending add applied by the add + RMSNorm kernel (the normalized
    /// sum, by `norm`, is not used), and its residual in the activations' dtype: where the next
    /// block reads the residual itself as HF's model does in its dtype (Gemma 4's per-layer
    /// input gate; read in f32, its prompt products were f32 GEMMs, 46% of an E2B pp512's
    /// kernel time on the H200).
    pub fn settled(self, norm: &RmsNorm<B>) -> (Self, Tensor<B, 3>) {
        let dtype = self.dtype;
        match self.pending {
            None => {
                let residual = self.residual.clone().cast(dtype);
                (self, residual)
            }
            Some(pending) => {
                let (residual, _) = pending.apply(self.residual, norm, dtype);
                (Self { residual: residual.clone(), pending: None, dtype }, residual.cast(dtype))
            }
        }
    }

    /// The residual (f32, pending add applied; unfused).
    pub fn residual(self) -> (Self, Tensor<B, 3>) {
        let stream = self.settle();
        let residual = stream.residual.clone().cast(DType::F32);
        (stream, residual)
    }

    /// The stream (pending add applied) and `norm(stream)` in the activation dtype.
    pub fn norm(self, norm: &RmsNorm<B>) -> (Self, Tensor<B, 3>) {
        let dtype = self.dtype;
        match self.pending {
            None => {
                let normed = norm.forward(self.residual.clone()).cast(dtype);
                (self, normed)
            }
            Some(pending) => {
                let (residual, normed) = pending.apply(self.residual, norm, dtype);
                (Self { residual, pending: None, dtype }, normed)
            }
        }
    }

    /// The stream with a pending add applied unfused (two adds in a row, or the residual
    /// itself wanted: Gemma 4's expert router and per-layer inputs read it).
    fn settle(self) -> Self {
        match self.pending {
            None => self,
            Some(Pending { h, post_norm, scale }) => {
                let h = match post_norm {
                    Some(n) => n.forward(h),
                    None => h,
                };
                burn_gemma_kernels::graph::unsupported(|| "a residual add by Burn operations".into());
                let residual = (self.residual.cast(DType::F32) + h.cast(DType::F32)).mul_scalar(scale);
                Self { residual, pending: None, dtype: self.dtype }
            }
        }
    }
}
