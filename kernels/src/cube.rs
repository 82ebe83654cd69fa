//! Plumbing shared by the CubeCL kernels: moving tensors in and out of `CubeTensor`, launch
//! grids, and a block-wide reduction that uses only shared memory (no plane/subgroup operations,
//! which lavapipe and some other Vulkan drivers lack).

use burn::tensor::{ops::FloatTensor, DType, Int, Shape, Tensor, TensorPrimitive};
use burn_cubecl::{
    kernel::into_contiguous, ops::numeric::empty_device_contiguous_dtype, tensor::CubeTensor, BoolElement, CubeBackend,
    CubeRuntime, FloatElement, IntElement,
};
use cubecl::prelude::*;

/// Shorthand for the unfused CubeCL backend.
pub(crate) type Cb<R, F, I, BT> = CubeBackend<R, F, I, BT>;

/// Largest cube count along one grid axis that every runtime accepts.
const MAX_GRID_X: usize = 65_535;

/// The contiguous primitive of a float tensor.
pub(crate) fn float<R, F, I, BT, const D: usize>(t: Tensor<Cb<R, F, I, BT>, D>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    into_contiguous(t.into_primitive().tensor())
}

/// The primitive of a float tensor, strides kept (for kernels that index by stride).
pub(crate) fn float_strided<R, F, I, BT, const D: usize>(t: Tensor<Cb<R, F, I, BT>, D>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    t.into_primitive().tensor()
}

/// The contiguous primitive of an int tensor.
pub(crate) fn int<R, F, I, BT, const D: usize>(t: Tensor<Cb<R, F, I, BT>, D, Int>) -> CubeTensor<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    into_contiguous(t.into_primitive())
}

/// Wraps a primitive back into a float tensor.
pub(crate) fn tensor<R, F, I, BT, const D: usize>(t: FloatTensor<Cb<R, F, I, BT>>) -> Tensor<Cb<R, F, I, BT>, D>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Wraps a primitive back into an int tensor.
pub(crate) fn int_tensor<R, F, I, BT, const D: usize>(t: CubeTensor<R>) -> Tensor<Cb<R, F, I, BT>, D, Int>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    Tensor::from_primitive(t)
}

/// A new contiguous tensor on `like`'s device.
pub(crate) fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: impl Into<Shape>, dtype: DType) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape.into(), dtype)
}

/// A 2-D grid of at least `cubes` cubes; kernels recover the index with [`cube_index`].
pub(crate) fn grid(cubes: usize) -> CubeCount {
    let x = cubes.clamp(1, MAX_GRID_X);
    let y = cubes.div_ceil(x).max(1);
    CubeCount::Static(x as u32, y as u32, 1)
}

/// Grid for elementwise kernels: one unit per element, `threads` units per cube.
pub(crate) fn elementwise(elements: usize, threads: u32) -> (CubeCount, CubeDim) {
    (grid(elements.div_ceil(threads as usize)), CubeDim::new_1d(threads))
}

/// The widest vector (elements per load, at most `max` and what one load instruction of the
/// runtime moves) that divides a contiguous row of `len` elements of `elem_size` bytes.
pub(crate) fn load_vector_size<R: CubeRuntime>(
    client: &ComputeClient<R>,
    elem_size: usize,
    len: usize,
    max: usize,
) -> usize {
    client.io_optimized_vector_sizes(elem_size).find(|&v| v <= max && len.is_multiple_of(v)).unwrap_or(1)
}

/// Whether `plane_sum` over 32 units is available: plane operations supported and every plane
/// exactly 32 units wide (CUDA warps), so a row owned by 32 consecutive units is one plane.
/// Whether `R` is CUDA: the runtime the matrix-unit kernels (quantized mma, flash attention)
/// have been checked on. Vulkan and HIP report cooperative matrices too, but nothing here has
/// run those kernels there; they keep the other paths.
#[cfg_attr(not(feature = "cuda"), allow(clippy::extra_unused_type_parameters))]
pub(crate) fn cuda_runtime<R: CubeRuntime>() -> bool {
    #[cfg(feature = "cuda")]
    {
        std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Whether `client` multiplies `dtype` (f16 or bf16) on 16 x 16 x 16 cooperative matrices
/// accumulating in f32.
pub(crate) fn cmma_16<R: CubeRuntime>(client: &ComputeClient<R>, dtype: DType) -> bool {
    use cubecl::ir::{ElemType, FloatKind};
    let elem: StorageType = match dtype {
        DType::BF16 => ElemType::Float(FloatKind::BF16).into(),
        DType::F16 => ElemType::Float(FloatKind::F16).into(),
        _ => return false,
    };
    let f32: StorageType = ElemType::Float(FloatKind::F32).into();
    client
        .properties()
        .features
        .matmul
        .cmma
        .iter()
        .any(|c| c.a_type == elem && c.b_type == elem && c.cd_type == f32 && [c.m, c.n, c.k] == [16, 16, 16])
}

pub(crate) fn planes_of_32<R: CubeRuntime>(client: &ComputeClient<R>) -> bool {
    let props = client.properties();
    props.features.plane.contains(cubecl::ir::features::Plane::Ops)
        && props.hardware.plane_size_min == 32
        && props.hardware.plane_size_max == 32
}

/// Strides of a 4-D tensor that a kernel takes as an [`Array`] (kernels take arrays plus the
/// dimensions they need, because a launch with `Tensor` arguments first uploads every tensor's
/// shape and strides to the device: a pool allocation and a host-to-device copy per launch,
/// while array lengths and scalars travel with the launch itself).
#[derive(CubeLaunch, CubeType, Clone, Copy)]
pub(crate) struct Strides4 {
    pub b: usize,
    pub h: usize,
    pub s: usize,
    pub d: usize,
}

#[cube]
impl Strides4 {
    /// Linear index of element `(b, h, s, d)`.
    pub fn at(&self, b: usize, h: usize, s: usize, d: usize) -> usize {
        b * self.b + h * self.h + s * self.s + d * self.d
    }
}

impl Strides4 {
    /// The launch argument holding `t`'s strides (`t` is 4-D).
    pub fn launch<L: Runtime, R: CubeRuntime>(t: &CubeTensor<R>) -> Strides4Launch<L> {
        let s = t.meta.strides();
        Strides4Launch::new(s[0], s[1], s[2], s[3])
    }
}

/// Linear index of this cube in a [`grid`].
#[cube]
pub(crate) fn cube_index() -> usize {
    (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize
}

/// Linear index of this unit in an [`elementwise`] grid.
#[cube]
pub(crate) fn unit_index() -> usize {
    cube_index() * CUBE_DIM_X as usize + UNIT_POS_X as usize
}

/// Sum (or with `max`, the largest) of `value` over the cube's units (a power of two along x),
/// returned to every unit. `scratch` holds at least `CUBE_DIM_X` values.
#[cube]
fn cube_reduce(value: f32, scratch: &mut SharedMemory<f32>, #[comptime] max: bool) -> f32 {
    let unit = UNIT_POS_X as usize;
    scratch[unit] = value;
    sync_cube();
    let mut stride = CUBE_DIM_X as usize / 2;
    while stride > 0 {
        if unit < stride {
            let other = scratch[unit + stride];
            if max {
                if other > scratch[unit] {
                    scratch[unit] = other;
                }
            } else {
                scratch[unit] = scratch[unit] + other;
            }
        }
        sync_cube();
        stride /= 2;
    }
    let total = scratch[0];
    sync_cube();
    total
}

/// Sum (or with `max`, the largest) of `value` over the cube's units, to every unit: within
/// planes by plane operations where planes are 32 wide (`plane`), then across the planes
/// through `scratch` (at least `CUBE_DIM_X / 32` values) with one barrier; else
/// [`cube_reduce`] (`scratch`: `CUBE_DIM_X` values).
#[cube]
#[allow(clippy::manual_is_multiple_of)] // Kernel code: `%` is what CubeCL expands.
pub(crate) fn planes_reduce(
    value: f32,
    scratch: &mut SharedMemory<f32>,
    #[comptime] plane: bool,
    #[comptime] max: bool,
) -> f32 {
    if plane {
        let unit = UNIT_POS_X as usize;
        let mine = if max { plane_max(value) } else { plane_sum(value) };
        if unit % 32 == 0 {
            scratch[unit / 32] = mine;
        }
        sync_cube();
        let mut total = scratch[0];
        for p in 1..CUBE_DIM_X as usize / 32 {
            if max {
                total = f32::max(total, scratch[p]);
            } else {
                total += scratch[p];
            }
        }
        sync_cube();
        total
    } else {
        cube_reduce(value, scratch, max)
    }
}

/// Sum of `value` over the cube's units; see [`cube_reduce`].
#[cube]
pub(crate) fn cube_sum(value: f32, scratch: &mut SharedMemory<f32>) -> f32 {
    cube_reduce(value, scratch, false)
}

/// Largest `value` over the cube's units; see [`cube_reduce`].
#[cube]
pub(crate) fn cube_max(value: f32, scratch: &mut SharedMemory<f32>) -> f32 {
    cube_reduce(value, scratch, true)
}

/// `tanh` that stays finite for any input (the textbook `(e^2x - 1) / (e^2x + 1)` that some
/// shader compilers emit overflows to NaN past |x| ~ 44).
#[cube]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let e = f32::exp(-2.0f32 * f32::abs(x));
    let t = (1.0f32 - e) / (1.0f32 + e);
    if x < 0.0f32 {
        -t
    } else {
        t
    }
}

/// Smallest power of two not below `n` (and at least 1).
pub(crate) fn pow2_ceil(n: usize) -> usize {
    n.max(1).next_power_of_two()
}

/// Largest power of two not above `n` (and at least 1).
pub(crate) fn pow2_floor(n: usize) -> usize {
    if n <= 1 {
        1
    } else {
        1 << (usize::BITS - 1 - n.leading_zeros())
    }
}
