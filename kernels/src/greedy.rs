//! The lm_head with the greedy choice: the logits of a decode step (`x @ table^T`, softcapped
//! where the model caps them) and each row's argmax, as [`crate::GemmaBackend::project`],
//! [`crate::GemmaBackend::softcap`] and [`crate::GemmaBackend::sample`] with
//! [`SamplingParams::GREEDY`] give them one after the other.
//!
//! The CubeCL backends fuse the three for tables of Q4/Q8 blocks: the quantized matrix-vector
//! kernel's cubes store their logits (capped in the store) and each writes its own best logit
//! and its index; one small kernel then picks the best of those per row. The separate path
//! reads the whole row of logits again (the sampler's first pass over the vocabulary) and
//! launches a softcap kernel over it where the model caps.

use crate::{
    sampling::{Draws, SamplingParams},
    GemmaBackend, Matrix, ReadBackError,
};
use burn::tensor::{Int, Tensor};

/// What [`crate::GemmaBackend::project_greedy`] returns.
#[derive(Debug, Clone)]
pub struct HeadChoice<B: burn::tensor::backend::Backend> {
    /// `[n, vocab]` in the activation dtype, softcapped where a cap was given.
    pub logits: Tensor<B, 2>,
    /// `[n]`: each row's argmax (the first index on ties), or `vocab` where the row holds a
    /// NaN or an infinite logit (as [`crate::GemmaBackend::sample`] answers).
    pub ids: Tensor<B, 1, Int>,
}

/// Reference: the product with each row block of `table` (side by side), the softcap, and the
/// greedy sampler. An empty table gives `[n, 0]` logits and every id 0 (its vocabulary size).
pub fn reference<B: GemmaBackend>(
    x: Tensor<B, 2>,
    table: &[Matrix<B>],
    cap: Option<f64>,
) -> Result<HeadChoice<B>, ReadBackError> {
    let logits = crate::matrix::project_table(x, table);
    if table.is_empty() {
        let [n, _] = logits.dims();
        return Ok(HeadChoice { ids: Tensor::zeros([n], &logits.device()), logits });
    }
    let logits = match cap {
        Some(cap) => B::softcap(logits, cap),
        None => logits,
    };
    let ids = B::sample(logits.clone(), &SamplingParams::GREEDY, Draws::Host(&[]))?;
    Ok(HeadChoice { logits, ids })
}

/// CubeCL kernels: the quantized GEMV with the greedy epilogue, and the pick over its cubes.
// Kernel code cannot call `div_ceil` (not a CubeCL intrinsic).
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use crate::cube::{cube_index, empty, grid, planes_of_32, pow2_floor, tanh_f32};
    use crate::graph::{arg, launch_unchecked};
    use crate::linear::kernel::{tree_sum, LANES, ROWS};
    use crate::quant::gemv::{accumulate, gemv_unroll, GemvShape, ONE_BITS};
    use crate::quant::kernel::Packed;
    use crate::sampling::kernel::combine;
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// A cube's best-logit index where its logits hold a NaN or an infinity.
    const NON_FINITE: u32 = 0xFFFF_FFFE;
    /// Below every logit the greedy sampler compares (its starting value).
    const LOWEST: f32 = -3.0e38;
    /// Partials per unit of the pick kernel's step, in vectors of four.
    const PICK_UNROLL: usize = 8;
    const PICK_THREADS: usize = 1024;

    /// Where a block's products go: row `t`'s logits start at `t * vocab`, this block's at
    /// column `first_row`; its cubes' partials at `t * partials + first_cube`.
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub(crate) struct HeadPlace {
        pub vocab: u32,
        pub first_row: u32,
        pub partials: u32,
        pub first_cube: u32,
    }

    /// The quantized GEMV of [`crate::quant::gemv`] (one plane per row group), whose store
    /// rounds each logit to `F`, caps it (`tanh(x / cap) * cap` in f32, rounded again, as the
    /// softcap kernel does) when `capped`, and writes the cube's best capped logit of each
    /// activation row (first index on ties, [`NON_FINITE`] where one is not finite) to `best`
    /// and `best_at`.
    #[allow(clippy::too_many_arguments, clippy::collapsible_else_if)]
    #[cube(launch_unchecked)]
    fn head_greedy_kernel<F: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<F, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        logits: &mut Array<F>,
        best: &mut Array<f32>,
        best_at: &mut Array<u32>,
        place: HeadPlace,
        words: u32,
        blocks: u32,
        n_out: u32,
        one: u32,
        cap: f32,
        #[comptime] m: usize,
        #[comptime] per_plane: usize,
        #[comptime] unroll: usize,
        #[comptime] q4: bool,
        #[comptime] plane: bool,
        #[comptime] capped: bool,
        #[define(F, S)] _dtypes: [StorageType; 2],
    ) {
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        let cube = cube_index();
        // This plane's first feature within the cube's `ROWS`.
        let local = (unit / LANES) * per_plane;
        let first = cube * ROWS + local;
        let slots = comptime!(m * per_plane);
        let mut acc = Array::<f32>::new(slots);
        let shape = GemvShape { words, blocks, n_out, one };
        accumulate::<F, S, NW, NX>(x, codes, scales, offsets, &mut acc, first, shape, m, per_plane, unroll, q4, 1usize);
        let n_out = n_out as usize;

        // The totals of the cube's (activation row, feature) pairs, added as the plain GEMV's
        // `reduce_and_store` adds them.
        let mut totals = SharedMemory::<f32>::new(comptime!(m * ROWS));
        if plane {
            #[unroll]
            for t in 0..m {
                #[unroll]
                for r in 0..per_plane {
                    let total = plane_sum(acc[t * per_plane + r]);
                    if lane == 0 {
                        totals[t * ROWS + local + r] = total;
                    }
                }
            }
        } else {
            let threads = comptime!(ROWS / per_plane * LANES);
            let mut partial = SharedMemory::<f32>::new(comptime!(ROWS * LANES * m));
            tree_sum(&acc, &mut partial, m, per_plane);
            if lane == 0 {
                #[unroll]
                for t in 0..m {
                    #[unroll]
                    for r in 0..per_plane {
                        totals[t * ROWS + local + r] = partial[(t * per_plane + r) * threads + unit];
                    }
                }
            }
        }
        sync_cube();

        // One unit per (activation row, feature): the stored logit, and its value as the
        // sampler reads it back.
        let mut values = SharedMemory::<f32>::new(comptime!(m * ROWS));
        let mut finite = SharedMemory::<u32>::new(comptime!(m * ROWS));
        if unit < m * ROWS {
            let t = unit / ROWS;
            let row = cube * ROWS + unit % ROWS;
            let mut value = f32::new(LOWEST);
            let mut ok = 1u32;
            if row < n_out {
                let mut stored = F::cast_from(totals[unit]);
                if capped {
                    stored = F::cast_from(tanh_f32(f32::cast_from(stored) / cap) * cap);
                }
                logits[t * place.vocab as usize + place.first_row as usize + row] = stored;
                value = f32::cast_from(stored);
                if f32::is_nan(value) || f32::is_inf(value) {
                    ok = 0u32;
                }
            }
            values[unit] = value;
            finite[unit] = ok;
        }
        sync_cube();
        if unit < m {
            let mut top = f32::new(LOWEST);
            let mut top_at = 4_294_967_295u32;
            let mut ok: u32 = 1u32;
            #[unroll]
            for c in 0..ROWS {
                let value = values[unit * ROWS + c];
                if finite[unit * ROWS + c] == 0u32 {
                    ok = 0u32;
                }
                if value > top {
                    top = value;
                    top_at = place.first_row + (cube * ROWS + c) as u32;
                }
            }
            if ok == 0u32 {
                top_at = NON_FINITE;
            }
            let at = unit * place.partials as usize + place.first_cube as usize + cube;
            best[at] = top;
            best_at[at] = top_at;
        }
    }

    /// One cube per activation row: the best of its `count` cube partials (first index on
    /// ties), or `vocab` where one marks a non-finite logit or none is above [`LOWEST`] (the
    /// greedy sampler's answers). The partials are read in vectors of four, `PICK_UNROLL` of
    /// them per unit issued before any is compared (the row stride, `partials`, is a multiple
    /// of four; entries from `count` on are never written and are skipped).
    #[allow(clippy::too_many_arguments)]
    #[cube(launch_unchecked)]
    fn pick_kernel<I: Int, N: Size>(
        best: &Array<Vector<f32, N>>,
        best_at: &Array<Vector<u32, N>>,
        ids: &mut Array<I>,
        partials: u32,
        count: u32,
        vocab: u32,
        #[comptime] threads: usize,
        #[define(I)] _dtype: StorageType,
    ) {
        let row = CUBE_POS_X as usize;
        let tid = UNIT_POS_X as usize;
        let vectors = partials as usize / 4;
        let count = count as usize;
        let base = row * vectors;
        let mut top = f32::new(LOWEST);
        let mut top_at = 4_294_967_295u32;
        let mut bad = 0u32;
        let mut v0 = tid;
        let mut vs = Array::<Vector<f32, N>>::new(PICK_UNROLL);
        let mut js = Array::<Vector<u32, N>>::new(PICK_UNROLL);
        while v0 < vectors {
            #[unroll]
            for u in 0..PICK_UNROLL {
                let v = min(v0 + u * threads, vectors - 1);
                vs[u] = best[base + v];
                js[u] = best_at[base + v];
            }
            #[unroll]
            for u in 0..PICK_UNROLL {
                let v = v0 + u * threads;
                #[unroll]
                for i in 0..4usize {
                    let e = v * 4 + i;
                    if v < vectors && e < count {
                        let (value, j) = (vs[u][i], js[u][i]);
                        if j == NON_FINITE {
                            bad = 1u32;
                        } else if value > top || (value == top && j < top_at) {
                            top = value;
                            top_at = j;
                        }
                    }
                }
            }
            v0 += comptime!(PICK_UNROLL * threads);
        }
        let mut values = SharedMemory::<f32>::new(threads);
        let mut index = SharedMemory::<u32>::new(threads);
        let mut lows = SharedMemory::<f32>::new(threads);
        let mut flags = SharedMemory::<u32>::new(threads);
        let (_, at, _, bad) = combine((top, top_at, top, bad), &mut values, &mut index, &mut lows, &mut flags);
        if tid == 0 {
            let mut id = min(at, vocab);
            if bad != 0u32 {
                id = vocab;
            }
            ids[row] = I::cast_from(id);
        }
    }

    /// `x`: contiguous `[n, in]` (`n <= GEMV_MAX_ROWS`); `table`: the row blocks of the
    /// `[vocab, in]` table. Returns the logits `[n, vocab]` in `x`'s dtype (capped by `cap` when
    /// given) and the `[n]` ids in `int_dtype`.
    pub fn head_greedy<R: CubeRuntime>(
        x: CubeTensor<R>,
        table: &[Packed<R>],
        cap: Option<f64>,
        int_dtype: DType,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let n = x.meta.shape()[0];
        let rows: Vec<usize> = table.iter().map(|w| w.codes.meta.shape()[0]).collect();
        let vocab: usize = rows.iter().sum();
        let logits = empty(&x, [n, vocab], x.dtype);
        let ids = empty(&x, [n], int_dtype);
        if n == 0 {
            return (logits, ids);
        }
        let count: usize = rows.iter().map(|r| r.div_ceil(ROWS)).sum();
        // A multiple of four (the pick kernel's vectors), at least one vector.
        let partials = count.max(1).div_ceil(4) * 4;
        let best = empty(&x, [n * partials], DType::F32);
        let best_at = empty(&x, [n * partials], DType::U32);
        // One plane per row group, as the plain GEMV has for a table's many rows.
        let per_plane = if n <= 2 { 4 } else { 2 };
        let unroll = gemv_unroll(per_plane, n);
        let plane = planes_of_32(&x.client);
        let (mut first_row, mut first_cube) = (0, 0);
        for (w, &out_features) in table.iter().zip(&rows) {
            if out_features == 0 {
                continue;
            }
            let (codes, scales, offsets, q4) = w.args();
            let (row_words, row_blocks) = w.row_sizes();
            let (nw, nx) = w.load_vectors(&x);
            let dtypes = [x.dtype.into(), scales.dtype.into()];
            let cubes = out_features.div_ceil(ROWS);
            // Unchecked as the plain GEMV: indices are in range by construction.
            launch_unchecked!(head_greedy_kernel(
                &x.client,
                grid(cubes),
                CubeDim::new_1d((ROWS / per_plane * LANES) as u32),
                nw,
                nx,
                arg(&x),
                arg(&codes),
                arg(&scales),
                arg(&offsets),
                arg(&logits),
                arg(&best),
                arg(&best_at),
                HeadPlaceLaunch::new(vocab as u32, first_row as u32, partials as u32, first_cube as u32),
                row_words,
                row_blocks,
                out_features as u32,
                ONE_BITS,
                cap.unwrap_or(1.0) as f32,
                n,
                per_plane,
                unroll,
                q4,
                plane,
                cap.is_some(),
                dtypes,
            ));
            first_row += out_features;
            first_cube += cubes;
        }
        let limit = x.client.properties().hardware.max_units_per_cube as usize;
        let threads = pow2_floor(limit.min(PICK_THREADS));
        launch_unchecked!(pick_kernel(
            &x.client,
            CubeCount::Static(n as u32, 1, 1),
            CubeDim::new_1d(threads as u32),
            4usize,
            arg(&best),
            arg(&best_at),
            arg(&ids),
            partials as u32,
            count as u32,
            vocab as u32,
            threads,
            int_dtype.into(),
        ));
        (logits, ids)
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed};
    use crate::quant::check::{host, values};
    use crate::quant::{HostQuantized, QuantFormat};
    use crate::{sampling, GemmaBackend, HostMatrix};
    use burn::tensor::{DType, Tensor, TensorData};

    /// The backend's lm_head with the greedy choice against f64 products of the dequantized
    /// table (capped in f64 where a cap is given), and its ids against the argmax of the logits
    /// it returned (the choice must be consistent with them to the bit); a NaN activation row
    /// gives `vocab`. Tables of one and of three row blocks (odd sizes, not multiples of a
    /// cube's rows), one to eight activation rows, Q4 and Q8, with and without a cap.
    pub fn head_greedy<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let s = seed::<B>(device, "head_greedy");
        let mut case = 0u64;
        for format in [QuantFormat::Q8, QuantFormat::Q4] {
            for (n, inp, splits) in [
                (1, 256, &[1001][..]),
                (1, 640, &[70_001][..]),
                (2, 96, &[203][..]),
                (3, 160, &[70, 71, 62][..]),
                (8, 64, &[4099][..]),
                (1, 1152, &[40, 9000, 13][..]),
            ] {
                for cap in [None, Some(30.0)] {
                    case += 1;
                    let vocab: usize = splits.iter().sum();
                    let hq =
                        HostQuantized::quantize(&values(vocab * inp, s ^ case), vocab, inp, format).expect("quantize");
                    let mut table = Vec::new();
                    let mut at = 0;
                    for &rows in splits {
                        let block = HostMatrix::Quantized(hq.rows_slice(at..at + rows));
                        table.push(B::upload_matrix(block, device).expect("upload"));
                        at += rows;
                    }
                    // Activations of about the scale of a final norm's output, so that the
                    // logits reach past the cap.
                    let xs: Vec<f32> = values(n * inp, s.wrapping_add(case)).iter().map(|v| v * 40.0).collect();
                    let x = Tensor::<B, 2>::from_data(TensorData::new(xs.clone(), [n, inp]), (device, DType::F32))
                        .cast(dtype);
                    let xs = host(x.clone());
                    let ws = hq.dequantize();
                    let expected: Vec<f32> = (0..n)
                        .flat_map(|r| {
                            let (xs, ws) = (&xs, &ws);
                            (0..vocab).map(move |o| {
                                let dot: f64 = (0..inp).map(|c| xs[r * inp + c] as f64 * ws[o * inp + c] as f64).sum();
                                match cap {
                                    Some(cap) => ((dot / cap).tanh() * cap) as f32,
                                    None => dot as f32,
                                }
                            })
                        })
                        .collect();
                    let what = format!("{format} lm_head greedy {n}x{inp} -> {splits:?} cap {cap:?}");
                    let choice = B::project_greedy(x.clone(), &table, cap).expect("greedy head");
                    assert_eq!(choice.logits.dtype(), dtype, "{what}");
                    let got = host(choice.logits.clone());
                    let expected_t =
                        Tensor::<B, 2>::from_data(TensorData::new(expected, [n, vocab]), (device, DType::F32));
                    // The products' tolerance (as `quant::check`'s).
                    let tol = crate::gpu_test::tolerance(dtype) * 2.0;
                    assert_close(choice.logits.clone(), expected_t, tol, &what);
                    let ids: Vec<i64> = choice.ids.into_data().convert::<i64>().to_vec().expect("ids");
                    let argmax: Vec<i64> =
                        (0..n).map(|r| sampling::argmax(&got[r * vocab..(r + 1) * vocab]) as i64).collect();
                    assert_eq!(ids, argmax, "{what}: ids against the argmax of the logits returned");
                    // A non-finite row: every logit NaN.
                    let mut bad = xs.clone();
                    bad[(n - 1) * inp] = f32::NAN;
                    let x = Tensor::<B, 2>::from_data(TensorData::new(bad, [n, inp]), (device, DType::F32)).cast(dtype);
                    let ids: Vec<i64> = B::project_greedy(x, &table, cap)
                        .expect("greedy head")
                        .ids
                        .into_data()
                        .convert::<i64>()
                        .to_vec()
                        .expect("ids");
                    assert_eq!(ids[n - 1], vocab as i64, "{what}: a NaN row gives the vocabulary size");
                    assert_eq!(ids[..n - 1], argmax[..n - 1], "{what}: the other rows keep their choice");
                }
            }
        }
        // A table the fused kernel does not take (dense): the backend's separate path.
        let (n, inp, vocab) = (2, 96, 517);
        let w = Tensor::<B, 2>::from_data(
            TensorData::new(values(vocab * inp, s ^ 0xD5), [vocab, inp]),
            (device, DType::F32),
        )
        .cast(dtype);
        let ws = host(w.clone());
        let table = vec![B::upload_matrix(HostMatrix::Dense(w), device).expect("dense upload")];
        let x = Tensor::<B, 2>::from_data(TensorData::new(values(n * inp, s ^ 0xD6), [n, inp]), (device, DType::F32))
            .cast(dtype);
        let choice = B::project_greedy(x.clone(), &table, None).expect("greedy head");
        let got = host(choice.logits.clone());
        let xs = host(x);
        let expected: Vec<f32> = (0..n)
            .flat_map(|r| {
                let (xs, ws) = (&xs, &ws);
                (0..vocab)
                    .map(move |o| (0..inp).map(|c| xs[r * inp + c] as f64 * ws[o * inp + c] as f64).sum::<f64>() as f32)
            })
            .collect();
        let expected_t = Tensor::<B, 2>::from_data(TensorData::new(expected, [n, vocab]), (device, DType::F32));
        assert_close(choice.logits, expected_t, crate::gpu_test::tolerance(dtype) * 2.0, "dense lm_head greedy");
        let ids: Vec<i64> = choice.ids.into_data().convert::<i64>().to_vec().expect("ids");
        let argmax: Vec<i64> = (0..n).map(|r| sampling::argmax(&got[r * vocab..(r + 1) * vocab]) as i64).collect();
        assert_eq!(ids, argmax, "dense lm_head greedy: ids");
        // No table: no logits, and the vocabulary size (0) as every row's id.
        let x = Tensor::<B, 2>::from_data(TensorData::new(values(2 * inp, s ^ 0xD7), [2, inp]), (device, DType::F32))
            .cast(dtype);
        let empty = B::project_greedy(x, &[], None).expect("greedy head over no table");
        assert_eq!(empty.logits.dims(), [2, 0]);
        assert_eq!(empty.ids.into_data().convert::<i64>().to_vec::<i64>().expect("ids"), vec![0, 0]);
    }

    gpu_tests!(head_greedy_matches_reference => head_greedy);
}
