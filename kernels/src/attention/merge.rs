//! Merging the partial results of attention split over the keys.

use super::kernel::{shape_arg, AttentionShape, ShapeSizes};
use crate::cube::{elementwise, unit_index};
use crate::graph::{arg, launch};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// Merges the per-split partial results: one unit per output element.
#[cube(launch)]
fn merge_splits_kernel<F: Float>(
    partial: &Array<f32>,
    stats: &Array<f32>,
    out: &mut Array<F>,
    splits: u32,
    shape: AttentionShape,
    #[comptime] dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let idx = unit_index();
    if idx >= out.len() {
        terminate!();
    }
    let q_heads = shape.q_heads;
    let batch = shape.batch;
    let kv_heads = shape.kv_heads;
    let q_len = shape.q_len;
    let groups = q_heads / kv_heads;
    let rows = groups * q_len;
    let c = idx % dim;
    let i = (idx / dim) % q_len;
    let h = (idx / (dim * q_len)) % q_heads;
    let b = idx / (dim * q_len * q_heads);
    let kvh = h / groups;
    let r = (h % groups) * q_len + i;
    let mut m = f32::new(-1.0e30);
    for s in 0..splits as usize {
        let slot = ((s * batch + b) * kv_heads + kvh) * rows + r;
        m = m.max(stats[slot * 2]);
    }
    let mut l = 0.0f32;
    let mut o = 0.0f32;
    for s in 0..splits as usize {
        let slot = ((s * batch + b) * kv_heads + kvh) * rows + r;
        let w = f32::exp(stats[slot * 2] - m);
        l += stats[slot * 2 + 1] * w;
        o += partial[slot * dim + c] * w;
    }
    let mut value = 0.0f32;
    if l > 0.0f32 {
        value = o / l;
    }
    out[idx] = F::cast_from(value);
}

/// Merges `splits` partial results (`partial` `[splits * rows, dim]`, `stats` `[splits * rows, 2]`,
/// f32) into `out` (`[batch, q_heads, q_len, dim]`).
pub(super) fn merge<R: CubeRuntime>(
    partial: CubeTensor<R>,
    stats: CubeTensor<R>,
    out: &CubeTensor<R>,
    splits: usize,
    shape: ShapeSizes,
    dim: usize,
) {
    let (count, cube_dim) = elementwise(out.meta.num_elements(), 256);
    launch!(merge_splits_kernel(
        &out.client,
        count,
        cube_dim,
        arg(&partial),
        arg(&stats),
        arg(out),
        splits as u32,
        shape_arg(shape),
        dim,
        out.dtype.into(),
    ));
}
