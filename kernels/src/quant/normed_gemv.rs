//! The add + RMSNorm that feeds a quantized product, fused into the product's prologue (a
//! decode step's one activation row): `out = project(norm(residual + post_norm(delta)))` in one
//! launch instead of the add + RMSNorm kernel and then the matrix-vector kernel.
//!
//! Each cube first computes the normalized row itself, as [`crate::rms_norm`]'s add + RMSNorm
//! kernel does (the same operations, in the same order per element; only the order of the two
//! sums of squares differs): `delta` into shared memory and the residual into registers, the
//! post-norm's sum of squares, the new residual `h = (residual + post_norm(delta)) * scale`
//! (written out by cube 0 only, into a new buffer: the other cubes still read the old one),
//! `h`'s sum of squares, and the normalized row rounded to the activation dtype as the unfused
//! kernel stores it, kept in shared memory as f32. Its planes then take the matrix's row blocks
//! of `ROWS` features, one block per plane and iteration (`cube, cube + cubes, ...` over the
//! grid's planes), each unit striding over a block's rows in code vectors as [`super::gemv`]
//! does, reading the activations from shared memory (stored swizzled: the 32 units of a plane
//! read 32 consecutive code vectors' activations at once, which unswizzled would all fall in
//! one shared-memory bank). The first code vectors are loaded before the wait for the kernels
//! before (see `crate::graph`'s dependent launch).
//!
//! A cube reads the whole row's inputs (about 10 bytes per element), so the grid is kept to a
//! few cubes per multiprocessor, each serving several row blocks.

// Kernel code cannot call `div_ceil` (not a CubeCL intrinsic).
#![allow(clippy::manual_div_ceil)]

use super::device::Packed;
use super::gemv::{block_product, unit_code, ONE_BITS};
use crate::cube::{cube_index, grid, planes_of_32, planes_reduce};
use crate::gelu::kernel::gelu_mul_f32;
use crate::graph::{arg, launch_unchecked};
use crate::linear::kernel::{LANES, ROWS};
use crate::rms_norm::kernel::AddNorm;
use crate::Epilogue;
use burn::tensor::DType;
use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
use cubecl::prelude::*;

/// f32 activations per shared-memory vector.
const QUAD: usize = 4;

/// Quads of the row a unit keeps in registers through the prologue, at most.
const MAX_HELD: usize = 8;

/// Units per cube at most (eight planes).
const MAX_UNITS: usize = 8 * LANES;

/// Longest row the fused kernel takes (elements): `MAX_HELD` quads for each of a cube's units
/// at most (Gemma's widest hidden size is 5,376).
pub const MAX_ROW: usize = MAX_HELD * QUAD * MAX_UNITS;

/// Shared memory every CUDA device gives a cube without opting in.
const SHARED_LIMIT: usize = 48 * 1024;

/// Where quad `j` of the row is kept: its position within each group of eight quads (128
/// bytes, the banks' width) exchanged by the group's index, so that eight consecutive code
/// vectors' quads at one offset fall in eight different bank groups.
#[cube]
fn swizzled(j: usize) -> usize {
    j ^ ((j / 8) % 8)
}

/// `1 / sqrt(mean(x^2) + eps)` from each unit's partial sum of squares over a row of `n`.
#[cube]
fn inv_rms(partial: f32, scratch: &mut SharedMemory<f32>, n: usize, eps: f32, #[comptime] plane: bool) -> f32 {
    let total = planes_reduce(partial, scratch, plane, false);
    1.0f32 / f32::sqrt(total / f32::cast_from(n as u32) + eps)
}

/// Loads the code vector `v` (clamped to the row) of each of the `ROWS` rows of row block
/// `block` (rows clamped to the matrix), with its block scale (and Q4 offset).
#[allow(clippy::too_many_arguments)]
#[cube]
fn load_block_step<S: Float, NW: Size>(
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    cw: &mut Array<Vector<u32, NW>>,
    scale: &mut Array<f32>,
    offset: &mut Array<f32>,
    block: usize,
    v: usize,
    vectors: usize,
    blocks: usize,
    n_out: usize,
    #[comptime] q4: bool,
) {
    let nw = codes.vector_size();
    let words_per_block = comptime!(if q4 { 4usize } else { 8usize });
    let v = min(v, vectors - 1);
    let scale_block = (v * nw) / words_per_block;
    #[unroll]
    for r in 0..ROWS {
        let row = min(block * ROWS + r, n_out - 1);
        cw[r] = codes[row * vectors + v];
        scale[r] = f32::cast_from(scales[row * blocks + scale_block]);
        if q4 {
            offset[r] = f32::cast_from(offsets[row * blocks + scale_block]);
        }
    }
}

/// See the module docs. `planes` planes per cube; `k` the row's length (a multiple of 32).
#[allow(clippy::too_many_arguments)]
#[cube(launch_unchecked)]
fn normed_qgemv_kernel<F: Float, S: Float, R: Float, NW: Size, NS: Size>(
    residual: &Array<R>,
    delta: &Array<F>,
    post_weight: &Array<f32>,
    weight: &Array<f32>,
    codes: &Array<Vector<u32, NW>>,
    scales: &Array<S>,
    offsets: &Array<S>,
    sum: &mut Array<f32>,
    out: &mut Array<F>,
    words: u32,
    blocks: u32,
    n_out: u32,
    eps: f32,
    scale: f32,
    one: u32,
    #[comptime] k: usize,
    #[comptime] planes: usize,
    #[comptime] q4: bool,
    #[comptime] post_norm: bool,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
    #[define(F, S, R)] _dtypes: [StorageType; 3],
) {
    let per_word = comptime!(if q4 { 8usize } else { 4usize });
    let nw = codes.vector_size();
    // Shared-memory quads per code vector.
    let quads = comptime!(nw * per_word / QUAD);
    let row_quads = comptime!(k / QUAD);
    let vectors = words as usize / nw;
    let n_out = n_out as usize;
    let blocks = blocks as usize;
    let row_blocks = (n_out + ROWS - 1) / ROWS;
    let unit = UNIT_POS_X as usize;
    let lane = unit % LANES;
    let plane_index = unit / LANES;
    let grid_planes = cube_count() * planes;
    let mut xs = SharedMemory::<Vector<f32, NS>>::new(row_quads);
    let mut scratch = SharedMemory::<f32>::new(comptime!(if plane { LANES } else { planes * LANES }));
    let mut partial = SharedMemory::<f32>::new(comptime!(if plane { 1usize } else { planes * LANES * ROWS }));

    // The first block's first code vectors, before anything an earlier kernel writes is read.
    let mut cw = Array::<Vector<u32, NW>>::new(ROWS);
    let mut w_scale = Array::<f32>::new(ROWS);
    let mut w_offset = Array::<f32>::new(ROWS);
    let mut base = cube_index() * planes;
    load_block_step::<S, NW>(
        codes,
        scales,
        offsets,
        &mut cw,
        &mut w_scale,
        &mut w_offset,
        min(base + plane_index, row_blocks - 1),
        lane,
        vectors,
        blocks,
        n_out,
        q4,
    );
    comment!("burn-gemma: wait for the kernels before");

    // The prologue: `delta` into shared memory, the residual in registers; each unit keeps
    // the quads it loads (`held` at most) until the last pass, which writes the normalized row
    // swizzled (after the second sum's barriers: every unit has read its own quads by then).
    let units = comptime!(planes * LANES);
    let held = comptime!((row_quads + units - 1) / units);
    let mut kept = Array::<Vector<f32, NS>>::new(held);
    let mut squares = 0.0f32;
    #[unroll]
    for q in 0..held {
        let j = unit + q * units;
        if j < row_quads {
            let mut d = Vector::<f32, NS>::empty();
            let mut r = Vector::<f32, NS>::empty();
            #[unroll]
            for i in 0..QUAD {
                let x = f32::cast_from(delta[j * QUAD + i]);
                d[i] = x;
                r[i] = f32::cast_from(residual[j * QUAD + i]);
                squares += x * x;
            }
            xs[j] = d;
            kept[q] = r;
        }
    }
    let mut post_inv = 1.0f32;
    if post_norm {
        post_inv = inv_rms(squares, &mut scratch, k, eps, plane);
    }
    // `h = (residual + post_norm(delta)) * scale`, the new residual.
    let mut squares = 0.0f32;
    #[unroll]
    for q in 0..held {
        let j = unit + q * units;
        if j < row_quads {
            let d = xs[j];
            let mut h = Vector::<f32, NS>::empty();
            #[unroll]
            for i in 0..QUAD {
                let c = j * QUAD + i;
                let mut x = d[i];
                if post_norm {
                    // Rounded to the activation dtype, as the unfused model stores it.
                    x = f32::cast_from(F::cast_from(d[i] * post_inv * (1.0f32 + post_weight[c])));
                }
                let v = (kept[q][i] + x) * scale;
                h[i] = v;
                squares += v * v;
                if cube_index() == 0 {
                    sum[c] = v;
                }
            }
            kept[q] = h;
        }
    }
    let inv = inv_rms(squares, &mut scratch, k, eps, plane);
    // The normalized row, rounded to the activation dtype, swizzled for the products.
    #[unroll]
    for q in 0..held {
        let j = unit + q * units;
        if j < row_quads {
            let mut x = Vector::<f32, NS>::empty();
            #[unroll]
            for i in 0..QUAD {
                x[i] = f32::cast_from(F::cast_from(kept[q][i] * inv * (1.0f32 + weight[j * QUAD + i])));
            }
            xs[swizzled(j)] = x;
        }
    }
    sync_cube();

    // The products: one row block per plane and iteration, the same number of iterations for
    // every plane of a cube (the shared-memory sums need them all).
    let mut acc = Array::<f32>::new(ROWS);
    let mut dots = Array::<f32>::new(ROWS);
    while base < row_blocks {
        let block = min(base + plane_index, row_blocks - 1);
        #[unroll]
        for r in 0..ROWS {
            acc[r] = 0.0f32;
        }
        let mut v = lane;
        while v < vectors {
            #[unroll]
            for r in 0..ROWS {
                dots[r] = 0.0f32;
            }
            let mut sx = 0.0f32;
            #[unroll]
            for g in 0..quads {
                let xq = xs[swizzled(v * quads + g)];
                #[unroll]
                for i in 0..QUAD {
                    let xi = xq[i];
                    sx += xi;
                    let c = comptime!(g * QUAD + i);
                    #[unroll]
                    for r in 0..ROWS {
                        let word = cw[r][comptime!(c / per_word)];
                        dots[r] += unit_code(word, comptime!(c % per_word), q4, one) * xi;
                    }
                }
            }
            #[unroll]
            for r in 0..ROWS {
                acc[r] += block_product(dots[r], sx, w_scale[r], w_offset[r], q4);
            }
            v += LANES;
            if v < vectors {
                load_block_step::<S, NW>(
                    codes,
                    scales,
                    offsets,
                    &mut cw,
                    &mut w_scale,
                    &mut w_offset,
                    block,
                    v,
                    vectors,
                    blocks,
                    n_out,
                    q4,
                );
            }
        }
        let live = base + plane_index < row_blocks;
        store_block::<F>(&acc, out, &mut partial, block, n_out, live, planes, plane, pairs);
        base += grid_planes;
        if base < row_blocks {
            load_block_step::<S, NW>(
                codes,
                scales,
                offsets,
                &mut cw,
                &mut w_scale,
                &mut w_offset,
                min(base + plane_index, row_blocks - 1),
                lane,
                vectors,
                blocks,
                n_out,
                q4,
            );
        }
    }
}

/// Cubes in the grid.
#[cube]
fn cube_count() -> usize {
    (CUBE_COUNT_X * CUBE_COUNT_Y) as usize
}

/// Adds the plane's 32 partial sums of each of the block's `ROWS` features (`plane_sum`, or a
/// shared-memory tree per plane) and writes them (`live` planes only; features past `n_out`
/// not), or with `pairs` writes `gelu_tanh(gate) * up` of the block's `PAIR_BLOCK` gate and up
/// totals, each rounded to `F` first as a separate product would store it.
#[allow(clippy::too_many_arguments)]
#[cube]
fn store_block<F: Float>(
    acc: &Array<f32>,
    out: &mut Array<F>,
    partial: &mut SharedMemory<f32>,
    block: usize,
    n_out: usize,
    live: bool,
    #[comptime] planes: usize,
    #[comptime] plane: bool,
    #[comptime] pairs: bool,
) {
    let unit = UNIT_POS_X as usize;
    let lane = unit % LANES;
    let mut totals = Array::<f32>::new(ROWS);
    if plane {
        #[unroll]
        for r in 0..ROWS {
            totals[r] = plane_sum(acc[r]);
        }
    } else {
        // Slot `r` of unit `unit` at `r * units + unit`.
        let units = comptime!(planes * LANES);
        sync_cube();
        #[unroll]
        for r in 0..ROWS {
            partial[r * units + unit] = acc[r];
        }
        sync_cube();
        // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = planes * LANES).
        let mut stride = CUBE_DIM_X as usize / comptime!(2 * planes);
        while stride > 0 {
            if lane < stride {
                #[unroll]
                for r in 0..ROWS {
                    partial[r * units + unit] = partial[r * units + unit] + partial[r * units + unit + stride];
                }
            }
            sync_cube();
            stride /= 2;
        }
        #[unroll]
        for r in 0..ROWS {
            totals[r] = partial[r * units + unit - lane];
        }
    }
    if live {
        if pairs {
            let half = comptime!(ROWS / 2);
            #[unroll]
            for c in 0..half {
                if lane == c {
                    let gate = f32::cast_from(F::cast_from(totals[c]));
                    let up = f32::cast_from(F::cast_from(totals[comptime!(half + c)]));
                    out[block * half + c] = F::cast_from(gelu_mul_f32(gate, up));
                }
            }
        } else {
            #[unroll]
            for r in 0..ROWS {
                if lane == r && block * ROWS + r < n_out {
                    out[block * ROWS + r] = F::cast_from(totals[r]);
                }
            }
        }
    }
}

/// Planes per cube and cubes of the grid for `row_blocks` row blocks of rows `k` long on `sms`
/// multiprocessors: eight planes per cube where that still gives two cubes per multiprocessor
/// (fewer, wider cubes read the row's inputs fewer times), else four or two, but enough for
/// each unit to keep at most `MAX_HELD` quads of the row; at most four cubes per
/// multiprocessor, which then serve several row blocks per plane.
fn grid_shape(row_blocks: usize, k: usize, sms: usize) -> (usize, usize) {
    let fewest = (2..=8).step_by(2).find(|&p| (k / QUAD).div_ceil(p * LANES) <= MAX_HELD).unwrap_or(8);
    let wide = [8, 4].into_iter().find(|&p| row_blocks.div_ceil(p) >= 2 * sms).unwrap_or(2);
    let planes = wide.max(fewest);
    (planes, row_blocks.div_ceil(planes).min(4 * sms).max(1))
}

/// Shared memory of a cube: the row (f32), the sums' scratch and, without 32-wide planes, the
/// per-unit partial sums of a row block.
fn shared_bytes(k: usize, planes: usize, plane: bool) -> usize {
    let units = planes * LANES;
    4 * (k + if plane { LANES + 1 } else { units + units * ROWS })
}

/// `add_rms_norm` of one row (`residual`, `delta`: `[.., k]` with one row) then its product
/// with `w` and `epilogue`, in one kernel: `(new residual [.., k] f32, out [1, out width])`.
/// `None` where the fused kernel does not apply (several rows, a row longer than
/// [`MAX_ROW`] or not a multiple of 32 or than the device's shared memory holds, code rows
/// without 16-byte loads, a normalized dtype
/// other than `delta`'s, a GELU-pairs matrix whose features are not whole row blocks): the
/// caller then runs the two kernels.
pub fn add_norm_gemv<R: CubeRuntime>(
    residual: &CubeTensor<R>,
    delta: &CubeTensor<R>,
    norms: &AddNorm<CubeTensor<R>>,
    w: &Packed<R>,
    epilogue: Epilogue,
) -> Option<(CubeTensor<R>, CubeTensor<R>)> {
    let shape = delta.meta.shape().clone();
    let k = shape[shape.num_dims() - 1];
    let out_features = w.codes.meta.shape()[0];
    let pairs = epilogue == Epilogue::GeluPairs;
    let (nw, _) = w.load_vectors(delta);
    let applies = shape.num_elements() == k
        && residual.meta.shape().num_elements() == k
        && w.cols() == k
        && k > 0
        && k % 32 == 0
        && k <= MAX_ROW
        && nw == QUAD
        && out_features > 0
        && norms.out_dtype == delta.dtype
        && norms.weight.dtype == DType::F32
        && norms.post.as_ref().is_none_or(|p| p.dtype == DType::F32)
        && (!pairs || out_features % ROWS == 0);
    if !applies {
        return None;
    }
    let client = &delta.client;
    let hardware = &client.properties().hardware;
    let sms = hardware.num_streaming_multiprocessors.map_or(128, |s| s as usize);
    let row_blocks = out_features.div_ceil(ROWS);
    let (planes, cubes) = grid_shape(row_blocks, k, sms);
    let plane = planes_of_32(client);
    let shared_limit = SHARED_LIMIT.min(hardware.max_shared_memory_size);
    if shared_bytes(k, planes, plane) > shared_limit || planes * LANES > hardware.max_units_per_cube as usize {
        return None;
    }
    let (codes, scales, offsets, q4) = w.args();
    let (row_words, row_blocks_of_scales) = w.row_sizes();
    let sum = crate::cube::empty(delta, shape, DType::F32);
    let out = crate::cube::empty(delta, [1, epilogue.out_width(out_features)], delta.dtype);
    // Without a post-norm its weight is never read; the norm's weight stands in.
    let post = norms.post.clone().unwrap_or_else(|| norms.weight.clone());
    // Unchecked: every index is in range by construction (rows and vectors clamped, stores
    // guarded by the features' count).
    launch_unchecked!(normed_qgemv_kernel(
        client,
        grid(cubes),
        CubeDim::new_1d((planes * LANES) as u32),
        nw,
        QUAD,
        arg(residual),
        arg(delta),
        arg(&post),
        arg(&norms.weight),
        arg(&codes),
        arg(&scales),
        arg(&offsets),
        arg(&sum),
        arg(&out),
        row_words,
        row_blocks_of_scales,
        out_features as u32,
        norms.eps as f32,
        norms.scale as f32,
        ONE_BITS,
        k,
        planes,
        q4,
        norms.post.is_some(),
        plane,
        pairs,
        [delta.dtype.into(), scales.dtype.into(), residual.dtype.into()],
    ));
    Some((sum, out))
}

/// The fused product against f64 sums over the host-dequantized matrix of the f64 add +
/// RMSNorm, each value rounded to the activation dtype where the model stores it.
#[cfg(test)]
pub(crate) mod check {
    use super::super::check::{host, values};
    use super::super::{HostQuantized, QuantFormat};
    use crate::gpu_test::{assert_close, tolerance};
    use crate::{AddNorm, Epilogue, GemmaBackend, HostMatrix};
    use burn::tensor::{DType, Tensor, TensorData};

    /// One case: the weights' format, the row's length, the features, the epilogue, whether a
    /// post-norm comes first, the sum's scale, and whether the residual is f32 (else in the
    /// activation dtype, as the embeddings before the first add).
    struct Case {
        format: QuantFormat,
        k: usize,
        out: usize,
        epilogue: Epilogue,
        post: bool,
        scale: f32,
        residual_f32: bool,
    }

    pub fn add_norm_project<B: GemmaBackend>(device: &B::Device, dtype: DType, seed: u64) {
        use Epilogue::{GeluPairs, Identity};
        use QuantFormat::{Q4, Q8};
        let case = |format, k, out, epilogue, post, scale, residual_f32| Case {
            format,
            k,
            out,
            epilogue,
            post,
            scale,
            residual_f32,
        };
        let cases = [
            case(Q8, 256, 1000, Identity, true, 1.0, true),
            case(Q4, 256, 1000, Identity, true, 1.0, true),
            // Features not a whole number of row blocks; rows shorter than a plane's step.
            case(Q8, 160, 77, Identity, false, 1.0, false),
            case(Q4, 96, 45, Identity, true, 0.75, true),
            // The gate|up product of a decode step, rows as long as a 12B's.
            case(Q4, 3840, 640, GeluPairs, true, 1.0, true),
            case(Q8, 1152, 2000, GeluPairs, true, 1.0, false),
            // More row blocks than the grid's planes: each plane serves several.
            case(Q4, 64, 40000, Identity, true, 1.0, true),
            case(Q8, 64, 40008, GeluPairs, false, 0.5, true),
            // Where the fused kernel does not apply (a row longer than `MAX_ROW`): the two kernels.
            case(Q8, super::MAX_ROW + 32, 50, Identity, true, 1.0, true),
        ];
        let eps = 1e-6f64;
        // Values rounded to the activation dtype, as the device stores them.
        let round = |v: Vec<f32>| -> Vec<f32> {
            let n = v.len();
            host(Tensor::<B, 1>::from_data(TensorData::new(v, [n]), (device, DType::F32)).cast(dtype))
        };
        let tensor = |v: Vec<f32>, dtype: DType| {
            let n = v.len();
            Tensor::<B, 1>::from_data(TensorData::new(v, [n]), (device, DType::F32)).cast(dtype)
        };
        for (i, c) in cases.into_iter().enumerate() {
            let s = seed.wrapping_add(31 * i as u64);
            let what = format!(
                "{} add + norm + project {} -> {} ({:?}, post norm {}, scale {}, residual f32 {})",
                c.format, c.k, c.out, c.epilogue, c.post, c.scale, c.residual_f32
            );
            let hq = HostQuantized::quantize(&values(c.out * c.k, s), c.out, c.k, c.format).expect("quantize");
            let w = B::upload_matrix(HostMatrix::Quantized(hq.clone()), device).expect("upload");
            let residual_dtype = if c.residual_f32 { DType::F32 } else { dtype };
            let residual: Vec<f32> = values(c.k, s ^ 0x11).iter().map(|v| v * 40.0).collect();
            let residual = host(tensor(residual, residual_dtype));
            let delta = round(values(c.k, s ^ 0x22).iter().map(|v| v * 7.0).collect());
            let post_weight = values(c.k, s ^ 0x33);
            let weight = values(c.k, s ^ 0x44);

            // The f64 reference, rounded where the model rounds.
            let inv_rms = |v: &[f64]| 1.0 / (v.iter().map(|x| x * x).sum::<f64>() / c.k as f64 + eps).sqrt();
            let d: Vec<f64> = delta.iter().map(|&x| x as f64).collect();
            let added: Vec<f64> = if c.post {
                let inv = inv_rms(&d);
                let normed = (0..c.k).map(|j| (d[j] * inv * (1.0 + post_weight[j] as f64)) as f32).collect();
                round(normed).into_iter().map(f64::from).collect()
            } else {
                d
            };
            let h: Vec<f64> = (0..c.k).map(|j| (residual[j] as f64 + added[j]) * c.scale as f64).collect();
            let inv = inv_rms(&h);
            let x = round((0..c.k).map(|j| (h[j] * inv * (1.0 + weight[j] as f64)) as f32).collect());
            let ws = hq.dequantize();
            let products: Vec<f32> = (0..c.out)
                .map(|o| (0..c.k).map(|j| x[j] as f64 * ws[o * c.k + j] as f64).sum::<f64>() as f32)
                .collect();
            let products = Tensor::<B, 2>::from_data(TensorData::new(products, [1, c.out]), (device, DType::F32));
            let expected = match c.epilogue {
                Identity => products,
                GeluPairs => crate::gelu::pairs_reference(products),
            };
            let expected_sum = Tensor::<B, 3>::from_data(
                TensorData::new(h.iter().map(|&v| v as f32).collect::<Vec<_>>(), [1, 1, c.k]),
                (device, DType::F32),
            );

            let norms = AddNorm {
                post: c.post.then(|| tensor(post_weight.clone(), DType::F32)),
                weight: tensor(weight.clone(), DType::F32),
                eps,
                scale: c.scale as f64,
                out_dtype: dtype,
            };
            let (sum, got) = B::add_norm_project(
                tensor(residual.clone(), residual_dtype).reshape([1, 1, c.k]),
                tensor(delta.clone(), dtype).reshape([1, 1, c.k]),
                &norms,
                &w,
                c.epilogue,
            );
            assert_eq!(sum.dtype(), DType::F32, "{what}: residual dtype");
            assert_eq!(got.dtype(), dtype, "{what}: product dtype");
            // The sum holds the post-normed delta rounded to the activation dtype, whose
            // rounding may fall the other way where the sums of squares are added in another
            // order: within the dtype's tolerance of the reference.
            assert_close(sum, expected_sum, tolerance(dtype), &format!("{what}: residual"));
            assert_close(got, expected, tolerance(dtype) * 2.0, &what);
        }
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod reference_tests {
    use crate::test_util::TestBackend;
    use burn::tensor::DType;

    #[test]
    fn unfused_pair_matches_the_f64_reference() {
        let seed = crate::gpu_test::host_seed("unfused_pair_matches_the_f64_reference");
        super::check::add_norm_project::<TestBackend>(&Default::default(), DType::F32, seed);
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::seed;
    use crate::GemmaBackend;
    use burn::tensor::DType;

    pub fn add_norm_project<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let s = seed::<B>(device, "add_norm_project");
        super::check::add_norm_project::<B>(device, dtype, s);
    }

    gpu_tests!(fused_add_norm_project_matches_reference => add_norm_project);
}
