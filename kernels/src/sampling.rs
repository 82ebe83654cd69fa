//! Choosing the next token on the device: greedy (argmax) or temperature sampling with top-k,
//! top-p and min-p, returning only token ids so the vocabulary-wide logits stay on the device.
//!
//! Filters are expressed as thresholds on the logit value, which a GPU finds without sorting:
//! - top-k keeps `x >= t_k`, the k-th largest logit;
//! - top-p keeps `x >= t_p`, the largest threshold whose kept probability mass (within the top-k
//!   set) still reaches `p`: the same set as the sorted-prefix definition;
//! - min-p keeps tokens with `exp((x - max) / T) >= min_p`.
//!
//! Ties at a threshold are all kept. The kept tokens are then sampled by inverse CDF over the
//! vocabulary in index order with a uniform number `u` drawn on the host: the same distribution
//! as sampling in probability order, so one `u` can pick a different (equally distributed) token
//! than a sorted sampler would.

/// Sampling parameters the device sampler understands.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 selects the argmax (first index on ties).
    pub temperature: f32,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
}

impl SamplingParams {
    /// Greedy decoding.
    pub const GREEDY: Self = Self { temperature: 0.0, top_k: None, top_p: None, min_p: None };
}

/// The uniform draws in [0, 1) that sampling uses, one per row (greedy reads none).
#[derive(Debug, Clone)]
pub enum Draws<'a, B: burn::tensor::backend::Backend> {
    /// Drawn on the host, uploaded with the call.
    Host(&'a [f32]),
    /// Already on the device (`[batch]`, f32): a replayed decode step, whose host rewrites
    /// the buffer before each replay.
    Device(burn::tensor::Tensor<B, 1>),
}

impl<B: burn::tensor::backend::Backend> Draws<'_, B> {
    /// The draws on the host: read back from the device for [`Draws::Device`] (which a
    /// recorded step cannot replay: recording is marked as failed).
    pub fn resolve(&self, rows: usize) -> Result<Vec<f32>, crate::ReadBackError> {
        let mut draws = match self {
            Self::Host(draws) => draws.to_vec(),
            Self::Device(t) => {
                crate::graph::unsupported(|| "an operation read the sampling draws back to the host".into());
                crate::read_back(t.clone().cast(burn::tensor::DType::F32), "the sampling draws")?
            }
        };
        draws.resize(rows, 0.0);
        Ok(draws)
    }
}

/// Index of the largest value, the first one on ties.
pub fn argmax(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, v) in values.iter().enumerate() {
        if *v > values[best] {
            best = i;
        }
    }
    best as u32
}

/// The tokens the filters keep, with their unnormalized weights `exp((x - max) / T)`, in index
/// order. Reference for the device kernel (computed by sorting, in f64 where it sums).
pub fn kept(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f64)> {
    if logits.is_empty() {
        return Vec::new();
    }
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let t = params.temperature.max(f32::MIN_POSITIVE);
    let weight = |x: f32| (((x - max) / t) as f64).exp();
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let k = params.top_k.unwrap_or(sorted.len()).clamp(1, sorted.len());
    let t_k = sorted[k - 1];
    let mut threshold = t_k;
    if let Some(p) = params.top_p {
        let top: Vec<f32> = sorted.iter().cloned().take_while(|&x| x >= t_k).collect();
        let total: f64 = top.iter().map(|&x| weight(x)).sum();
        let mut cumulative = 0.0;
        for &x in &top {
            cumulative += weight(x);
            if cumulative >= p as f64 * total {
                threshold = threshold.max(x);
                break;
            }
        }
    }
    let min_p = params.min_p.unwrap_or(0.0) as f64;
    logits
        .iter()
        .enumerate()
        .filter(|(_, &x)| x >= threshold && weight(x) >= min_p)
        .map(|(i, &x)| (i as u32, weight(x)))
        .collect()
}

/// Reference sampler: argmax when greedy, else the kept token where the cumulative weight (in
/// index order) first exceeds `u` times the total, `u` in [0, 1). Returns `logits.len()` (an
/// id outside the vocabulary) when a logit is NaN or infinite.
pub fn reference(logits: &[f32], params: &SamplingParams, u: f32) -> u32 {
    if logits.iter().any(|x| !x.is_finite()) {
        return logits.len() as u32;
    }
    if params.temperature == 0.0 {
        return argmax(logits);
    }
    let kept = kept(logits, params);
    let total: f64 = kept.iter().map(|k| k.1).sum();
    let target = u as f64 * total;
    let mut cumulative = 0.0;
    for &(id, w) in &kept {
        cumulative += w;
        if cumulative > target {
            return id;
        }
    }
    argmax(logits)
}

/// CubeCL kernel: one cube per sequence (up to 1024 units), shared-memory reductions only.
///
/// A first pass over the whole GPU finds each chunk's max, argmax, min and non-finite flag.
/// Greedy: the chunks' argmax. Sampling: the chunks' max/min, bisection passes over the
/// logit value for the top-k and top-p thresholds (each pass counts and sums the kept weights;
/// the interval stops shrinking at adjacent floats, at most `MAX_STEPS` passes per threshold),
/// then a chunked prefix sum to find the sampled index.
// Kernel code cannot call `usize::div_ceil` (not a CubeCL intrinsic).
#[allow(clippy::manual_div_ceil)]
pub(crate) mod kernel {
    use super::SamplingParams;
    use crate::cube::empty;
    use crate::graph::{arg, launch};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Units per cube: one cube streams a whole vocabulary row, so it takes as many as the
    /// device allows (up to 1024) to keep enough loads in flight.
    const MAX_THREADS: usize = 1024;
    const MAX_STEPS: u32 = 64;
    /// Logits per cube of the first pass at least, and its units.
    const CHUNK: usize = 2048;
    const CHUNK_UNITS: usize = 256;

    /// This unit's max (first index on ties), min, and whether a value is NaN or infinite,
    /// over `base + first .. base + end` in strides of the cube's units (indices from
    /// `base`).
    #[cube]
    fn scan<F: Float>(logits: &Array<F>, base: usize, first: usize, end: usize) -> (f32, u32, f32, u32) {
        let mut best = f32::new(-3.0e38);
        let mut best_at = 4_294_967_295u32;
        let mut low = f32::new(3.0e38);
        let mut bad = 0u32;
        let mut i = first + UNIT_POS_X as usize;
        while i < end {
            let x = f32::cast_from(logits[base + i]);
            if f32::is_nan(x) || f32::is_inf(x) {
                bad = 1u32;
            }
            if x > best {
                best = x;
                best_at = i as u32;
            }
            low = low.min(x);
            i += CUBE_DIM_X as usize;
        }
        (best, best_at, low, bad)
    }

    /// The units' [`scan`] results combined, to every unit.
    /// The shared arrays are allocated by the kernel itself: CUDA code generation does not
    /// declare shared memory allocated inside a helper.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    pub(crate) fn combine(
        mine: (f32, u32, f32, u32),
        values: &mut SharedMemory<f32>,
        index: &mut SharedMemory<u32>,
        lows: &mut SharedMemory<f32>,
        flags: &mut SharedMemory<u32>,
    ) -> (f32, u32, f32, u32) {
        let tid = UNIT_POS_X as usize;
        let (best, best_at, low, bad) = mine;
        values[tid] = best;
        index[tid] = best_at;
        lows[tid] = low;
        flags[tid] = bad;
        sync_cube();
        let mut stride = CUBE_DIM_X as usize / 2;
        while stride > 0 {
            if tid < stride {
                let (v, j) = (values[tid + stride], index[tid + stride]);
                if v > values[tid] || (v == values[tid] && j < index[tid]) {
                    values[tid] = v;
                    index[tid] = j;
                }
                lows[tid] = lows[tid].min(lows[tid + stride]);
                flags[tid] = flags[tid] | flags[tid + stride];
            }
            sync_cube();
            stride /= 2;
        }
        let result = (values[0], index[0], lows[0], flags[0]);
        sync_cube();
        result
    }

    /// First pass over the logits, spread over the GPU: cube `(c, row)` writes the [`scan`] of
    /// chunk `c` of the row (`chunk` logits) to `stats` (max, min) and `marks` (argmax, flag),
    /// `[batch, chunks, 2]` each; the sampling kernel combines the chunks.
    #[cube(launch)]
    fn chunk_stats_kernel<F: Float>(
        logits: &Array<F>,
        stats: &mut Array<f32>,
        marks: &mut Array<u32>,
        vocab: u32,
        chunk: u32,
        #[comptime] threads: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let c = CUBE_POS_X as usize;
        let row = CUBE_POS_Y as usize;
        let n = vocab as usize;
        let first = min(c * chunk as usize, n);
        let end = min(first + chunk as usize, n);
        let mut values = SharedMemory::<f32>::new(threads);
        let mut index = SharedMemory::<u32>::new(threads);
        let mut lows = SharedMemory::<f32>::new(threads);
        let mut flags = SharedMemory::<u32>::new(threads);
        let mine = scan::<F>(logits, row * n, first, end);
        let (best, best_at, low, bad) = combine(mine, &mut values, &mut index, &mut lows, &mut flags);
        if UNIT_POS_X == 0 {
            let at = (row * CUBE_COUNT_X as usize + c) * 2;
            stats[at] = best;
            stats[at + 1] = low;
            marks[at] = best_at;
            marks[at + 1] = bad;
        }
    }

    /// Number of logits `>= tau` and their summed weights (only those also `>= floor`).
    #[cube]
    fn count_mass<F: Float>(
        logits: &Array<F>,
        base: usize,
        n: usize,
        tau: f32,
        max: f32,
        inv_t: f32,
        scratch: &mut SharedMemory<f32>,
        #[comptime] threads: usize,
        #[comptime] with_mass: bool,
    ) -> (f32, f32) {
        let mut count = 0.0f32;
        let mut mass = 0.0f32;
        let mut i = UNIT_POS_X as usize;
        while i < n {
            let x = f32::cast_from(logits[base + i]);
            if x >= tau {
                count += 1.0f32;
                if with_mass {
                    mass += f32::exp((x - max) * inv_t);
                }
            }
            i += threads;
        }
        let count = crate::cube::cube_sum(count, scratch);
        if with_mass {
            mass = crate::cube::cube_sum(mass, scratch);
        }
        (count, mass)
    }

    /// Weight `exp((x - max) / T)` of a token the filters keep, -1 for one they drop.
    #[cube]
    fn kept_weight(x: f32, max: f32, inv_t: f32, tau: f32, min_p: f32) -> f32 {
        let w = f32::exp((x - max) * inv_t);
        let mut kept = f32::new(-1.0);
        if x >= tau && w >= min_p {
            kept = w;
        }
        kept
    }

    /// Bisection for the largest threshold whose kept count (or mass, `by_mass`) still reaches
    /// `target`: `low` reaches it, `high` does not; stops at adjacent floats or `MAX_STEPS`.
    #[allow(clippy::too_many_arguments)]
    #[cube]
    fn bisect<F: Float>(
        logits: &Array<F>,
        base: usize,
        n: usize,
        low: f32,
        high: f32,
        target: f32,
        max: f32,
        inv_t: f32,
        scratch: &mut SharedMemory<f32>,
        #[comptime] threads: usize,
        #[comptime] by_mass: bool,
    ) -> f32 {
        let mut lo = low;
        let mut hi = high;
        let mut steps = 0u32;
        let mut mid = lo + (hi - lo) * 0.5f32;
        while steps < MAX_STEPS && mid > lo && mid < hi {
            let (count, mass) = count_mass::<F>(logits, base, n, mid, max, inv_t, scratch, threads, by_mass);
            let mut value = count;
            if by_mass {
                value = mass;
            }
            if value >= target {
                lo = mid;
            } else {
                hi = mid;
            }
            mid = lo + (hi - lo) * 0.5f32;
            steps += 1;
        }
        lo
    }

    #[allow(clippy::too_many_arguments)]
    #[cube(launch)]
    fn sample_kernel<F: Float, I: Int>(
        logits: &Array<F>,
        stats: &Array<f32>,
        marks: &Array<u32>,
        chunks: u32,
        uniform: &Array<f32>,
        out: &mut Array<I>,
        vocab: u32,
        inv_t: f32,
        top_k: u32,
        top_p: f32,
        min_p: f32,
        #[comptime] greedy: bool,
        #[comptime] threads: usize,
        #[define(F, I)] _dtypes: [StorageType; 2],
    ) {
        let row = CUBE_POS_X as usize;
        let n = vocab as usize;
        let base = row * n;
        let tid = UNIT_POS_X as usize;
        let mut values = SharedMemory::<f32>::new(threads);
        let mut index = SharedMemory::<u32>::new(threads);
        let mut lows = SharedMemory::<f32>::new(threads);
        let mut flags = SharedMemory::<u32>::new(threads);
        // The row's max (first index on ties), min and non-finite flag, from its chunks.
        let mut mine = (f32::new(-3.0e38), 4_294_967_295u32, f32::new(3.0e38), 0u32);
        if tid < chunks as usize {
            let at = (row * chunks as usize + tid) * 2;
            mine = (stats[at], marks[at], stats[at + 1], marks[at + 1]);
        }
        let (max, first_max, lowest, bad) = combine(mine, &mut values, &mut index, &mut lows, &mut flags);
        // No logit above -3e38: `vocab`, as for a non-finite row.
        let max_at = min(first_max, vocab);
        // The reduction buffers are free again: reused as scratch and per-unit sums (CUDA code
        // generation left shared arrays first touched after the early exits undeclared).
        let scratch = &mut values;
        let sums = &mut lows;
        if bad != 0u32 {
            if tid == 0 {
                out[row] = I::cast_from(vocab);
            }
            terminate!();
        }
        if greedy {
            if tid == 0 {
                out[row] = I::cast_from(max_at);
            }
            terminate!();
        }

        // Top-k threshold: the largest tau with count(x >= tau) >= k.
        let mut t_k = lowest;
        let (count_at_max, _m) = count_mass::<F>(logits, base, n, max, max, inv_t, scratch, threads, false);
        if count_at_max >= f32::cast_from(top_k) {
            t_k = max;
        } else if top_k < vocab {
            t_k = bisect::<F>(logits, base, n, lowest, max, f32::cast_from(top_k), max, inv_t, scratch, threads, false);
        }

        // Top-p threshold inside the top-k set: the largest tau whose mass reaches p of it.
        let mut tau = t_k;
        if top_p < 1.0f32 {
            let (_count, total) = count_mass::<F>(logits, base, n, t_k, max, inv_t, scratch, threads, true);
            let target = top_p * total;
            let (_c, mass_at_max) = count_mass::<F>(logits, base, n, max, max, inv_t, scratch, threads, true);
            if mass_at_max >= target {
                tau = max;
            } else {
                tau = bisect::<F>(logits, base, n, t_k, max, target, max, inv_t, scratch, threads, true);
            }
        }

        // Inverse CDF in index order: each unit owns a contiguous chunk.
        let chunk = (n + threads - 1) / threads;
        let start = min(tid * chunk, n);
        let end = min(start + chunk, n);
        let mut mass = 0.0f32;
        for i in start..end {
            mass += kept_weight(f32::cast_from(logits[base + i]), max, inv_t, tau, min_p).max(0.0f32);
        }
        sums[tid] = mass;
        sync_cube();
        if tid == 0 {
            let mut total = 0.0f32;
            for t in 0..threads {
                total += sums[t];
            }
            let target = uniform[row] * total;
            let mut acc = 0.0f32;
            let mut chosen = max_at;
            let mut found = false;
            let mut t = 0usize;
            while t < threads && !found {
                let s = sums[t];
                if acc + s > target && s > 0.0f32 {
                    // The target falls in this chunk. `chosen` follows the kept tokens, so if
                    // rounding leaves the target past the chunk's end, its last kept token wins.
                    let c0 = min(t * chunk, n);
                    let c1 = min(c0 + chunk, n);
                    let mut i = c0;
                    while i < c1 && !found {
                        let w = kept_weight(f32::cast_from(logits[base + i]), max, inv_t, tau, min_p);
                        if w >= 0.0f32 {
                            chosen = i as u32;
                            acc += w;
                            found = acc > target;
                        }
                        i += 1;
                    }
                    found = true;
                } else {
                    acc += s;
                }
                t += 1;
            }
            out[row] = I::cast_from(chosen);
        }
    }

    /// `logits`: contiguous `[batch, vocab]` in any float dtype (compared and weighed in f32);
    /// `uniform`: f32 `[batch]` in [0, 1).
    /// Returns `[batch]` token ids in `int_dtype`.
    pub fn sample<R: CubeRuntime>(
        logits: CubeTensor<R>,
        uniform: CubeTensor<R>,
        params: &SamplingParams,
        int_dtype: DType,
    ) -> CubeTensor<R> {
        let [batch, vocab] = [logits.meta.shape()[0], logits.meta.shape()[1]];
        let out = empty(&logits, [batch], int_dtype);
        if batch == 0 || vocab == 0 {
            return out;
        }
        let greedy = params.temperature == 0.0;
        let limit = logits.client.properties().hardware.max_units_per_cube as usize;
        let threads = crate::cube::pow2_floor(limit.min(MAX_THREADS));
        let top_k = params.top_k.unwrap_or(vocab).clamp(1, vocab);
        // The first pass in chunks of at least `CHUNK` logits, at most one per unit of the
        // sampling kernel.
        let chunks = vocab.div_ceil(CHUNK).clamp(1, threads);
        let chunk = vocab.div_ceil(chunks);
        let stats = empty(&logits, [batch * chunks * 2], DType::F32);
        let marks = empty(&logits, [batch * chunks * 2], DType::U32);
        launch!(chunk_stats_kernel(
            &logits.client,
            CubeCount::Static(chunks as u32, batch as u32, 1),
            CubeDim::new_1d(CHUNK_UNITS as u32),
            arg(&logits),
            arg(&stats),
            arg(&marks),
            vocab as u32,
            chunk as u32,
            CHUNK_UNITS,
            logits.dtype.into(),
        ));
        launch!(sample_kernel(
            &logits.client,
            CubeCount::Static(batch as u32, 1, 1),
            CubeDim::new_1d(threads as u32),
            arg(&logits),
            arg(&stats),
            arg(&marks),
            chunks as u32,
            arg(&uniform),
            arg(&out),
            vocab as u32,
            1.0 / params.temperature.max(f32::MIN_POSITIVE),
            top_k as u32,
            params.top_p.unwrap_or(1.0),
            params.min_p.unwrap_or(0.0),
            greedy,
            threads,
            [logits.dtype.into(), int_dtype.into()],
        ));
        out
    }
}

#[cfg(test)]
mod gpu {
    use super::{Draws, SamplingParams};
    use crate::gpu_test::seed;
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor};

    /// Uniform numbers far enough (relative 1e-4) from every CDF boundary of the reference that
    /// f32 summation order cannot move them across one.
    fn safe_uniforms(logits: &[f32], params: &SamplingParams, state: &mut u64) -> Vec<f32> {
        let kept = super::kept(logits, params);
        let total: f64 = kept.iter().map(|k| k.1).sum();
        let mut bounds = vec![0.0];
        let mut acc = 0.0;
        for k in &kept {
            acc += k.1;
            bounds.push(acc / total);
        }
        let mut out = Vec::new();
        while out.len() < 8 {
            *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let u = ((*state >> 40) as f64) / (1u64 << 24) as f64;
            if bounds.iter().all(|b| (b - u).abs() > 1e-4) {
                out.push(u as f32);
            }
        }
        out
    }

    /// Greedy and filtered sampling on odd vocabularies (and the real 262,144), batch 2, checked
    /// token for token against the reference.
    pub fn sample<B: GemmaBackend>(device: &B::Device, _dtype: DType) {
        let mut state = seed::<B>(device, "sample");
        let configs = [
            SamplingParams::GREEDY,
            SamplingParams { temperature: 1.0, top_k: None, top_p: None, min_p: None },
            SamplingParams { temperature: 0.7, top_k: Some(40), top_p: Some(0.9), min_p: None },
            SamplingParams { temperature: 1.3, top_k: Some(1), top_p: None, min_p: None },
            SamplingParams { temperature: 0.8, top_k: None, top_p: Some(0.5), min_p: Some(0.05) },
            SamplingParams { temperature: 2.0, top_k: Some(300), top_p: None, min_p: Some(0.2) },
        ];
        for vocab in [1, 7, 1001, 262_144] {
            let logits = Tensor::<B, 2>::random([2, vocab], Distribution::Normal(0.0, 3.0), device).cast(DType::F32);
            let rows: Vec<Vec<f32>> = (0..2)
                .map(|r| logits.clone().slice([r..r + 1, 0..vocab]).into_data().to_vec::<f32>().expect("f32"))
                .collect();
            assert!(rows.iter().flatten().all(|x| x.is_finite()));
            for params in &configs {
                let draws: Vec<Vec<f32>> = rows.iter().map(|r| safe_uniforms(r, params, &mut state)).collect();
                for (&first, &second) in draws[0].iter().zip(&draws[1]).take(8) {
                    let uniform = [first, second];
                    let got = B::sample(logits.clone(), params, Draws::Host(&uniform)).expect("sampled");
                    // The same draws read from a device buffer (a replayed decode step).
                    let on_device = Tensor::<B, 1>::from_data(uniform, (device, DType::F32));
                    let again = B::sample(logits.clone(), params, Draws::Device(on_device)).expect("sampled");
                    assert_eq!(
                        got.clone().into_data().convert::<i64>().to_vec::<i64>().expect("ids"),
                        again.into_data().convert::<i64>().to_vec::<i64>().expect("ids"),
                        "draws on the device, vocab {vocab}, {params:?}"
                    );
                    let got: Vec<i64> = got.into_data().convert::<i64>().to_vec().expect("ids");
                    let expected: Vec<i64> =
                        (0..2).map(|r| super::reference(&rows[r], params, uniform[r]) as i64).collect();
                    assert_eq!(got, expected, "vocab {vocab}, {params:?}, u {uniform:?}");
                }
            }
        }
    }

    /// A NaN or infinite logit yields the out-of-vocabulary id `vocab`, greedy or not.
    pub fn sample_non_finite<B: GemmaBackend>(device: &B::Device, _dtype: DType) {
        seed::<B>(device, "sample_non_finite");
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut values = vec![0.5f32; 2 * 513];
            values[513 + 77] = bad;
            let logits =
                Tensor::<B, 2>::from_data(burn::tensor::TensorData::new(values, [2, 513]), (device, DType::F32));
            for params in
                [SamplingParams::GREEDY, SamplingParams { temperature: 1.0, top_k: Some(5), top_p: None, min_p: None }]
            {
                let got: Vec<i64> = B::sample(logits.clone(), &params, Draws::Host(&[0.3, 0.3]))
                    .expect("sampled")
                    .into_data()
                    .convert::<i64>()
                    .to_vec()
                    .expect("ids");
                // Row 0 is finite (all ties: every token is kept); row 1 is flagged.
                let row0 = super::reference(&[0.5f32; 513], &params, 0.3) as i64;
                assert_eq!(got, vec![row0, 513], "{bad} with {params:?}");
            }
        }
    }

    gpu_tests!(sample_matches_reference => sample, sample_non_finite_is_flagged => sample_non_finite);
}
