//! Prompt products on the CPU as int8 tiles: activations quantized once per product to 8-bit
//! codes per block of 32 values, the weight blocks unpacked to 8-bit codes a panel of rows at a
//! time, and tiles of 4 activation rows times 4 weight rows multiplied with AVX-512 VNNI's
//! `vpdpbusd` (64 byte products summed into 16 32-bit lanes in one instruction), each block's
//! integer lane sums scaled by both blocks' scales into f32 accumulators (and, for the types
//! with an offset, their minimums times the activations' block sums subtracted in the same loop). Each task writes its
//! columns of the row-major output directly: a transposition afterwards, and the minimums in a
//! separate pass, cost the real 270M's 512-token prompts 351-370 against 397-399 tok/s.
//!
//! Why our own: candle has no tiled integer product (its quantized matmul is one dot product
//! per pair of rows, which ran the real 270M's prompts at 187-224 tok/s on this repository's
//! 2-core AMD EPYC against 312-335 for the f32 GEMM) and the `gemm` crate multiplies floats
//! only. An AVX2 version of these tiles (`vpmaddubsw` / `vpmaddwd`, 2 x 4 tiles) was written
//! first and measured slower than the f32 GEMM with AVX-512 on that CPU (pp512 223-228 against
//! 287-321 tok/s): seven instructions per 32 products against VNNI's five per 64. So CPUs
//! without VNNI keep the f32 path, and the scalar kernel here is the reference the VNNI one is
//! tested against.
//!
//! # The unpacked form
//! Every block type but Q2_K and Q3_K becomes, per 32 weights: 32 signed codes, an f32 scale,
//! for Q6_K two integer sub-scales (one per 16 values), and for the types with an offset an f32
//! minimum, so that weight `t` of block `b` is
//! `scale[b] * sub[b][t / 16] * code[b][t] - min[b]` exactly as candle dequantizes it:
//!
//! | type | code | scale | sub-scales | minimum |
//! | --- | --- | --- | --- | --- |
//! | Q8_0 | its `i8` | `d` | 1, 1 | |
//! | Q4_0 | nibble - 8 | `d` | 1, 1 | |
//! | Q5_0 | (nibble \| fifth bit << 4) - 16 | `d` | 1, 1 | |
//! | Q4_1 / Q5_1 | nibble (with the fifth bit for Q5_1) | `d` | 1, 1 | `-m` |
//! | Q4_K / Q5_K | nibble (with the fifth bit for Q5_K) | `d * sc` of its sub-block | 1, 1 | `dmin * m` |
//! | Q6_K | 6 bits - 32 | `d` | its two `i8` scales | |
//!
//! With activations `x[t] = xs * xq[t]`, a block pair contributes
//! `scale * xs * sum_t(code[t] * sub[t / 16] * xq[t]) - min * xs * sum_t(xq[t])`; the integer sum
//! is exact (at most 4 * 32 * 127 * 127 per 32-bit lane), the rest is f32.
//!
//! Accuracy: quantizing the activations to 8 bits per 32 values (llama.cpp's CPU path quantizes
//! them likewise, per 32 for Q5_0/Q8_0 and per 256 for the k-quants) moves a product by a small
//! fraction of its magnitude. On the real 270M's fixture (941 positions, `accuracy --mode
//! prefill`), against the f32 model dequantized from the same file: top-1 99.15%, mean KL
//! 9.2e-4 (decode's block dot products, which quantize per 32 or 256: 98.62%, 1.7e-3).

use super::{f16_at, q4k_scale_min};
use rayon::prelude::*;

/// Values per block of the unpacked form (and of the quantized activations).
pub const BLOCK: usize = 32;

/// The block types this product unpacks (the others run in f32, `super::product`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q4K,
    Q5K,
    Q6K,
}

impl Layout {
    /// The layout of a GGUF block type, if this product handles it.
    pub fn of(dtype: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as T;
        match dtype {
            T::Q4_0 => Some(Self::Q4_0),
            T::Q4_1 => Some(Self::Q4_1),
            T::Q5_0 => Some(Self::Q5_0),
            T::Q5_1 => Some(Self::Q5_1),
            T::Q8_0 => Some(Self::Q8_0),
            T::Q4K => Some(Self::Q4K),
            T::Q5K => Some(Self::Q5K),
            T::Q6K => Some(Self::Q6K),
            _ => None,
        }
    }

    /// Weights per stored block, and its bytes.
    fn block(self) -> (usize, usize) {
        match self {
            Self::Q4_0 => (32, 18),
            Self::Q4_1 => (32, 20),
            Self::Q5_0 => (32, 22),
            Self::Q5_1 => (32, 24),
            Self::Q8_0 => (32, 34),
            Self::Q4K => (256, 144),
            Self::Q5K => (256, 176),
            Self::Q6K => (256, 210),
        }
    }

    fn has_subs(self) -> bool {
        self == Self::Q6K
    }

    fn has_mins(self) -> bool {
        matches!(self, Self::Q4_1 | Self::Q5_1 | Self::Q4K | Self::Q5K)
    }

    /// Bytes of one `cols`-wide row of stored blocks.
    pub fn row_bytes(self, cols: usize) -> usize {
        let (values, bytes) = self.block();
        cols / values * bytes
    }

    /// Unpacks one row of stored blocks (`cols` weights) into `row`'s slots.
    fn unpack(self, stored: &[u8], row: RowMut<'_>) {
        let (values, bytes) = self.block();
        let per = values / BLOCK;
        for (s, block) in stored.chunks_exact(bytes).enumerate() {
            let (b0, b1) = (s * per, (s + 1) * per);
            let codes = &mut row.codes[b0 * BLOCK..b1 * BLOCK];
            let scales = &mut row.scales[b0..b1];
            match self {
                Self::Q8_0 => {
                    scales[0] = f16_at(block, 0);
                    for (c, &q) in codes.iter_mut().zip(&block[2..34]) {
                        *c = q as i8;
                    }
                }
                Self::Q4_0 => {
                    scales[0] = f16_at(block, 0);
                    let (lo, hi) = codes.split_at_mut(16);
                    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&block[2..18]) {
                        *l = (q & 15) as i8 - 8;
                        *h = (q >> 4) as i8 - 8;
                    }
                }
                Self::Q4_1 => {
                    // `d * code + m`: the minimum is `-m`.
                    scales[0] = f16_at(block, 0);
                    row.mins[b0] = -f16_at(block, 2);
                    let (lo, hi) = codes.split_at_mut(16);
                    for ((l, h), &q) in lo.iter_mut().zip(hi).zip(&block[4..20]) {
                        *l = (q & 15) as i8;
                        *h = (q >> 4) as i8;
                    }
                }
                Self::Q5_1 => {
                    scales[0] = f16_at(block, 0);
                    row.mins[b0] = -f16_at(block, 2);
                    let high = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
                    let (lo, hi) = codes.split_at_mut(16);
                    for (j, ((l, h), &q)) in lo.iter_mut().zip(hi).zip(&block[8..24]).enumerate() {
                        *l = ((q & 15) as u32 | ((high >> j) & 1) << 4) as i8;
                        *h = ((q >> 4) as u32 | ((high >> (j + 16)) & 1) << 4) as i8;
                    }
                }
                Self::Q5_0 => {
                    scales[0] = f16_at(block, 0);
                    for (c, q) in codes.iter_mut().zip(super::q5_0::codes(block)) {
                        *c = q as i8;
                    }
                }
                Self::Q4K | Self::Q5K => {
                    let (d, dmin) = (f16_at(block, 0), f16_at(block, 2));
                    let packed = &block[4..16];
                    // Q5_K's fifth bits: 32 bytes between the scales and the nibbles.
                    let (high, qs) = if self == Self::Q5K {
                        (Some(&block[16..48]), &block[48..176])
                    } else {
                        (None, &block[16..144])
                    };
                    let mins = &mut row.mins[b0..b1];
                    for j in 0..4 {
                        let (sc1, m1) = q4k_scale_min(2 * j, packed);
                        let (sc2, m2) = q4k_scale_min(2 * j + 1, packed);
                        scales[2 * j] = d * sc1 as f32;
                        mins[2 * j] = dmin * m1 as f32;
                        scales[2 * j + 1] = d * sc2 as f32;
                        mins[2 * j + 1] = dmin * m2 as f32;
                        let q = &qs[32 * j..32 * j + 32];
                        let (lo, hi) = codes[64 * j..64 * j + 64].split_at_mut(32);
                        for (t, ((l, h), &q)) in lo.iter_mut().zip(hi).zip(q).enumerate() {
                            let bits = high.map_or(0, |h| h[t]);
                            *l = ((q & 15) | ((bits >> (2 * j)) & 1) << 4) as i8;
                            *h = ((q >> 4) | ((bits >> (2 * j + 1)) & 1) << 4) as i8;
                        }
                    }
                }
                Self::Q6K => {
                    let d = f16_at(block, 208);
                    let subs = &mut row.subs[b0..b1];
                    for half in 0..2 {
                        let ql = &block[64 * half..64 * half + 64];
                        let qh = &block[128 + 32 * half..128 + 32 * half + 32];
                        let sc = &block[192 + 8 * half..192 + 8 * half + 8];
                        for g in 0..4 {
                            let b = 4 * half + g;
                            scales[b] = d;
                            subs[b] = [sc[2 * g] as i8, sc[2 * g + 1] as i8];
                            for l in 0..32 {
                                let (low, high) = match g {
                                    0 => (ql[l] & 15, qh[l] & 3),
                                    1 => (ql[l + 32] & 15, (qh[l] >> 2) & 3),
                                    2 => (ql[l] >> 4, (qh[l] >> 4) & 3),
                                    _ => (ql[l + 32] >> 4, (qh[l] >> 6) & 3),
                                };
                                codes[b * BLOCK + l] = (low | high << 4) as i8 - 32;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Activation rows quantized per block of 32: `x[i][t] = scales[i][t / 32] * codes[i][t]`.
#[derive(Debug, Clone)]
pub struct QuantizedRows {
    m: usize,
    k: usize,
    codes: Vec<i8>,
    scales: Vec<f32>,
    /// `scales * sum(codes)` per block: what a weight's minimum multiplies.
    sums: Vec<f32>,
}

impl QuantizedRows {
    /// `x` (`[m, k]` row-major, `k` a multiple of 32) quantized: each block's scale is its
    /// largest magnitude over 127, its codes the values over it rounded to nearest.
    pub fn new(x: &[f32], k: usize) -> Self {
        let m = x.len() / k.max(1);
        let kb = k / BLOCK;
        let mut codes = vec![0i8; m * k];
        let mut scales = vec![0.0f32; m * kb];
        let mut sums = vec![0.0f32; m * kb];
        // Rows in parallel, each block by itself.
        codes
            .par_chunks_mut(k.max(1))
            .zip(scales.par_chunks_mut(kb.max(1)).zip(sums.par_chunks_mut(kb.max(1))))
            .zip(x.par_chunks(k.max(1)))
            .for_each(|((codes, (scales, sums)), x)| {
                for (((c, s), sum), x) in
                    codes.chunks_exact_mut(BLOCK).zip(scales.iter_mut()).zip(sums.iter_mut()).zip(x.chunks_exact(BLOCK))
                {
                    let largest = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                    let scale = largest / 127.0;
                    let inverse = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    let mut total = 0i32;
                    for (c, &v) in c.iter_mut().zip(x) {
                        let q = (v * inverse).round().clamp(-127.0, 127.0) as i8;
                        *c = q;
                        total += q as i32;
                    }
                    *s = scale;
                    *sum = scale * total as f32;
                }
            });
        Self { m, k, codes, scales, sums }
    }
}

/// A panel of weight rows in the unpacked form.
#[derive(Debug, Clone, Default)]
struct Panel {
    rows: usize,
    codes: Vec<i8>,
    scales: Vec<f32>,
    /// Q6_K's two sub-scales of each block (values 0..16 and 16..32).
    subs: Vec<[i8; 2]>,
    mins: Vec<f32>,
    /// The VNNI kernel's per-lane scales and offsets ([`Panel::fill_lanes`]).
    lane_scales: Vec<[f32; 8]>,
    lane_offsets: Vec<[i32; 8]>,
    lane_mins: Vec<[f32; 8]>,
}

/// One row's slots of a [`Panel`].
struct RowMut<'a> {
    codes: &'a mut [i8],
    scales: &'a mut [f32],
    subs: &'a mut [[i8; 2]],
    mins: &'a mut [f32],
}

impl Panel {
    /// `stored` (whole rows of `layout`'s blocks, `k` weights each) unpacked, reusing the buffers.
    fn fill(&mut self, layout: Layout, stored: &[u8], k: usize) {
        let kb = k / BLOCK;
        let row_bytes = layout.row_bytes(k);
        self.rows = stored.len() / row_bytes.max(1);
        self.codes.resize(self.rows * k, 0);
        self.scales.resize(self.rows * kb, 0.0);
        self.subs.resize(if layout.has_subs() { self.rows * kb } else { 0 }, [1; 2]);
        self.mins.resize(if layout.has_mins() { self.rows * kb } else { 0 }, 0.0);
        for r in 0..self.rows {
            let (s, c) = (r * kb..(r + 1) * kb, r * k..(r + 1) * k);
            let row = RowMut {
                codes: &mut self.codes[c],
                scales: &mut self.scales[s.clone()],
                subs: if layout.has_subs() { &mut self.subs[s.clone()] } else { &mut [] },
                mins: if layout.has_mins() { &mut self.mins[s] } else { &mut [] },
            };
            layout.unpack(&stored[r * row_bytes..(r + 1) * row_bytes], row);
        }
    }
}

/// Which multiply runs the tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust, one block pair at a time: the reference, and what other CPUs would run.
    Scalar,
    /// AVX-512 with VNNI's `vpdpbusd` (x86-64 with AVX512F, AVX512BW and AVX512-VNNI, checked at
    /// run time: Intel since Ice Lake, AMD since Zen 4).
    Avx512Vnni,
}

impl Kernel {
    /// The fastest this CPU runs.
    pub fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512vnni")
        {
            return Self::Avx512Vnni;
        }
        Self::Scalar
    }
}

/// Weight rows a task unpacks and multiplies: about 64 KiB of codes (192 KiB with the per-lane
/// scales and offsets the VNNI kernel reads beside them: the panel stays in the core's L2 cache
/// while every activation row passes it), a multiple of [`NR`], at least [`NR`]. Each panel
/// reads all the activations once, so larger panels read them fewer times: on the real 270M's
/// 512-token prompts (2 threads, this repository's AMD EPYC), 8 KiB panels ran at 345 tok/s.
fn panel_rows(k: usize) -> usize {
    ((65_536 / k.max(1)) / NR * NR).clamp(NR, 64)
}

/// `x @ w^T -> [m, n]` row-major, for `[n, k]` weights stored as `layout`'s blocks in `stored`
/// (row-major, as the file holds them) and activations already quantized.
pub fn product(x: &QuantizedRows, stored: &[u8], layout: Layout, n: usize, kernel: Kernel) -> Vec<f32> {
    let (m, k) = (x.m, x.k);
    let row_bytes = layout.row_bytes(k);
    let rows = panel_rows(k);
    let mut out = vec![0.0f32; m * n];
    let output = Output { values: out.as_mut_ptr(), m, n };
    stored.par_chunks(rows * row_bytes).enumerate().for_each_init(Panel::default, |panel, (p, stored)| {
        panel.fill(layout, stored, k);
        if kernel == Kernel::Avx512Vnni {
            panel.fill_lanes(k);
        }
        // SAFETY: panel `p` writes only its own columns, `p * rows..p * rows + panel.rows`, so
        // no two tasks write one value; `out` outlives the iteration and is not read during it.
        unsafe { multiply_panel(x, panel, kernel, &output, p * rows) };
    });
    out
}

/// The row-major `[m, n]` output, written by tasks that each own a range of its columns (so a
/// tile's values go straight to their rows, with no transposition afterwards).
struct Output {
    values: *mut f32,
    m: usize,
    n: usize,
}

// SAFETY: `Output` is shared by the tasks of one `product`, each writing a column range of its
// own (see there); the pointer's allocation outlives them.
unsafe impl Send for Output {}
unsafe impl Sync for Output {}

impl Output {
    /// Writes value `(i, j)`.
    ///
    /// # Safety
    /// No other thread may read or write `(i, j)` meanwhile.
    unsafe fn write(&self, i: usize, j: usize, v: f32) {
        assert!(i < self.m && j < self.n, "({i}, {j}) outside [{}, {}]", self.m, self.n);
        self.values.add(i * self.n + j).write(v);
    }
}

/// Activation rows per tile, and weight rows (the VNNI kernel's 16 accumulators of 16 lanes).
const MR: usize = 4;
const NR: usize = 4;

/// Every activation row times the panel's rows into their columns of `out`, from `first`.
///
/// # Safety
/// No other thread may touch columns `first..first + panel.rows` of `out` meanwhile.
unsafe fn multiply_panel(x: &QuantizedRows, panel: &Panel, kernel: Kernel, out: &Output, first: usize) {
    let m = x.m;
    for r0 in (0..panel.rows).step_by(NR) {
        let nr = NR.min(panel.rows - r0);
        for i0 in (0..m).step_by(MR) {
            let mr = MR.min(m - i0);
            let mut tile = [[0.0f32; MR]; NR];
            match kernel {
                Kernel::Scalar => scalar_tile(x, panel, i0..i0 + mr, r0..r0 + nr, &mut tile),
                #[cfg(target_arch = "x86_64")]
                Kernel::Avx512Vnni => vnni::tile(x, panel, (i0, mr), (r0, nr), &mut tile),
                #[cfg(not(target_arch = "x86_64"))]
                Kernel::Avx512Vnni => scalar_tile(x, panel, i0..i0 + mr, r0..r0 + nr, &mut tile),
            }
            for i in 0..mr {
                for (r, row) in tile.iter().enumerate().take(nr) {
                    out.write(i0 + i, first + r0 + r, row[i]);
                }
            }
        }
    }
}

/// The reference tile: each block pair's exact integer sum scaled by both scales, less the
/// weight's minimum times the activations' block sum, summed in block order.
fn scalar_tile(
    x: &QuantizedRows,
    panel: &Panel,
    is: std::ops::Range<usize>,
    rs: std::ops::Range<usize>,
    tile: &mut [[f32; MR]; NR],
) {
    let (k, kb) = (x.k, x.k / BLOCK);
    for (r, w) in rs.enumerate() {
        for (i, a) in is.clone().enumerate() {
            let mut acc = 0.0f32;
            for b in 0..kb {
                let wc = &panel.codes[w * k + b * BLOCK..w * k + (b + 1) * BLOCK];
                let xc = &x.codes[a * k + b * BLOCK..a * k + (b + 1) * BLOCK];
                let sub = panel.subs.get(w * kb + b);
                let sum: i32 = wc
                    .iter()
                    .zip(xc)
                    .enumerate()
                    .map(|(t, (&p, &q))| p as i32 * q as i32 * sub.map_or(1, |s| s[t / 16] as i32))
                    .sum();
                acc += panel.scales[w * kb + b] * x.scales[a * kb + b] * sum as f32;
                if let Some(min) = panel.mins.get(w * kb + b) {
                    acc -= min * x.sums[a * kb + b];
                }
            }
            tile[r][i] = acc;
        }
    }
}

impl Panel {
    /// What the VNNI kernel reads beside each block's codes, per 32-bit lane (4 weights): the
    /// weight's scale times its sub-scale, and `-128` times the lane's codes, which cancels the
    /// 128 the kernel adds to the activation codes to make them unsigned (`vpdpbusd` multiplies
    /// unsigned bytes by signed ones).
    fn fill_lanes(&mut self, k: usize) {
        let kb = k / BLOCK;
        let blocks = self.rows * kb;
        self.lane_scales.resize(blocks, [0.0; 8]);
        self.lane_offsets.resize(blocks, [0; 8]);
        // A block's minimum spread over its 8 lanes (a power of two: exact).
        self.lane_mins.clear();
        self.lane_mins.extend(self.mins.iter().map(|&m| [m / 8.0; 8]));
        for (b, (scales, offsets)) in self.lane_scales.iter_mut().zip(self.lane_offsets.iter_mut()).enumerate() {
            let codes = &self.codes[b * BLOCK..(b + 1) * BLOCK];
            for l in 0..8 {
                let sub = self.subs.get(b).map_or(1.0, |s| s[l / 4] as f32);
                scales[l] = self.scales[b] * sub;
                offsets[l] = -128 * codes[4 * l..4 * l + 4].iter().map(|&c| c as i32).sum::<i32>();
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{Panel, QuantizedRows, BLOCK, MR, NR};
    use std::arch::x86_64::*;

    /// A tile of up to [`MR`] activation rows from `i0` and [`NR`] panel rows from `r0`.
    pub(super) fn tile(
        x: &QuantizedRows,
        panel: &Panel,
        (i0, mr): (usize, usize),
        (r0, nr): (usize, usize),
        tile: &mut [[f32; MR]; NR],
    ) {
        let kb = x.k / BLOCK;
        assert!(i0 + mr <= x.m && r0 + nr <= panel.rows && (1..=MR).contains(&mr) && (1..=NR).contains(&nr));
        assert!(x.k.is_multiple_of(BLOCK) && panel.codes.len() >= panel.rows * x.k);
        assert!(x.scales.len() >= x.m * kb && x.sums.len() >= x.m * kb);
        assert!(panel.lane_scales.len() >= panel.rows * kb && panel.lane_offsets.len() >= panel.rows * kb);
        let mins = !panel.lane_mins.is_empty();
        assert!(!mins || panel.lane_mins.len() >= panel.rows * kb);
        // SAFETY: `Kernel::Avx512Vnni` is only chosen where AVX512F, AVX512BW and AVX512-VNNI
        // were detected (`Kernel::best`; the tests check the same before asking for it); the
        // asserts above keep every row and block the kernel reads inside the buffers.
        unsafe {
            if mins {
                shapes::<true>(x, panel, (i0, mr), (r0, nr), tile)
            } else {
                shapes::<false>(x, panel, (i0, mr), (r0, nr), tile)
            }
        }
    }

    /// The kernel instance for the tile's shape.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn shapes<const MINS: bool>(
        x: &QuantizedRows,
        panel: &Panel,
        (i0, mr): (usize, usize),
        (r0, nr): (usize, usize),
        tile: &mut [[f32; MR]; NR],
    ) {
        match (mr, nr) {
            (4, 4) => kernel::<4, 4, MINS>(x, panel, i0, r0, tile),
            (3, 4) => kernel::<3, 4, MINS>(x, panel, i0, r0, tile),
            (2, 4) => kernel::<2, 4, MINS>(x, panel, i0, r0, tile),
            (1, 4) => kernel::<1, 4, MINS>(x, panel, i0, r0, tile),
            _ => {
                // Fewer than NR weight rows: one at a time.
                for (r, row) in tile.iter_mut().enumerate().take(nr) {
                    let mut one = [[0.0f32; MR]; NR];
                    match mr {
                        4 => kernel::<4, 1, MINS>(x, panel, i0, r0 + r, &mut one),
                        3 => kernel::<3, 1, MINS>(x, panel, i0, r0 + r, &mut one),
                        2 => kernel::<2, 1, MINS>(x, panel, i0, r0 + r, &mut one),
                        _ => kernel::<1, 1, MINS>(x, panel, i0, r0 + r, &mut one),
                    }
                    *row = one[0];
                }
            }
        }
    }

    /// Two consecutive per-block values from `at` (one if `one`) as 16 lanes: 8 of each.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn pair(at: *const f32, one: bool) -> __m512 {
        let halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let two = if one { _mm_load_ss(at) } else { _mm_castpd_ps(_mm_load_sd(at.cast::<f64>())) };
        _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(two))
    }

    /// `M` activation rows from `i0` times `N` panel rows from `r0`, two blocks (64 values) a
    /// step, the last step of an odd block count masked to one block; `MINS`: the weights have
    /// minimums (Q4_1, Q5_1, Q4_K, Q5_K), subtracted times the activations' block sums.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn kernel<const M: usize, const N: usize, const MINS: bool>(
        x: &QuantizedRows,
        panel: &Panel,
        i0: usize,
        r0: usize,
        tile: &mut [[f32; MR]; NR],
    ) {
        let (k, kb) = (x.k, x.k / BLOCK);
        let xc = x.codes.as_ptr().add(i0 * k);
        let xs = x.scales.as_ptr().add(i0 * kb);
        let xm = x.sums.as_ptr().add(i0 * kb);
        let wc = panel.codes.as_ptr().add(r0 * k);
        let ws = panel.lane_scales.as_ptr().add(r0 * kb).cast::<f32>();
        let wo = panel.lane_offsets.as_ptr().add(r0 * kb).cast::<i32>();
        let wm = panel.lane_mins.as_ptr().add(if MINS { r0 * kb } else { 0 }).cast::<f32>();
        let flip = _mm512_set1_epi8(-128);
        let mut acc = [[_mm512_setzero_ps(); M]; N];
        let mut b = 0;
        while b < kb {
            let one = b + 1 == kb;
            let (bytes, lanes): (__mmask64, __mmask16) = if one { (0xFFFF_FFFF, 0x00FF) } else { (!0, !0) };
            let mut xv = [_mm512_setzero_si512(); M];
            let mut xd = [_mm512_setzero_ps(); M];
            let mut xsum = [_mm512_setzero_ps(); M];
            for i in 0..M {
                // The codes plus 128 as unsigned bytes (flipping the sign bit).
                let codes = _mm512_maskz_loadu_epi8(bytes, xc.add(i * k + b * BLOCK));
                xv[i] = _mm512_xor_si512(codes, flip);
                xd[i] = pair(xs.add(i * kb + b), one);
                if MINS {
                    xsum[i] = pair(xm.add(i * kb + b), one);
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let w = _mm512_maskz_loadu_epi8(bytes, wc.add(r * k + b * BLOCK));
                let scale = _mm512_maskz_loadu_ps(lanes, ws.add((r * kb + b) * 8));
                let offset = _mm512_maskz_loadu_epi32(lanes, wo.add((r * kb + b) * 8));
                let min =
                    if MINS { _mm512_maskz_loadu_ps(lanes, wm.add((r * kb + b) * 8)) } else { _mm512_setzero_ps() };
                for (i, acc) in acc.iter_mut().enumerate() {
                    // Per lane: sum of 4 (x + 128) * w, less 128 * sum of the 4 w: exact.
                    let sums = _mm512_dpbusd_epi32(offset, xv[i], w);
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(scale, xd[i]), *acc);
                    if MINS {
                        *acc = _mm512_fnmadd_ps(min, xsum[i], *acc);
                    }
                }
            }
            b += 2;
        }
        for (out, acc) in tile.iter_mut().zip(&acc) {
            for (out, &acc) in out.iter_mut().zip(acc) {
                *out = _mm512_reduce_add_ps(acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{random_blocks, seed};
    use super::*;
    use candle_core::quantized::GgmlDType;

    const TYPES: [GgmlDType; 8] = [
        GgmlDType::Q8_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_0,
        GgmlDType::Q5_1,
        GgmlDType::Q4K,
        GgmlDType::Q5K,
        GgmlDType::Q6K,
    ];

    /// Widths of whole blocks of `dtype`: odd block counts, one block and several super-blocks.
    fn widths(dtype: GgmlDType) -> [usize; 2] {
        if dtype.block_size() == 256 {
            [256, 768]
        } else {
            [32, 160]
        }
    }

    /// Activations of varied magnitudes per block, one block all zeros (its scale 0).
    fn activations(m: usize, k: usize, seed: u64) -> Vec<f32> {
        let mut s = seed ^ (m * k) as u64;
        let mut next = move || {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let mut x: Vec<f32> = (0..m * k).map(|t| next() * 4.0 * (1 + (t / BLOCK) % 5) as f32).collect();
        if m * k > BLOCK {
            x[BLOCK..2 * BLOCK].fill(0.0);
        }
        x
    }

    fn kernels() -> Vec<Kernel> {
        let mut k = vec![Kernel::Scalar];
        if Kernel::best() == Kernel::Avx512Vnni {
            k.push(Kernel::Avx512Vnni);
        }
        k
    }

    /// Each unpacked weight, `scale * sub * code - min`, is candle's dequantized value (Q6_K up
    /// to the order of its two products: candle rounds `d * sc` first).
    #[test]
    fn unpacked_weights_are_candles_values() {
        let seed = seed();
        for dtype in TYPES {
            let layout = Layout::of(dtype).expect("a tile layout");
            for cols in widths(dtype) {
                let rows = 7;
                let blocks = random_blocks(dtype, rows, cols, seed);
                let expected = blocks.dequantize().expect("candle dequantizes");
                let mut panel = Panel::default();
                panel.fill(layout, blocks.bytes(), cols);
                assert_eq!(panel.rows, rows);
                for (t, &e) in expected.iter().enumerate() {
                    let b = t / BLOCK;
                    let sub = panel.subs.get(b).map_or(1.0, |s| s[(t % BLOCK) / 16] as f32);
                    let min = panel.mins.get(b).copied().unwrap_or(0.0);
                    let got = panel.scales[b] * (sub * panel.codes[t] as f32) - min;
                    let tol = if layout == Layout::Q6K { 2.0 * f32::EPSILON * e.abs() } else { 0.0 };
                    assert!(
                        (got - e).abs() <= tol,
                        "{dtype:?} {cols} wide, weight {t}: {got} vs candle's {e} (seed {seed})"
                    );
                }
            }
        }
    }

    /// Quantized activations give back each value within half a step of their block's scale;
    /// a block of zeros keeps scale 0.
    #[test]
    fn quantized_rows_hold_their_values() {
        let seed = seed();
        let (m, k) = (3, 96);
        let x = activations(m, k, seed);
        let q = QuantizedRows::new(&x, k);
        for (t, &v) in x.iter().enumerate() {
            let s = q.scales[t / BLOCK];
            assert!((v - s * q.codes[t] as f32).abs() <= s * (0.5 + 1e-5), "value {t}: {v} (seed {seed})");
        }
        assert_eq!(q.scales[1], 0.0);
        for (b, block) in q.codes.chunks_exact(BLOCK).enumerate() {
            let sum: i32 = block.iter().map(|&c| c as i32).sum();
            assert_eq!(q.sums[b], q.scales[b] * sum as f32);
            assert!(q.scales[b] == 0.0 || block.iter().any(|&c| c.unsigned_abs() == 127), "block {b}");
        }
    }

    /// The quantization-aware reference: the same codes and scales, each block's exact integer
    /// sum, everything else in f64. Returns the values and the sum of their terms' magnitudes.
    fn reference(x: &QuantizedRows, panel: &Panel, i: usize, r: usize) -> (f64, f64) {
        let (k, kb) = (x.k, x.k / BLOCK);
        let (mut value, mut magnitude) = (0.0f64, 0.0f64);
        for b in 0..kb {
            let products: Vec<i64> = (0..BLOCK)
                .map(|t| {
                    let sub = panel.subs.get(r * kb + b).map_or(1, |s| s[t / 16] as i64);
                    panel.codes[r * k + b * BLOCK + t] as i64 * sub * x.codes[i * k + b * BLOCK + t] as i64
                })
                .collect();
            let scale = panel.scales[r * kb + b] as f64 * x.scales[i * kb + b] as f64;
            let min = panel.mins.get(r * kb + b).map_or(0.0, |&m| m as f64 * x.sums[i * kb + b] as f64);
            value += scale * products.iter().sum::<i64>() as f64 - min;
            // A kernel may sum a block's products in parts (eight lanes) that cancel only later.
            magnitude += (scale * products.iter().map(|p| p.abs()).sum::<i64>() as f64).abs() + min.abs();
        }
        (value, magnitude)
    }

    /// Every kernel's tiles are the quantization-aware reference up to f32 rounding (two
    /// roundings a block term and of the running sums: `2 (blocks + 8) eps` of the terms'
    /// magnitudes), for odd counts of activation rows and weight rows (partial tiles and panels).
    #[test]
    fn tiles_are_the_quantization_aware_reference() {
        let seed = seed();
        for kernel in kernels() {
            for dtype in TYPES {
                let layout = Layout::of(dtype).expect("a tile layout");
                for k in widths(dtype) {
                    for (m, n) in [(1, 5), (3, 37), (17, 9), (2, 4)] {
                        let blocks = random_blocks(dtype, n, k, seed ^ n as u64);
                        let x = QuantizedRows::new(&activations(m, k, seed), k);
                        let got = product(&x, blocks.bytes(), layout, n, kernel);
                        let mut panel = Panel::default();
                        panel.fill(layout, blocks.bytes(), k);
                        for i in 0..m {
                            for r in 0..n {
                                let (expected, magnitude) = reference(&x, &panel, i, r);
                                let v = got[i * n + r];
                                let bound = 2.0 * (k / BLOCK + 8) as f64 * f32::EPSILON as f64 * magnitude + 1e-30;
                                assert!(v.is_finite(), "{kernel:?} {dtype:?} m {m} n {n} k {k} ({i}, {r})");
                                assert!(
                                    (v as f64 - expected).abs() <= bound,
                                    "{kernel:?} {dtype:?} m {m} n {n} k {k} ({i}, {r}): {v} vs {expected} (bound {bound}, seed {seed})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Against the f64 product of the unquantized activations and candle's dequantized weights,
    /// a product is off by at most what quantizing the activations moves it (each value by half
    /// its block's step, times its weight's magnitude) plus the f32 rounding above.
    #[test]
    fn products_are_the_dense_product_within_activation_rounding() {
        let seed = seed();
        for kernel in kernels() {
            for dtype in TYPES {
                let layout = Layout::of(dtype).expect("a tile layout");
                let k = widths(dtype)[1];
                let (m, n) = (19, 13);
                let blocks = random_blocks(dtype, n, k, seed);
                let w = blocks.dequantize().expect("candle dequantizes");
                let xf = activations(m, k, seed);
                let x = QuantizedRows::new(&xf, k);
                let got = product(&x, blocks.bytes(), layout, n, kernel);
                for i in 0..m {
                    for r in 0..n {
                        let (mut exact, mut rounding, mut magnitude) = (0.0f64, 0.0f64, 0.0f64);
                        for t in 0..k {
                            let (a, b) = (xf[i * k + t] as f64, w[r * k + t] as f64);
                            exact += a * b;
                            rounding += b.abs() * x.scales[i * (k / BLOCK) + t / BLOCK] as f64 * (0.5 + 1e-5);
                            magnitude += (a * b).abs() + rounding;
                        }
                        let bound = rounding + 2.0 * (k / BLOCK + 8) as f64 * f32::EPSILON as f64 * magnitude;
                        let v = got[i * n + r] as f64;
                        assert!(
                            (v - exact).abs() <= bound,
                            "{kernel:?} {dtype:?} ({i}, {r}): {v} vs {exact} (bound {bound}, seed {seed})"
                        );
                    }
                }
            }
        }
    }
}
