//! Prefill products `x [m, k] @ w[n, k]^T -> [m, n]` on the matrix units: CubeCL's tiled matmul
//! (`cubek`) with the kernel chosen here instead of its untuned default.
//!
//! The weight is read in its checkpoint layout: `w^T` is a column-major `[k, n]` view, so both
//! operands are contiguous along `k` and the output is written row-major, as the next kernel
//! reads it (no transposed copy before or after the product).
//!
//! [`GemmKernel`] names the candidates. Prefill takes, where the device multiplies the dtype on
//! matrix units, the fastest of [`tune::DEFAULT`] for the product's shape, timed once and cached
//! on disk ([`tune`]); elsewhere (f32, or no matrix units: lavapipe) CubeCL's per-unit kernel.

#[cfg(any(feature = "cuda", feature = "rocm"))]
mod blas_layout;
pub(crate) mod candidates;
#[cfg(feature = "cuda")]
pub mod cublas;
#[cfg(feature = "rocm")]
pub mod hipblas;
pub mod tune;

pub use candidates::{GemmKernel, TileKind};

use crate::cube::{empty, Cb};
use burn::tensor::{DType, Tensor};
use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeRuntime, FloatElement, IntElement};
use cubecl::ir::{ElemType, FloatKind, StorageType};
use cubek::matmul::{
    components::tile::TileMatmulKind,
    definition::{MatmulElems, MatmulGlobalElems},
    launch::Strategy,
    routines::{
        double_buffering::DoubleBufferingArgs, ordered_double_buffering::OrderedSelectionArgs, simple::SimpleArgs,
        BlueprintStrategy,
    },
};
use cubek::std::InputBinding;

impl TileKind {
    fn cubek(self) -> TileMatmulKind {
        match self {
            Self::Cmma => TileMatmulKind::Cmma,
            Self::Mma => TileMatmulKind::Mma,
        }
    }

    /// The strategy variant of a routine for these tiles (CubeCL has one variant per kind).
    fn pick<A>(self, args: A, cmma: fn(A) -> Strategy, mma: fn(A) -> Strategy) -> Strategy {
        match self {
            Self::Cmma => cmma(args),
            Self::Mma => mma(args),
        }
    }
}

impl GemmKernel {
    /// CubeCL's strategy for this kernel.
    fn strategy(self) -> Strategy {
        let simple = |tiles: TileKind, multi_rows| SimpleArgs { tile_matmul: tiles.cubek(), multi_rows };
        let double = |tiles: TileKind| DoubleBufferingArgs { tile_matmul: tiles.cubek(), specialized: false };
        match self {
            // Not a CubeCL kernel: [`kernel::matmul`] calls the library before asking for this.
            Self::Auto | Self::CublasLt | Self::HipBlasLt => Strategy::Auto,
            Self::Unit => Strategy::SimpleUnit(BlueprintStrategy::default()),
            Self::Simple { tiles, multi_rows } => tiles.pick(
                BlueprintStrategy::Inferred(simple(tiles, multi_rows)),
                Strategy::SimpleCyclicCmma,
                Strategy::SimpleCyclicMma,
            ),
            Self::DoubleCyclic { tiles } => tiles.pick(
                BlueprintStrategy::Inferred(double(tiles)),
                Strategy::DoubleCyclicCmma,
                Strategy::DoubleCyclicMma,
            ),
            Self::OrderedDouble { tiles, rows } => tiles.pick(
                BlueprintStrategy::Inferred(OrderedSelectionArgs {
                    partition_k: Some(2),
                    row_count: Some(rows),
                    rows_per_plane: Some(2),
                    tile_matmul: tiles.cubek(),
                }),
                Strategy::OrderedDoubleCmma,
                Strategy::OrderedDoubleMma,
            ),
            Self::SimpleTma { tiles, multi_rows } => tiles.pick(
                BlueprintStrategy::Inferred(simple(tiles, multi_rows)),
                Strategy::SimpleTmaCmma,
                Strategy::SimpleTmaMma,
            ),
            Self::SpecializedTma { tiles } => tiles.pick(
                BlueprintStrategy::Inferred(().into()),
                Strategy::SpecializedTmaCmma,
                Strategy::SpecializedTmaMma,
            ),
            Self::DoubleTma { tiles } => {
                tiles.pick(BlueprintStrategy::Inferred(double(tiles)), Strategy::DoubleTmaCmma, Strategy::DoubleTmaMma)
            }
        }
    }
}

/// Why a product could not be launched.
#[derive(Debug, thiserror::Error)]
#[error("{kernel} cannot multiply [{m}, {k}] by [{k}, {n}] in {dtype:?}: {reason}")]
pub struct GemmError {
    pub kernel: GemmKernel,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dtype: DType,
    pub reason: String,
}

/// `x [m, k] @ w[n, k]^T -> [m, n]` with `kernel` (same dtype in and out, f32 accumulation).
pub fn product<R, F, I, BT>(
    x: Tensor<Cb<R, F, I, BT>, 2>,
    w: Tensor<Cb<R, F, I, BT>, 2>,
    kernel: GemmKernel,
) -> Result<Tensor<Cb<R, F, I, BT>, 2>, GemmError>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let x = crate::cube::float(x);
    let w = crate::cube::float(w);
    kernel::product(x, w, kernel).map(crate::cube::tensor)
}

/// Fewest multiply-adds a product needs for the tuned matrix-unit kernels: below it (a few
/// microseconds of CubeCL's per-unit kernel) tuning would cost more than it could save.
pub const MIN_TUNED_MACS: usize = 1 << 26;

pub(crate) mod kernel {
    use super::*;

    /// The prefill product `x [m, k] @ w[n, k]^T`: on matrix units with the kernel tuning
    /// chose for the shape ([`tune`]) where the device multiplies `x`'s dtype on them, else
    /// with [`GemmKernel::Unit`] (f32, devices without matrix units such as lavapipe, products
    /// under [`MIN_TUNED_MACS`], and devices where no tuned candidate launches and agrees).
    /// `Err` when CubeCL refuses the kernel (the caller then takes Burn's matmul, [`crate::linear::reference`]).
    pub(crate) fn prefill<R: CubeRuntime>(x: CubeTensor<R>, w: CubeTensor<R>) -> Result<CubeTensor<R>, GemmError> {
        let dtype = x.dtype;
        tuned_matmul(x, transposed(w), dtype)
    }

    /// `w^T`: the same buffer with its last two dimensions swapped (a column-major view).
    pub(crate) fn transposed<R: CubeRuntime>(mut w: CubeTensor<R>) -> CubeTensor<R> {
        let rank = w.meta.shape().len();
        w.meta.swap(rank - 2, rank - 1);
        w
    }

    /// `lhs [.., m, k] @ rhs [.., k, n] -> [.., m, n]` in `out_dtype` (any strides in; the
    /// batch dimensions equal), the kernel chosen as for [`prefill`].
    pub(crate) fn tuned_matmul<R: CubeRuntime>(
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        out_dtype: DType,
    ) -> Result<CubeTensor<R>, GemmError> {
        let shape = lhs.meta.shape();
        let rank = shape.len();
        let macs = shape.iter().product::<usize>() * rhs.meta.shape()[rank - 1];
        let kernel = match has_matrix_units(&lhs.client, lhs.dtype) && macs >= MIN_TUNED_MACS {
            true => tune::choose(&lhs, &rhs, out_dtype).unwrap_or(GemmKernel::Unit),
            false => GemmKernel::Unit,
        };
        matmul(lhs, rhs, out_dtype, kernel)
    }

    /// [`super::product`] on primitives (`x`, `w` contiguous, same dtype).
    pub(crate) fn product<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        kernel: GemmKernel,
    ) -> Result<CubeTensor<R>, GemmError> {
        let dtype = x.dtype;
        matmul(x, transposed(w), dtype, kernel)
    }

    /// `lhs [.., m, k] @ rhs [.., k, n] -> [.., m, n]` in `out_dtype` with `kernel` (f32
    /// accumulation; inputs of one dtype, any strides).
    pub(crate) fn matmul<R: CubeRuntime>(
        lhs: CubeTensor<R>,
        rhs: CubeTensor<R>,
        out_dtype: DType,
        kernel: GemmKernel,
    ) -> Result<CubeTensor<R>, GemmError> {
        let shape = lhs.meta.shape().to_vec();
        let rank = shape.len();
        let [m, k] = [shape[rank - 2], shape[rank - 1]];
        let n = rhs.meta.shape()[rank - 1];
        let mut out_shape = shape.clone();
        out_shape[rank - 1] = n;
        let dtype = lhs.dtype;
        let out = empty(&lhs, out_shape, out_dtype);
        if kernel == GemmKernel::CublasLt {
            #[cfg(feature = "cuda")]
            return super::cublas::matmul(&lhs, &rhs, &out).map(|()| out);
            #[cfg(not(feature = "cuda"))]
            return Err(GemmError { kernel, m, n, k, dtype, reason: "built without the cuda feature".into() });
        }
        if kernel == GemmKernel::HipBlasLt {
            #[cfg(feature = "rocm")]
            return super::hipblas::matmul(&lhs, &rhs, &out).map(|()| out);
            #[cfg(not(feature = "rocm"))]
            return Err(GemmError { kernel, m, n, k, dtype, reason: "built without the rocm feature".into() });
        }
        let storage: StorageType = dtype.into();
        let mut dtypes =
            MatmulElems::from_globals(&MatmulGlobalElems { lhs: storage, rhs: storage, out: out_dtype.into() });
        cubek::matmul::launch::launch_ref(
            &kernel.strategy(),
            &lhs.client,
            InputBinding::new(lhs.clone().binding(), storage),
            InputBinding::new(rhs.binding(), storage),
            out.clone().binding(),
            &mut dtypes,
        )
        .map_err(|e| GemmError { kernel, m, n, k, dtype, reason: format!("{e:?}") })?;
        Ok(out)
    }

    /// Whether the runtime multiplies `dtype` tiles on matrix units (cooperative-matrix or
    /// `mma` instructions with an f32 accumulator).
    pub(crate) fn has_matrix_units<R: CubeRuntime>(client: &cubecl::client::ComputeClient<R>, dtype: DType) -> bool {
        let elem: StorageType = match dtype {
            DType::BF16 => ElemType::Float(FloatKind::BF16).into(),
            DType::F16 => ElemType::Float(FloatKind::F16).into(),
            _ => return false,
        };
        let f32: StorageType = ElemType::Float(FloatKind::F32).into();
        let matmul = &client.properties().features.matmul;
        matmul.cmma.iter().chain(&matmul.mma).any(|c| c.a_type == elem && c.b_type == elem && c.cd_type == f32)
    }
}
