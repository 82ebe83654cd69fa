//! The gated MLP of every Gemma layer (HF's `GemmaMLP`): `down(gelu_tanh(gate(x)) * up(x))`,
//! with the gate and up projections joined where they are stored alike.

use crate::{
    projection::{load_matrix, upload, Projection, WeightSettings},
    weights::WeightSource,
    GemmaConfig, ModelError,
};
use burn::{module::Module, tensor::Tensor};
use burn_gemma_kernels::{
    gelu::{self, PAIR_BLOCK},
    Epilogue, GateUpLayout, GemmaBackend, GgmlBlocks, HostMatrix, HostQuantized, Matrix,
};

/// The gate and up projections of an MLP (they read the same input).
#[derive(Module, Debug)]
#[allow(clippy::large_enum_variant)] // One per layer, held for the model's life: no boxing.
pub enum GateUp<B: GemmaBackend> {
    /// One matrix holding the gate and up rows interleaved in blocks of [`PAIR_BLOCK`]: the
    /// product and the GELU run as one operation ([`Epilogue::GeluPairs`]), which on GPUs is
    /// one GEMV launch per decode step instead of two.
    Interleaved(Matrix<B>),
    /// Side by side (`[batch, seq, 2 * intermediate]`, joined into one matrix where stored
    /// alike), then the GELU: where the two are stored differently or the width does not split
    /// into pair blocks.
    SideBySide(Projection<B>),
}

impl<B: GemmaBackend> GateUp<B> {
    /// Interleaves `gate` and `up` (`[intermediate, hidden]` each) where both are stored alike
    /// and `intermediate` splits into pair blocks, else keeps them side by side.
    /// `name` names the pair in errors.
    fn new(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        intermediate: usize,
        name: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let fits = gelu::pairs_fit(intermediate);
        let interleaved = |joined| upload(joined, name, device).map(Self::Interleaved);
        match (gate, up) {
            (HostMatrix::Quantized(gate), HostMatrix::Quantized(up)) if fits => {
                match HostQuantized::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => interleaved(HostMatrix::Quantized(joined)),
                    Err((gate, up)) => {
                        Self::side_by_side(HostMatrix::Quantized(gate), HostMatrix::Quantized(up), name, device)
                    }
                }
            }
            (HostMatrix::Ggml(gate), HostMatrix::Ggml(up)) if fits => {
                match GgmlBlocks::interleave_pairs(gate, up, PAIR_BLOCK) {
                    Ok(joined) => interleaved(HostMatrix::Ggml(joined)),
                    Err((gate, up)) => Self::side_by_side(HostMatrix::Ggml(gate), HostMatrix::Ggml(up), name, device),
                }
            }
            (HostMatrix::Dense(gate), HostMatrix::Dense(up)) if fits && gate.dtype() == up.dtype() => {
                interleaved(HostMatrix::Dense(gelu::interleave_pairs(gate, up)))
            }
            (gate, up) => Self::side_by_side(gate, up, name, device),
        }
    }

    fn side_by_side(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        name: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Projection::joined(vec![gate, up], name, device).map(Self::SideBySide)
    }

    /// `[batch, seq, hidden]` -> `gelu_tanh(gate(x)) * up(x)`, `[batch, seq, intermediate]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        match self {
            Self::Interleaved(w) => {
                let [batch, seq, hidden] = x.dims();
                let out = B::project(x.reshape([batch * seq, hidden]), w, Epilogue::GeluPairs);
                let width = out.dims()[1];
                out.reshape([batch, seq, width])
            }
            Self::SideBySide(projection) => B::gelu_mul(projection.forward(x), GateUpLayout::Halves),
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        match self {
            Self::Interleaved(w) => w.device_bytes(),
            Self::SideBySide(projection) => projection.device_bytes(),
        }
    }
}

/// Gated MLP: `down(gelu_tanh(gate(x)) * up(x))`.
#[derive(Module, Debug)]
pub struct Mlp<B: GemmaBackend> {
    /// `gate_proj` and `up_proj`.
    pub gate_up: GateUp<B>,
    pub down_proj: Projection<B>,
}

impl<B: GemmaBackend> Mlp<B> {
    /// The MLP of layer `index` (Gemma 4's KV-sharing layers may be twice as wide).
    pub(crate) fn load(
        source: &mut impl WeightSource<B>,
        prefix: &str,
        index: usize,
        c: &GemmaConfig,
        settings: WeightSettings,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        let (hidden, inter) = (c.hidden_size, c.intermediate_size_of(index));
        let gate = load_matrix(source, &format!("{prefix}.gate_proj.weight"), &[inter, hidden], settings, device)?;
        let up = load_matrix(source, &format!("{prefix}.up_proj.weight"), &[inter, hidden], settings, device)?;
        let down = load_matrix(source, &format!("{prefix}.down_proj.weight"), &[hidden, inter], settings, device)?;
        Self::from_matrices(gate, up, down, inter, prefix, device)
    }

    /// The MLP of matrices already read: `gate` and `up` `[intermediate, hidden]`, `down`
    /// `[hidden, intermediate]`; `prefix` names them in errors.
    pub(crate) fn from_matrices(
        gate: HostMatrix<B>,
        up: HostMatrix<B>,
        down: HostMatrix<B>,
        intermediate: usize,
        prefix: &str,
        device: &B::Device,
    ) -> Result<Self, ModelError> {
        Ok(Self {
            gate_up: GateUp::new(gate, up, intermediate, &format!("{prefix}.gate_proj | up_proj"), device)?,
            down_proj: Projection::joined(vec![down], &format!("{prefix}.down_proj"), device)?,
        })
    }

    /// `[batch, seq, hidden]` -> `[batch, seq, hidden]`.
    pub fn forward(&self, x: Tensor<B, 3>) -> Tensor<B, 3> {
        self.down_proj.forward(self.gate_up.forward(x))
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        self.gate_up.device_bytes() + self.down_proj.device_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;
    use burn_gemma_kernels::QuantFormat;

    type B = NdArray<f32>;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.4
            })
            .collect()
    }

    /// Every layout of the gate/up pair gives `gelu(x gate^T) * (x up^T)` of the weights as
    /// stored; interleaved exactly where both are stored alike and the width splits into pair
    /// blocks.
    #[test]
    fn gate_up_layouts_match_the_separate_products() {
        let device = Default::default();
        let hidden = 64;
        // (intermediate, gate quantized, up quantized, interleaved)
        for (inter, gate_q, up_q, interleaved) in
            [(12, false, false, true), (12, true, true, true), (12, true, false, false), (10, false, false, false)]
        {
            let load = |seed: u64, quantized: bool| {
                let w = values(inter * hidden, seed);
                if quantized {
                    let host = HostQuantized::quantize(&w, inter, hidden, QuantFormat::Q8).expect("quantize");
                    (host.dequantize(), HostMatrix::Quantized(host))
                } else {
                    (
                        w.clone(),
                        HostMatrix::Dense(Tensor::<B, 2>::from_data(TensorData::new(w, [inter, hidden]), &device)),
                    )
                }
            };
            let ((gate, gate_loaded), (up, up_loaded)) = (load(1, gate_q), load(2, up_q));
            let layer = GateUp::new(gate_loaded, up_loaded, inter, "test", &device).expect("uploads");
            assert_eq!(
                matches!(layer, GateUp::Interleaved(_)),
                interleaved,
                "intermediate {inter}, quantized {gate_q}/{up_q}"
            );

            let x = Tensor::<B, 3>::from_data(TensorData::new(values(3 * hidden, 3), [1, 3, hidden]), &device);
            let matrix = |w: Vec<f32>| {
                Tensor::<B, 2>::from_data(TensorData::new(w, [inter, hidden]), &device).transpose().unsqueeze::<3>()
            };
            let expected = gelu::reference(x.clone().matmul(matrix(gate)), x.clone().matmul(matrix(up)));
            let got = layer.forward(x);
            assert_eq!(got.dims(), [1, 3, inter]);
            got.into_data().assert_approx_eq::<f32>(&expected.into_data(), burn::tensor::Tolerance::absolute(1e-5));
        }
    }
}
