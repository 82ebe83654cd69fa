//! Prompts through the experts on the matrix units: the slots routed to each expert gathered
//! into one padded batch, one batched product per group of experts by the tuned prefill GEMM
//! ([`crate::gemm`]), the results scattered back to their slots.
//!
//! The grouped matrix-vector kernels ([`super::gemv`]) read each expert's rows once for all its
//! slots, but multiply with scalar instructions: on a 512-token prompt of the 26B-A4B that is
//! compute-bound, far from the matrix units (pp512 905 tok/s against llama.cpp's 9,323 on the
//! H200, `docs/runs/gpu/2026-11-25-gemma4-26b-a4b-grouped.md`). Here:
//!
//! 1. [`super::gemv`]'s grouping kernel lists each expert's slots on the device; the counts are
//!    read back (one small read per product: this path is for prompts, never recorded in a
//!    decode graph) to size the batch: `span`, the most slots any expert has, rounded up to 16.
//! 2. `gather_kernel` copies each expert's input rows into `[count, span, cols]` in the model
//!    dtype, zeros past its last slot.
//! 3. Per group of experts, the batched product `[g, span, cols] @ [g, cols, rows]` on the matrix
//!    units; quantized experts are dequantized into a transient dense stack one group at a
//!    time (at most [`GROUP_BYTES`], so a 26B-A4B layer never holds more than a quarter of a
//!    GiB of dense experts).
//! 4. `scatter_kernel` writes each valid row back to its slot: `gelu_tanh(gate) * up` for
//!    [`ExpertProduct::GeluHalves`], the route weight times the row (f32, summed per token by
//!    [`super::gemv`]'s combine kernel) for [`ExpertProduct::WeightedSum`].
//!
//! Rounding is the reference's ([`super::project_reference`]): products in the model dtype with
//! f32 accumulation, gate and up rounded to it before the GELU, weighted parts summed in f32.

use super::ExpertProduct;

/// Largest transient dense stack of dequantized experts one batched product reads, by default.
pub const GROUP_BYTES: usize = 256 << 20;

/// Rows of the padded batch are a multiple of this (the matrix units' tile).
const SPAN_ALIGN: usize = 16;

/// Fewest slots per expert, on average, for which the batched product beats the grouped
/// matrix-vector kernels (which read only the chosen experts' rows, once): below it most
/// of a padded batch would be zeros and dequantizing every expert would cost more than it saves.
/// On one 26B-A4B layer on the H200 (`docs/runs/gpu/2026-11-25-experts-gemm.md`) the GEMVs
/// are 1.08-1.10x faster for Q8/Q4 experts at 4 slots per expert (64 tokens; dense: the batched
/// path 1.09x), the batched path 1.5-2.0x faster at 8 (128 tokens).
pub const GEMM_MIN_SLOTS_PER_EXPERT: usize = 8;

/// How the CubeCL backends take a batch of tokens through a layer's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertPath {
    /// Matrix-vector kernels ([`super::gemv`]): per slot for up to
    /// [`crate::linear::GEMV_MAX_ROWS`] tokens, grouped by expert above; nothing is read back
    /// (a decode step records as one CUDA graph).
    Gemv,
    /// Gathered per expert into a padded batch and multiplied on the matrix units (this
    /// module); reads each expert's slot count back. Experts are multiplied in groups whose
    /// transient buffers (the group's output, and for quantized experts their dequantized
    /// stack) hold at most `group_bytes` (one expert at a time where one is larger), and at
    /// most what the device allocates at once.
    Gemm { group_bytes: usize },
}

impl ExpertPath {
    /// The path for `tokens` tokens routed to `top_k` of `count` experts: [`ExpertPath::Gemm`]
    /// where the device multiplies the model dtype on matrix units and the experts average at
    /// least [`GEMM_MIN_SLOTS_PER_EXPERT`] slots each, else [`ExpertPath::Gemv`].
    pub fn choose(tokens: usize, top_k: usize, count: usize, matrix_units: bool) -> Self {
        let enough = tokens > crate::linear::GEMV_MAX_ROWS && tokens * top_k >= GEMM_MIN_SLOTS_PER_EXPERT * count;
        if matrix_units && enough {
            Self::Gemm { group_bytes: GROUP_BYTES }
        } else {
            Self::Gemv
        }
    }
}

/// Experts per batched product: the largest divisor of `count` whose transient buffers
/// (`per_expert` bytes each) fit `limit` bytes (a divisor, so every product of a layer has the
/// same shape and one tuning class).
fn group_size(count: usize, per_expert: usize, limit: usize) -> usize {
    let fit = (limit / per_expert.max(1)).max(1);
    (1..=count.min(fit)).rev().find(|g| count.is_multiple_of(*g)).unwrap_or(1)
}

/// Rows of the padded batch for `largest` slots on one expert.
fn span_of(largest: usize) -> usize {
    largest.div_ceil(SPAN_ALIGN).max(1) * SPAN_ALIGN
}

/// `true` for the product whose output is formed from gate and up halves.
fn halves(product: ExpertProduct) -> bool {
    product == ExpertProduct::GeluHalves
}

pub(crate) mod kernel {
    use super::*;
    use crate::cube::{elementwise, empty, unit_index};
    use crate::experts::gemv::kernel::{combine, group};
    use crate::gelu::kernel::gelu_mul_f32;
    use crate::gemm::kernel::{transposed, tuned_matmul};
    use crate::graph::{arg, launch};
    use crate::quant::kernel::{dequantize_rows, Packed};
    use crate::ReadBackError;
    use burn::tensor::{DType, Shape};
    use burn_cubecl::{kernel::slice, ops::reshape, tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;
    use std::ops::Range;

    /// Where a batch of experts sits: the first expert's id, rows per expert in the batch,
    /// and the width of a row.
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub(crate) struct Batch {
        pub first: u32,
        pub span: u32,
        pub width: u32,
    }

    /// `out[e, j, :] = x[input of expert e's j-th slot, :]` (cast to `O`), zeros past its
    /// last slot; `out` is `[experts, span, width]` for experts `first..`.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn gather_kernel<X: Float, O: Float>(
        x: &Array<X>,
        order: &Array<u32>,
        offsets: &Array<u32>,
        out: &mut Array<O>,
        batch: Batch,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
        #[define(X, O)] _dtypes: [StorageType; 2],
    ) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        let (span, width) = (batch.span as usize, batch.width as usize);
        let (row, c) = (i / width, i % width);
        let expert = batch.first as usize + row / span;
        let at = offsets[expert] as usize + row % span;
        let mut value = O::new(0.0);
        if at < offsets[expert + 1] as usize {
            let slot = order[at] as usize;
            let input = if halves { slot / top_k } else { slot };
            value = O::cast_from(x[input * width + c]);
        }
        out[i] = value;
    }

    /// Each valid row of `y` (`[experts, span, rows]` for experts `first..`, `O`) back to its
    /// slot: `gelu_tanh(gate) * up` (`out` `[slots, rows / 2]` in `O`) with `halves`, else
    /// the route weight times the row (`out` `[slots, rows]` f32). `batch.width` is the
    /// output's width.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn scatter_kernel<O: Float, P: Float>(
        y: &Array<O>,
        order: &Array<u32>,
        offsets: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<P>,
        batch: Batch,
        #[comptime] halves: bool,
        #[define(O, P)] _dtypes: [StorageType; 2],
    ) {
        let i = unit_index();
        let (span, width) = (batch.span as usize, batch.width as usize);
        let (row, c) = (i / width, i % width);
        let local = row / span;
        let expert = batch.first as usize + local;
        // One unit per element of the batch's valid rows' outputs; the grid covers the padded
        // batch and `expert` may run past the last for the grid's rounding.
        if expert + 1 >= offsets.len() {
            terminate!();
        }
        let at = offsets[expert] as usize + row % span;
        if at >= offsets[expert + 1] as usize {
            terminate!();
        }
        let slot = order[at] as usize;
        if halves {
            let rows = 2 * width;
            let base = row * rows;
            let gate = f32::cast_from(y[base + c]);
            let up = f32::cast_from(y[base + width + c]);
            out[slot * width + c] = P::cast_from(gelu_mul_f32(gate, up));
        } else {
            out[slot * width + c] = P::cast_from(weights[slot] * f32::cast_from(y[row * width + c]));
        }
    }

    /// Why the batched path could not run.
    #[derive(Debug)]
    pub(crate) enum GroupedError {
        /// The slot counts could not be read back.
        ReadBack(ReadBackError),
        /// The batch is larger than the device allocates at once, or CubeCL refused the
        /// batched product (the caller takes the matrix-vector kernels).
        Gemm,
    }

    /// The experts' weights, stacked `[count * rows, cols]`.
    #[allow(clippy::large_enum_variant)] // One per product, held for its launches.
    pub(crate) enum Stack<R: CubeRuntime> {
        /// Dense in the model dtype.
        Dense(CubeTensor<R>),
        /// Block-quantized, dequantized one group at a time.
        Quantized(Packed<R>),
    }

    /// Experts `range` of a contiguous stack (`[count * rows, cols]` or `[count, rows, cols]`)
    /// as `[range.len(), rows, cols]`: a view of the same buffer where the runtime's alignment
    /// allows, else a copy.
    fn experts_of<R: CubeRuntime>(t: &CubeTensor<R>, range: Range<usize>, rows: usize) -> CubeTensor<R> {
        let shape = t.meta.shape();
        let cols = shape[shape.len() - 1];
        let flat = reshape(t.clone(), Shape::new([shape.iter().product::<usize>() / cols.max(1), cols]));
        let part = slice(flat, &[range.start * rows..range.end * rows, 0..cols]);
        reshape(part, Shape::new([range.len(), rows, cols]))
    }

    /// The product of [`ExpertProduct`] by the batched path: `x` `[tokens, cols]` or
    /// `[tokens * top_k, cols]` with `cols > 0`, `count > 0` experts, `ids`/`weights`
    /// `[tokens, top_k]`; returns `dtype`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn expert_gemm<R: CubeRuntime>(
        x: CubeTensor<R>,
        stack: Stack<R>,
        (count, rows): (usize, usize),
        ids: CubeTensor<R>,
        weights: CubeTensor<R>,
        product: ExpertProduct,
        dtype: DType,
        group_bytes: usize,
    ) -> Result<CubeTensor<R>, GroupedError> {
        let (tokens, top_k) = (ids.meta.shape()[0], ids.meta.shape()[1]);
        let cols = x.meta.shape()[1];
        let halves = halves(product);
        let width = if halves { rows / 2 } else { rows };
        let slots = tokens * top_k;
        // Per slot: `GeluHalves` is the result; `WeightedSum`'s weighted parts are summed per
        // token at the end.
        let out_dtype = if halves { dtype } else { DType::F32 };
        let out = empty(&x, [slots, width], out_dtype);
        let finish = |out| if halves { out } else { combine(out, top_k, dtype) };
        if slots * width == 0 {
            return Ok(finish(out));
        }
        let (order, offsets) = group(&ids, count);
        let counts = read_offsets(&offsets).map_err(GroupedError::ReadBack)?;
        let largest = counts.windows(2).map(|w| w[1].saturating_sub(w[0]) as usize).max().unwrap_or(0);
        let span = span_of(largest);
        // One allocation holds the gathered batch, another a group's dense stack: both within
        // what the device allocates at once (else the matrix-vector kernels take the product).
        let page = usize::try_from(x.client.properties().memory.max_page_size).unwrap_or(usize::MAX);
        let elem = dtype.size();
        if count * span * cols * elem > page || (span * rows).max(rows * cols) * elem > page {
            return Err(GroupedError::Gemm);
        }
        // Dense experts are views: only the outputs count against `group_bytes` there.
        let group_bytes = group_bytes.min(page);
        // Every slot is written by exactly one valid row; rows of experts no token chose are
        // zeros in and never scattered.
        let gathered = empty(&x, [count, span, cols], dtype);
        let (cubes, dim) = elementwise(count * span * cols, 256);
        launch!(gather_kernel(
            &x.client,
            cubes,
            dim,
            arg(&x),
            arg(&order),
            arg(&offsets),
            arg(&gathered),
            BatchLaunch::new(0, span as u32, cols as u32),
            top_k,
            halves,
            [x.dtype.into(), dtype.into()],
        ));
        // A group's product output, and for quantized experts their dequantized stack.
        let per_expert = match &stack {
            Stack::Dense(_) => span * rows * elem,
            Stack::Quantized(_) => (span * rows).max(rows * cols) * elem,
        };
        let group = group_size(count, per_expert, group_bytes);
        for first in (0..count).step_by(group) {
            let experts = first..(first + group).min(count);
            let dense = match &stack {
                Stack::Dense(w) => experts_of(w, experts.clone(), rows),
                Stack::Quantized(w) => {
                    let part = dequantize_rows(w, experts.start * rows..experts.end * rows, dtype);
                    experts_of(&part, 0..experts.len(), rows)
                }
            };
            let lhs = experts_of(&gathered, experts.clone(), span);
            let y = tuned_matmul(lhs, transposed(dense), dtype).map_err(|_| GroupedError::Gemm)?;
            let (cubes, dim) = elementwise(experts.len() * span * width, 256);
            launch!(scatter_kernel(
                &x.client,
                cubes,
                dim,
                arg(&y),
                arg(&order),
                arg(&offsets),
                arg(&weights),
                arg(&out),
                BatchLaunch::new(first as u32, span as u32, width as u32),
                halves,
                [dtype.into(), out_dtype.into()],
            ));
        }
        Ok(finish(out))
    }

    /// The grouping's `count + 1` offsets on the host.
    fn read_offsets<R: CubeRuntime>(offsets: &CubeTensor<R>) -> Result<Vec<u32>, ReadBackError> {
        let bytes = offsets
            .client
            .read_one(offsets.handle.clone())
            .map_err(|e| ReadBackError { what: "expert slot counts", reason: format!("{e:?}") })?;
        Ok(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_divide_the_experts_and_fit() {
        // 26B-A4B gate/up in bf16: 7.9 MB per expert, 32 fit in 256 MiB and divide 128.
        assert_eq!(group_size(128, 1408 * 2816 * 2, GROUP_BYTES), 32);
        // Its down projection: 4 MB per expert.
        assert_eq!(group_size(128, 2816 * 704 * 2, GROUP_BYTES), 64);
        // A prime count takes one expert at a time when the whole stack does not fit.
        assert_eq!(group_size(7, 40_000 * 4_000 * 2, GROUP_BYTES), 1);
        assert_eq!(group_size(7, 8 * 8 * 2, GROUP_BYTES), 7);
        // Six experts of 100 bytes in 250: two at a time.
        assert_eq!(group_size(6, 100, 250), 2);
    }

    #[test]
    fn the_span_covers_the_largest_expert_in_whole_tiles() {
        assert_eq!(span_of(0), 16);
        assert_eq!(span_of(1), 16);
        assert_eq!(span_of(16), 16);
        assert_eq!(span_of(17), 32);
    }

    #[test]
    fn prompts_take_the_matrix_units_only_where_experts_fill_tiles() {
        // 26B-A4B: 128 experts, top 8: 128 tokens average 8 slots per expert.
        assert_eq!(ExpertPath::choose(128, 8, 128, true), ExpertPath::Gemm { group_bytes: GROUP_BYTES });
        assert_eq!(ExpertPath::choose(127, 8, 128, true), ExpertPath::Gemv);
        assert_eq!(ExpertPath::choose(512, 8, 128, false), ExpertPath::Gemv);
        // Decode never reads back, however few the experts.
        assert_eq!(ExpertPath::choose(8, 8, 2, true), ExpertPath::Gemv);
    }
}

#[cfg(test)]
mod gpu {
    use super::{ExpertPath, GROUP_BYTES};
    use crate::experts::gemv::gpu::experts;
    use crate::experts::{project_reference, route_reference, ExpertProduct, Experts, Routes};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{GemmaBackend, QuantFormat};
    use burn::tensor::{DType, Distribution, Tensor};

    /// `project_on` with a path, as the tests call it on each backend.
    type Project<B> = fn(Tensor<B, 2>, &Experts<B>, &Routes<B>, ExpertProduct, DType, ExpertPath) -> Tensor<B, 2>;

    /// Both products by the batched path against the grouped reference: uneven routes (a
    /// skewed router, so one expert takes most slots and others none), odd widths and token
    /// counts, dense and Q8/Q4 experts, one batch for all experts and several (a small
    /// `group_bytes`), activations in f32 and the model dtype.
    fn batched<B: GemmaBackend>(device: &B::Device, dtype: DType, project: Project<B>) {
        seed::<B>(device, "batched experts");
        let formats = [None, Some(QuantFormat::Q8), Some(QuantFormat::Q4)];
        // (tokens, experts, top_k, 2 * m, cols, router skew)
        // The last: more slots than the grouping kernel stages at once (2,400 > 2,048).
        for (tokens, count, top_k, rows, cols, skew) in [
            (9, 4, 2, 48, 64, 0.0),
            (37, 7, 3, 22, 96, 0.0),
            (70, 16, 4, 88, 160, 3.0),
            (130, 6, 2, 176, 256, 0.0),
            (300, 16, 8, 40, 64, 1.0),
        ] {
            for format in formats {
                for group_bytes in [GROUP_BYTES, 1] {
                    let path = ExpertPath::Gemm { group_bytes };
                    let what = format!(
                        "{tokens} tokens, {count} experts top {top_k}, [{rows}, {cols}] {format:?} {dtype:?}, \
                         groups of at most {group_bytes} bytes"
                    );
                    let gate_up = experts::<B>([count, rows, cols], format, dtype, device);
                    let m = rows / 2;
                    let down_format = format.filter(|_| m.is_multiple_of(32));
                    let down = experts::<B>([count, cols, m], down_format, dtype, device);
                    // A skew adds to the first expert's score, so it takes most tokens.
                    let bias: Vec<f32> = (0..count).map(|e| if e == 0 { skew } else { 0.0 }).collect();
                    let bias = Tensor::<B, 1>::from_floats(bias.as_slice(), device).reshape([1, count]);
                    let scores = Tensor::<B, 2>::random([tokens, count], Distribution::Normal(0.0, 1.0), device) + bias;
                    let scale = Tensor::<B, 1>::random([count], Distribution::Uniform(0.5, 1.5), device);
                    let routes = route_reference(scores, scale, top_k).expect("routes");
                    let x = Tensor::<B, 2>::random([tokens, cols], Distribution::Normal(0.0, 1.0), device);

                    let h = project(x.clone(), &gate_up, &routes, ExpertProduct::GeluHalves, dtype, path);
                    let h_ref = project_reference(x, &gate_up, &routes, ExpertProduct::GeluHalves, dtype).expect("ref");
                    assert_eq!(h.dtype(), dtype);
                    assert_close(h, h_ref.clone(), tolerance(dtype) * 2.0, &format!("gate/up {what}"));

                    let y = project(h_ref.clone(), &down, &routes, ExpertProduct::WeightedSum, dtype, path);
                    let y_ref =
                        project_reference(h_ref, &down, &routes, ExpertProduct::WeightedSum, dtype).expect("ref");
                    assert_eq!(y.dtype(), dtype);
                    assert_close(y, y_ref, tolerance(dtype) * 2.0, &format!("down {what}"));
                }
            }
        }
    }

    #[cfg(feature = "wgpu")]
    #[test]
    fn batched_experts_match_reference_wgpu_f32() {
        batched::<burn::backend::Wgpu>(&Default::default(), DType::F32, |x, e, r, p, d, path| {
            crate::experts::project_on(x, e, r, p, d, path).expect("read back")
        });
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn batched_experts_match_reference_cuda_f32() {
        batched::<burn::backend::Cuda>(&Default::default(), DType::F32, |x, e, r, p, d, path| {
            crate::experts::project_on(x, e, r, p, d, path).expect("read back")
        });
    }

    #[cfg(feature = "cuda")]
    #[test]
    fn batched_experts_match_reference_cuda_bf16() {
        batched::<burn::backend::Cuda>(&Default::default(), DType::BF16, |x, e, r, p, d, path| {
            crate::experts::project_on(x, e, r, p, d, path).expect("read back")
        });
    }
}
