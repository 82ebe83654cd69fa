//! Merging the partial results of attention split over the keys.

use super::kernel::{shape_arg, AttentionShape, ShapeSizes};
use crate::cube::{cube_index, grid, load_vector_size, planes_of_32, planes_reduce, pow2_floor};
use crate::graph::{arg, launch};
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// Units per merged row.
const MERGE_UNITS: usize = 256;

/// Merges the per-split partial results of one output row (sequence, query head, query
/// position) per cube. The splits' weights `exp(max_s - max)` are computed once into shared
/// memory; the units then split the row into column vectors and the splits into `groups`
/// interleaved sets, so that each unit's loads are few and independent (a decode row may have
/// a hundred splits), and the groups' sums meet in shared memory.
#[cube(launch)]
fn merge_splits_kernel<F: Float, N: Size>(
    partial: &Array<Vector<f32, N>>,
    stats: &Array<f32>,
    out: &mut Array<Vector<F, N>>,
    splits: u32,
    shape: AttentionShape,
    #[comptime] dim: usize,
    #[comptime] groups: usize,
    #[comptime] max_splits: usize,
    #[comptime] plane: bool,
    #[define(F)] _dtype: StorageType,
) {
    let width = partial.vector_size();
    let columns = comptime!(dim / width);
    let row = cube_index();
    if row >= shape.batch * shape.q_heads * shape.q_len {
        terminate!();
    }
    let splits = splits as usize;
    let q_len = shape.q_len;
    let kv_heads = shape.kv_heads;
    let rows = shape.q_heads / kv_heads * q_len;
    let i = row % q_len;
    let h = (row / q_len) % shape.q_heads;
    let b = row / (q_len * shape.q_heads);
    let per_kv = shape.q_heads / kv_heads;
    let kvh = h / per_kv;
    let r = (h % per_kv) * q_len + i;
    // Split `s` of this row is slot `first + s * step`.
    let first = (b * kv_heads + kvh) * rows + r;
    let step = shape.batch * kv_heads * rows;
    let tid = UNIT_POS_X as usize;

    let mut scratch = SharedMemory::<f32>::new(MERGE_UNITS);
    let mut weights = SharedMemory::<f32>::new(max_splits);
    let mut top = f32::new(-1.0e30);
    let mut s = tid;
    while s < splits {
        top = max(top, stats[(first + s * step) * 2]);
        s += MERGE_UNITS;
    }
    let top = planes_reduce(top, &mut scratch, plane, true);
    let mut l = 0.0f32;
    let mut s = tid;
    while s < splits {
        let slot = first + s * step;
        let w = f32::exp(stats[slot * 2] - top);
        weights[s] = w;
        l += stats[slot * 2 + 1] * w;
        s += MERGE_UNITS;
    }
    let l = planes_reduce(l, &mut scratch, plane, false);

    let mut sums = SharedMemory::<Vector<f32, N>>::new(comptime!(groups * columns));
    let mut at = tid;
    while at < comptime!(groups * columns) {
        let column = at % columns;
        let group = at / columns;
        let mut acc = Vector::<f32, N>::new(0.0f32);
        let mut s = group;
        while s < splits {
            acc += partial[(first + s * step) * columns + column] * Vector::new(weights[s]);
            s += groups;
        }
        sums[at] = acc;
        at += MERGE_UNITS;
    }
    sync_cube();
    let mut inv = 0.0f32;
    if l > 0.0f32 {
        inv = 1.0f32 / l;
    }
    let mut column = tid;
    while column < columns {
        let mut total = Vector::<f32, N>::new(0.0f32);
        #[unroll]
        for g in 0..groups {
            total += sums[g * columns + column];
        }
        out[row * columns + column] = Vector::cast_from(total * Vector::new(inv));
        column += MERGE_UNITS;
    }
}

/// Merges `splits` (at most [`super::kernel::MAX_SPLITS`]) partial results (`partial`
/// `[splits * rows, dim]`, `stats` `[splits * rows, 2]`, f32) into `out` (`[batch, q_heads,
/// q_len, dim]`, contiguous).
pub(super) fn merge<R: CubeRuntime>(
    partial: CubeTensor<R>,
    stats: CubeTensor<R>,
    out: &CubeTensor<R>,
    splits: usize,
    shape: ShapeSizes,
    dim: usize,
) {
    let rows = shape.batch * shape.q_heads * shape.q_len;
    let width = load_vector_size(&out.client, 4, dim, 4);
    let columns = dim / width;
    // Interleaved sets of splits per column vector: as many as the cube's units allow.
    let groups = pow2_floor((MERGE_UNITS / columns.max(1)).max(1));
    launch!(merge_splits_kernel(
        &out.client,
        grid(rows),
        CubeDim::new_1d(MERGE_UNITS as u32),
        width,
        arg(&partial),
        arg(&stats),
        arg(out),
        splits as u32,
        shape_arg(shape),
        dim,
        groups,
        super::kernel::MAX_SPLITS,
        planes_of_32(&out.client),
        out.dtype.into(),
    ));
}
