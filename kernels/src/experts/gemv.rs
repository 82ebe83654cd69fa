//! Routed matrix-vector products: each token's row through the experts the router chose, the
//! expert ids read on the device ([`super::Routes`]), only the chosen experts' rows streamed.
//!
//! The grid is `(output features / ROWS, y)`: `y` is the slot (token and pick) for
//! [`ExpertProduct::GeluHalves`] and the token for [`ExpertProduct::WeightedSum`], which loops
//! over the token's `top_k` picks and adds their products times the route weights in its
//! accumulator (no per-pick output is written). Each plane of 32 units owns one output feature
//! and strides over the row as the dense and quantized GEMVs do ([`crate::linear`],
//! [`crate::quant::gemv`]: 16-byte loads, several in flight per unit, f32 sums). For
//! `GeluHalves` a cube's first four planes take four gate rows and the last four the up rows
//! at the same offset in the expert's second half, so that `gelu_tanh(gate) * up` is formed in
//! the cube from the checkpoint's own row order (no interleaving at load). Activations may be
//! in another dtype than the weights (the f32 normalized residual, say).
//!
//! [`ExpertProduct::GeluHalves`]: super::ExpertProduct::GeluHalves
//! [`ExpertProduct::WeightedSum`]: super::ExpertProduct::WeightedSum

#![allow(clippy::manual_div_ceil)]

pub(crate) mod kernel {
    use crate::cube::{empty, load_vector_size, planes_of_32, unit_index};
    use crate::experts::ExpertProduct;
    use crate::gelu::kernel::gelu_mul_f32;
    use crate::graph::{arg, launch};
    use crate::linear::kernel::{LANES, ROWS};
    use crate::quant::gemv::{block_product, unit_code, ONE_BITS};
    use crate::quant::kernel::Packed;
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Gate (and up) rows per cube for `GeluHalves`.
    const HALF: usize = ROWS / 2;
    /// Code vectors each unit loads per row before using any (the quantized kernel).
    const UNROLL: usize = 4;

    /// The stack's shape: rows per expert, and experts (ids past the last are clamped to it).
    #[derive(CubeLaunch, CubeType, Clone, Copy)]
    pub(crate) struct Routing {
        pub rows: u32,
        pub count: u32,
    }

    /// The expert-local row this plane computes (clamped into the expert, so every unit loads
    /// in range and reaches the reduction).
    #[cube]
    fn plane_row(rows: usize, #[comptime] halves: bool) -> usize {
        let local = UNIT_POS_X as usize / LANES;
        let cube = CUBE_POS_X as usize;
        if halves {
            let half = rows / 2;
            let j = min(cube * HALF + local % HALF, half - 1);
            j + (local / HALF) * half
        } else {
            min(cube * ROWS + local, rows - 1)
        }
    }

    /// Slot `pick` of this cube's `y`: `(input row, expert, route weight)`.
    #[cube]
    fn pick_of(
        ids: &Array<u32>,
        weights: &Array<f32>,
        pick: usize,
        count: usize,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
    ) -> (usize, usize, f32) {
        let y = CUBE_POS_Y as usize;
        let slot = if halves { y } else { y * top_k + pick };
        let (input, weight) = slot_input(weights, slot, top_k, halves);
        (input, min(ids[slot] as usize, count - 1), weight)
    }

    /// Sums each plane's 32 partial sums and stores them: the feature itself, or for `halves`
    /// the cube's four `gelu_tanh(gate) * up` (the totals rounded to `O` first, as a separate
    /// product would store them).
    #[cube]
    fn store_routed<O: Float>(
        acc: f32,
        out: &mut Array<O>,
        y: usize,
        rows: usize,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
    ) {
        let unit = UNIT_POS_X as usize;
        let lane = unit % LANES;
        let local = unit / LANES;
        let cube = CUBE_POS_X as usize;
        let mut partial = SharedMemory::<f32>::new(comptime!(ROWS * LANES));
        let mut totals = SharedMemory::<f32>::new(ROWS);
        let total = if plane {
            plane_sum(acc)
        } else {
            partial[unit] = acc;
            sync_cube();
            // From a builtin so the loop variable is a runtime value (CUBE_DIM_X = ROWS * LANES).
            let mut stride = CUBE_DIM_X as usize / comptime!(2 * ROWS);
            while stride > 0 {
                if lane < stride {
                    partial[unit] = partial[unit] + partial[unit + stride];
                }
                sync_cube();
                stride /= 2;
            }
            let total = partial[unit - lane];
            // The next store of a grouped kernel writes `partial` again.
            sync_cube();
            total
        };
        if halves {
            if lane == 0 {
                totals[local] = f32::cast_from(O::cast_from(total));
            }
            sync_cube();
            let half = rows / 2;
            let j = cube * HALF + unit;
            if unit < HALF && j < half {
                out[y * half + j] = O::cast_from(gelu_mul_f32(totals[unit], totals[unit + HALF]));
            }
            // The shared totals are reused by the next store of a grouped kernel.
            sync_cube();
        } else {
            let row = cube * ROWS + local;
            if lane == 0 && row < rows {
                out[y * rows + row] = O::cast_from(total);
            }
        }
    }

    /// Dense experts `w` (`[count * rows, cols]` as vectors of `N`), activations `x` in any
    /// float dtype with the same vector width.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn routed_gemv_kernel<X: Float, W: Float, O: Float, N: Size>(
        x: &Array<Vector<X, N>>,
        w: &Array<Vector<W, N>>,
        ids: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        vectors: u32,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, W, O)] _dtypes: [StorageType; 3],
    ) {
        let vectors = vectors as usize;
        let rows = routing.rows as usize;
        let row = plane_row(rows, halves);
        let picks = comptime!(if halves { 1usize } else { top_k });
        let mut acc = 0.0f32;
        #[unroll]
        for p in 0..picks {
            let (input, expert, weight) = pick_of(ids, weights, p, routing.count as usize, top_k, halves);
            acc += weight * dense_dot::<X, W, N>(x, w, (expert * rows + row) * vectors, input * vectors, vectors);
        }
        store_routed::<O>(acc, out, CUBE_POS_Y as usize, rows, halves, plane);
    }

    /// This unit's share of the dot product of weight row `w[base..]` and input row
    /// `x[xbase..]` (`vectors` vectors each), the plane's 32 units striding over them.
    #[cube]
    fn dense_dot<X: Float, W: Float, N: Size>(
        x: &Array<Vector<X, N>>,
        w: &Array<Vector<W, N>>,
        base: usize,
        xbase: usize,
        vectors: usize,
    ) -> f32 {
        let width = w.vector_size();
        let mut part = 0.0f32;
        let mut c = UNIT_POS_X as usize % LANES;
        while c < vectors {
            let wv = w[base + c];
            let xv = x[xbase + c];
            #[unroll]
            for i in 0..width {
                part += f32::cast_from(wv[i]) * f32::cast_from(xv[i]);
            }
            c += LANES;
        }
        part
    }

    /// Quantized experts (codes `[count * rows, words]` in vectors of `NW` words, one scale,
    /// and for Q4 one offset, per block), activations in vectors of `NX`; see
    /// [`crate::quant::gemv`] for the arithmetic.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn routed_qgemv_kernel<X: Float, O: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<X, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        ids: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        words: u32,
        blocks: u32,
        one: u32,
        #[comptime] top_k: usize,
        #[comptime] q4: bool,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, O, S)] _dtypes: [StorageType; 3],
    ) {
        let rows = routing.rows as usize;
        let row = plane_row(rows, halves);
        let picks = comptime!(if halves { 1usize } else { top_k });
        let mut acc = 0.0f32;
        #[unroll]
        for p in 0..picks {
            let (input, expert, weight) = pick_of(ids, weights, p, routing.count as usize, top_k, halves);
            let part = quant_dot::<X, S, NW, NX>(
                x,
                codes,
                scales,
                offsets,
                expert * rows + row,
                input,
                words,
                blocks,
                one,
                q4,
            );
            acc += weight * part;
        }
        store_routed::<O>(acc, out, CUBE_POS_Y as usize, rows, halves, plane);
    }

    /// This unit's share of the dot product of quantized weight row `grow` and input row
    /// `input`, the plane's 32 units striding over the row's code vectors (`UNROLL` loaded per
    /// unit before any is used); see [`crate::quant::gemv`] for the arithmetic.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn quant_dot<X: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<X, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        grow: usize,
        input: usize,
        words: u32,
        blocks: u32,
        one: u32,
        #[comptime] q4: bool,
    ) -> f32 {
        let per_word = comptime!(if q4 { 8usize } else { 4usize });
        let words_per_block = comptime!(32usize / per_word);
        let nw = codes.vector_size();
        let nx = x.vector_size();
        let loads = comptime!(nw * per_word / nx);
        let vectors = words as usize / nw;
        let blocks = blocks as usize;
        let k = words as usize * per_word;
        let lane = UNIT_POS_X as usize % LANES;
        let mut cw = Array::<Vector<u32, NW>>::new(UNROLL);
        let mut scale = Array::<f32>::new(UNROLL);
        let mut offset = Array::<f32>::new(UNROLL);
        let mut part = 0.0f32;
        let mut v0 = lane;
        while v0 < vectors {
            #[unroll]
            for u in 0..UNROLL {
                // Past the row's end a unit re-reads its last vector and discards it below.
                let v = min(v0 + u * LANES, vectors - 1);
                let block = (v * nw) / words_per_block;
                cw[u] = codes[grow * vectors + v];
                scale[u] = f32::cast_from(scales[grow * blocks + block]);
                if q4 {
                    offset[u] = f32::cast_from(offsets[grow * blocks + block]);
                }
            }
            #[unroll]
            for u in 0..UNROLL {
                let v = v0 + u * LANES;
                if v < vectors {
                    let mut dot = 0.0f32;
                    let mut sx = 0.0f32;
                    #[unroll]
                    for g in 0..loads {
                        let xv = x[(input * k + v * nw * per_word) / nx + g];
                        #[unroll]
                        for i in 0..nx {
                            let xi = f32::cast_from(xv[i]);
                            sx += xi;
                            let c = comptime!(g * nx + i);
                            dot += unit_code(cw[u][comptime!(c / per_word)], comptime!(c % per_word), q4, one) * xi;
                        }
                    }
                    part += block_product(dot, sx, scale[u], offset[u], q4);
                }
            }
            v0 += comptime!(UNROLL * LANES);
        }
        part
    }

    /// Slots staged in shared memory at a time by [`group_kernel`].
    const GROUP_TILE: usize = 2048;

    /// Copies slots `start..` of `ids` (at most [`GROUP_TILE`], clamped to the last expert
    /// `last`) into `tile`, every unit of the cube a share; returns how many, once all are in.
    #[cube]
    fn stage_tile(ids: &Array<u32>, tile: &mut SharedMemory<u32>, start: usize, last: u32) -> usize {
        let n = min(GROUP_TILE, ids.len() - start);
        let mut i = UNIT_POS_X as usize;
        while i < n {
            tile[i] = min(ids[start + i], last);
            i += CUBE_DIM_X as usize;
        }
        sync_cube();
        n
    }

    /// One pass over the slots, a tile at a time: each unit walks its experts' slots, moving
    /// `cursor[e]` one step per slot of expert `e` and, with `list`, writing the slot to
    /// `order` at the cursor first (a counting pass from zeros, a listing pass from the
    /// offsets).
    #[cube]
    fn walk_slots(
        ids: &Array<u32>,
        tile: &mut SharedMemory<u32>,
        cursor: &mut SharedMemory<u32>,
        order: &mut Array<u32>,
        #[comptime] count: usize,
        #[comptime] list: bool,
    ) {
        let last = (count - 1) as u32;
        let mut start = 0usize;
        while start < ids.len() {
            let n = stage_tile(ids, tile, start, last);
            let mut e = UNIT_POS_X as usize;
            while e < count {
                let mut at = cursor[e];
                for s in 0..n {
                    if tile[s] as usize == e {
                        if list {
                            order[at as usize] = (start + s) as u32;
                        }
                        at += 1;
                    }
                }
                cursor[e] = at;
                e += CUBE_DIM_X as usize;
            }
            sync_cube();
            start += GROUP_TILE;
        }
    }

    /// Groups the slots (`ids`, `[tokens * top_k]`) by expert: `offsets[e]..offsets[e + 1]` of
    /// `order` are the slots routed to expert `e`, in slot order. One cube; the ids pass through
    /// shared memory a tile at a time (every unit loads part of it), each unit counts and then
    /// lists its experts' slots from there, one unit sums the counts in between.
    #[cube(launch)]
    fn group_kernel(ids: &Array<u32>, order: &mut Array<u32>, offsets: &mut Array<u32>, #[comptime] count: usize) {
        let unit = UNIT_POS_X as usize;
        let mut cursor = SharedMemory::<u32>::new(count);
        let mut tile = SharedMemory::<u32>::new(GROUP_TILE);
        let mut e = unit;
        while e < count {
            cursor[e] = 0u32;
            e += CUBE_DIM_X as usize;
        }
        walk_slots(ids, &mut tile, &mut cursor, order, count, false);
        if unit == 0 {
            let mut total = 0u32;
            for e in 0..count {
                let n = cursor[e];
                offsets[e] = total;
                cursor[e] = total;
                total += n;
            }
            offsets[count] = total;
        }
        sync_cube();
        walk_slots(ids, &mut tile, &mut cursor, order, count, true);
    }

    /// The slots of expert `CUBE_POS_Y`, from [`group_kernel`]'s lists.
    #[cube]
    fn expert_slots(offsets: &Array<u32>) -> (usize, usize) {
        let expert = CUBE_POS_Y as usize;
        (offsets[expert] as usize, offsets[expert + 1] as usize)
    }

    /// `(input row, route weight)` of `slot` (`WeightedSum` weights applied per slot here, the
    /// sum over a token's slots by [`combine_kernel`]).
    #[cube]
    fn slot_input(
        weights: &Array<f32>,
        slot: usize,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
    ) -> (usize, f32) {
        let mut weight = 1.0f32;
        if !halves {
            weight = weights[slot];
        }
        (if halves { slot / top_k } else { slot }, weight)
    }

    /// [`routed_gemv_kernel`] grouped by expert: cube `(c, e)` reads its rows of expert `e`
    /// once from memory (then from cache) for every slot routed to `e`; writes per slot.
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn grouped_gemv_kernel<X: Float, W: Float, O: Float, N: Size>(
        x: &Array<Vector<X, N>>,
        w: &Array<Vector<W, N>>,
        order: &Array<u32>,
        offsets: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        vectors: u32,
        #[comptime] top_k: usize,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, W, O)] _dtypes: [StorageType; 3],
    ) {
        let vectors = vectors as usize;
        let rows = routing.rows as usize;
        let base = (CUBE_POS_Y as usize * rows + plane_row(rows, halves)) * vectors;
        let (start, end) = expert_slots(offsets);
        for i in start..end {
            let slot = order[i] as usize;
            let (input, weight) = slot_input(weights, slot, top_k, halves);
            let part = dense_dot::<X, W, N>(x, w, base, input * vectors, vectors);
            store_routed::<O>(weight * part, out, slot, rows, halves, plane);
        }
    }

    /// [`routed_qgemv_kernel`] grouped by expert, as [`grouped_gemv_kernel`].
    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn grouped_qgemv_kernel<X: Float, O: Float, S: Float, NW: Size, NX: Size>(
        x: &Array<Vector<X, NX>>,
        codes: &Array<Vector<u32, NW>>,
        scales: &Array<S>,
        offsets: &Array<S>,
        order: &Array<u32>,
        starts: &Array<u32>,
        weights: &Array<f32>,
        out: &mut Array<O>,
        routing: Routing,
        words: u32,
        blocks: u32,
        one: u32,
        #[comptime] top_k: usize,
        #[comptime] q4: bool,
        #[comptime] halves: bool,
        #[comptime] plane: bool,
        #[define(X, O, S)] _dtypes: [StorageType; 3],
    ) {
        let rows = routing.rows as usize;
        let grow = CUBE_POS_Y as usize * rows + plane_row(rows, halves);
        let (start, end) = expert_slots(starts);
        for i in start..end {
            let slot = order[i] as usize;
            let (input, weight) = slot_input(weights, slot, top_k, halves);
            let part = quant_dot::<X, S, NW, NX>(x, codes, scales, offsets, grow, input, words, blocks, one, q4);
            store_routed::<O>(weight * part, out, slot, rows, halves, plane);
        }
    }

    /// `out[t] = sum_k parts[t * top_k + k]` (rows of `rows`), in `O`.
    #[cube(launch)]
    fn combine_kernel<O: Float>(
        parts: &Array<f32>,
        out: &mut Array<O>,
        rows: u32,
        #[comptime] top_k: usize,
        #[define(O)] _dtype: StorageType,
    ) {
        let i = unit_index();
        if i >= out.len() {
            terminate!();
        }
        let rows = rows as usize;
        let (t, r) = (i / rows, i % rows);
        let mut sum = 0.0f32;
        #[unroll]
        for k in 0..top_k {
            sum += parts[(t * top_k + k) * rows + r];
        }
        out[i] = O::cast_from(sum);
    }

    /// The slots of `ids` (`[tokens, top_k]`, `U32`) grouped by expert: `(order, offsets)`.
    pub(crate) fn group<R: CubeRuntime>(ids: &CubeTensor<R>, count: usize) -> (CubeTensor<R>, CubeTensor<R>) {
        let slots = ids.meta.num_elements();
        let order = empty(ids, [slots.max(1)], DType::U32);
        let offsets = empty(ids, [count + 1], DType::U32);
        let units = crate::cube::pow2_ceil(count).clamp(32, 256);
        launch!(group_kernel(
            &ids.client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(units as u32),
            arg(ids),
            arg(&order),
            arg(&offsets),
            count,
        ));
        (order, offsets)
    }

    /// A product's launch: grid, output (per slot for a grouped `WeightedSum`: the weighted
    /// parts in f32, summed by [`Launch::finish`]), and the slots grouped by expert where the
    /// tokens are more than the routed kernels take.
    struct Launch<R: CubeRuntime> {
        cubes: CubeCount,
        out: CubeTensor<R>,
        halves: bool,
        top_k: usize,
        /// The output holds a grouped `WeightedSum`'s per-slot parts.
        parts: bool,
        /// `(order, offsets)` of [`group`]: the grouped kernels.
        grouped: Option<(CubeTensor<R>, CubeTensor<R>)>,
    }

    impl<R: CubeRuntime> Launch<R> {
        /// Up to [`crate::linear::GEMV_MAX_ROWS`] tokens: the routed kernels (one cube row per
        /// slot, or per token for `WeightedSum`); more: grouped by expert (one cube row per
        /// expert).
        fn new(
            x: &CubeTensor<R>,
            ids: &CubeTensor<R>,
            (count, rows): (usize, usize),
            product: ExpertProduct,
            dtype: DType,
        ) -> Self {
            let (tokens, top_k) = (ids.meta.shape()[0], ids.meta.shape()[1]);
            let halves = product == ExpertProduct::GeluHalves;
            let (width, cubes) =
                if halves { (rows / 2, (rows / 2).div_ceil(HALF)) } else { (rows, rows.div_ceil(ROWS)) };
            let grouped = tokens > crate::linear::GEMV_MAX_ROWS;
            let (y, out_rows, out_dtype) = match (grouped, halves) {
                (false, true) => (tokens * top_k, tokens * top_k, dtype),
                (false, false) => (tokens, tokens, dtype),
                (true, _) => (count, tokens * top_k, if halves { dtype } else { DType::F32 }),
            };
            Self {
                cubes: CubeCount::Static(cubes.max(1) as u32, y.max(1) as u32, 1),
                out: empty(x, [out_rows, width], out_dtype),
                halves,
                top_k,
                parts: grouped && !halves,
                grouped: (grouped && out_rows * width > 0).then(|| group(ids, count)),
            }
        }

        /// Nothing to compute.
        fn empty(&self) -> bool {
            self.out.meta.num_elements() == 0
        }

        /// The product's result: the output, or a grouped `WeightedSum`'s parts summed per token
        /// in `dtype`.
        fn finish(self, dtype: DType) -> CubeTensor<R> {
            if !self.parts {
                return self.out;
            }
            combine(self.out, self.top_k, dtype)
        }
    }

    /// A token's `top_k` weighted parts (`[tokens * top_k, rows]` f32) summed: `[tokens, rows]`
    /// in `dtype`.
    pub(crate) fn combine<R: CubeRuntime>(parts: CubeTensor<R>, top_k: usize, dtype: DType) -> CubeTensor<R> {
        let [slots, rows] = [parts.meta.shape()[0], parts.meta.shape()[1]];
        let tokens = slots / top_k.max(1);
        let out = empty(&parts, [tokens, rows], dtype);
        if tokens * rows == 0 {
            return out;
        }
        let (cubes, dim) = crate::cube::elementwise(tokens * rows, 256);
        launch!(combine_kernel(&parts.client, cubes, dim, arg(&parts), arg(&out), rows as u32, top_k, dtype.into()));
        out
    }

    /// Dense experts: `w` `[count * rows, cols]`; `x` `[tokens, cols]` (`GeluHalves`) or
    /// `[tokens * top_k, cols]` (`WeightedSum`), any float dtype; `ids`/`weights` `[tokens,
    /// top_k]` (`U32`, f32). Returns `dtype`.
    pub fn expert_gemv<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: CubeTensor<R>,
        (count, rows): (usize, usize),
        ids: CubeTensor<R>,
        weights: CubeTensor<R>,
        product: ExpertProduct,
        dtype: DType,
    ) -> CubeTensor<R> {
        let launch = Launch::new(&x, &ids, (count, rows), product, dtype);
        if launch.empty() {
            return launch.finish(dtype);
        }
        let cols = w.meta.shape()[1];
        let size = x.dtype.size().max(w.dtype.size());
        let width = load_vector_size(&x.client, size, cols, 16 / size);
        let (cube_dim, vectors) = (CubeDim::new_1d((ROWS * LANES) as u32), (cols / width) as u32);
        let (top_k, halves, plane) = (launch.top_k, launch.halves, planes_of_32(&x.client));
        let dtypes = [x.dtype.into(), w.dtype.into(), launch.out.dtype.into()];
        match &launch.grouped {
            None => launch!(routed_gemv_kernel(
                &x.client,
                launch.cubes.clone(),
                cube_dim,
                width,
                arg(&x),
                arg(&w),
                arg(&ids),
                arg(&weights),
                arg(&launch.out),
                // Built per arm: the launch argument's type is the launching runtime's.
                RoutingLaunch::new(rows as u32, count as u32),
                vectors,
                top_k,
                halves,
                plane,
                dtypes,
            )),
            Some((order, offsets)) => launch!(grouped_gemv_kernel(
                &x.client,
                launch.cubes.clone(),
                cube_dim,
                width,
                arg(&x),
                arg(&w),
                arg(order),
                arg(offsets),
                arg(&weights),
                arg(&launch.out),
                // Built per arm: the launch argument's type is the launching runtime's.
                RoutingLaunch::new(rows as u32, count as u32),
                vectors,
                top_k,
                halves,
                plane,
                dtypes,
            )),
        }
        launch.finish(dtype)
    }

    /// Quantized experts (`w` `[count * rows, cols]` packed); otherwise as [`expert_gemv`].
    pub fn expert_qgemv<R: CubeRuntime>(
        x: CubeTensor<R>,
        w: &Packed<R>,
        (count, rows): (usize, usize),
        ids: CubeTensor<R>,
        weights: CubeTensor<R>,
        product: ExpertProduct,
        dtype: DType,
    ) -> CubeTensor<R> {
        let launch = Launch::new(&x, &ids, (count, rows), product, dtype);
        if launch.empty() {
            return launch.finish(dtype);
        }
        let (codes, scales, offsets, q4) = w.args();
        let (row_words, row_blocks) = w.row_sizes();
        let (nw, nx) = w.load_vectors(&x);
        let cube_dim = CubeDim::new_1d((ROWS * LANES) as u32);
        let (top_k, halves, plane) = (launch.top_k, launch.halves, planes_of_32(&x.client));
        let dtypes = [x.dtype.into(), launch.out.dtype.into(), scales.dtype.into()];
        match &launch.grouped {
            None => launch!(routed_qgemv_kernel(
                &x.client,
                launch.cubes.clone(),
                cube_dim,
                nw,
                nx,
                arg(&x),
                arg(&codes),
                arg(&scales),
                arg(&offsets),
                arg(&ids),
                arg(&weights),
                arg(&launch.out),
                // Built per arm: the launch argument's type is the launching runtime's.
                RoutingLaunch::new(rows as u32, count as u32),
                row_words,
                row_blocks,
                ONE_BITS,
                top_k,
                q4,
                halves,
                plane,
                dtypes,
            )),
            Some((order, starts)) => launch!(grouped_qgemv_kernel(
                &x.client,
                launch.cubes.clone(),
                cube_dim,
                nw,
                nx,
                arg(&x),
                arg(&codes),
                arg(&scales),
                arg(&offsets),
                arg(order),
                arg(starts),
                arg(&weights),
                arg(&launch.out),
                // Built per arm: the launch argument's type is the launching runtime's.
                RoutingLaunch::new(rows as u32, count as u32),
                row_words,
                row_blocks,
                ONE_BITS,
                top_k,
                q4,
                halves,
                plane,
                dtypes,
            )),
        }
        launch.finish(dtype)
    }
}

#[cfg(test)]
pub(crate) mod gpu {
    use crate::experts::{project_reference, route_reference, ExpertProduct, Experts};
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{GemmaBackend, HostMatrix, HostQuantized, QuantFormat};
    use burn::tensor::{DType, Distribution, Tensor};

    /// The stacked experts of `count` matrices `[rows, cols]` in `format` (`None`: dense in
    /// `dtype`), uploaded as the backend keeps them.
    pub(crate) fn experts<B: GemmaBackend>(
        [count, rows, cols]: [usize; 3],
        format: Option<QuantFormat>,
        dtype: DType,
        device: &B::Device,
    ) -> Experts<B> {
        let w = Tensor::<B, 2>::random([count * rows, cols], Distribution::Normal(0.0, 0.05), device);
        let host = match format {
            None => HostMatrix::Dense(w.cast(dtype)),
            Some(q) => {
                let values = w.into_data().to_vec::<f32>().expect("f32");
                HostMatrix::Quantized(HostQuantized::quantize(&values, count * rows, cols, q).expect("quantize"))
            }
        };
        B::upload_experts(host, count, device).expect("upload")
    }

    /// Both products against the grouped reference (each chosen expert's dequantized matrix in
    /// one product), for 1 to 8 tokens (the routed kernels) and more (grouped by expert on the
    /// device, experts no token chose included),
    /// odd widths, dense and Q8/Q4 experts, activations in f32 and the model dtype.
    pub fn routed<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "routed experts");
        let formats = [None, Some(QuantFormat::Q8), Some(QuantFormat::Q4)];
        // (tokens, experts, top_k, 2 * m, cols, down cols)
        for (tokens, count, top_k, rows, cols) in [
            (1, 8, 2, 48, 64),
            (3, 5, 3, 22, 96),
            (8, 16, 8, 176, 256),
            (1, 128, 8, 88, 160),
            (13, 6, 2, 40, 64),
            (37, 7, 3, 22, 96),
            (70, 128, 8, 88, 160),
        ] {
            for format in formats {
                let what =
                    format!("{tokens} tokens, {count} experts top {top_k}, [{rows}, {cols}] {format:?} {dtype:?}");
                let gate_up = experts::<B>([count, rows, cols], format, dtype, device);
                let m = rows / 2;
                // The down projection's rows are `cols` wide and read `m` inputs; quantized only
                // where `m` splits into blocks.
                let down_format = format.filter(|_| m.is_multiple_of(32));
                let down = experts::<B>([count, cols, m], down_format, dtype, device);
                let scores = Tensor::<B, 2>::random([tokens, count], Distribution::Normal(0.0, 1.0), device);
                let scale = Tensor::<B, 1>::random([count], Distribution::Uniform(0.5, 1.5), device);
                let routes = route_reference(scores, scale, top_k).expect("routes");
                let x = Tensor::<B, 2>::random([tokens, cols], Distribution::Normal(0.0, 1.0), device);

                let h = B::project_experts(x.clone(), &gate_up, &routes, ExpertProduct::GeluHalves, dtype)
                    .expect("gate/up");
                let h_ref = project_reference(x, &gate_up, &routes, ExpertProduct::GeluHalves, dtype).expect("ref");
                assert_eq!(h.dtype(), dtype);
                assert_close(h.clone(), h_ref.clone(), tolerance(dtype) * 2.0, &format!("gate/up {what}"));

                // The down product from the same input on both sides.
                let y =
                    B::project_experts(h_ref.clone(), &down, &routes, ExpertProduct::WeightedSum, dtype).expect("down");
                let y_ref = project_reference(h_ref, &down, &routes, ExpertProduct::WeightedSum, dtype).expect("ref");
                assert_close(y, y_ref, tolerance(dtype) * 2.0, &format!("down {what}"));
            }
        }
    }

    gpu_tests!(routed_experts_match_reference => routed);
}
