//! Paged keys and values: a layer's store as a pool of blocks of `block_size` slots, and per
//! sequence a table of the blocks that hold its slots.
//!
//! A paged store is a [`KvStore`] whose first dimension counts blocks instead of sequences:
//! `[blocks, kv_heads, block_size, head_dim]`. Sequence `b` sees `width * block_size` slots
//! (its *logical* slots, numbered as in a store of its own: slot `p` for position `p` of a
//! full-attention layer, `p % slots` for a ring); logical slot `s` lies in slot `s %
//! block_size` of block `blocks[b, s / block_size]`. A decode step reads and writes through
//! the table ([`crate::KvView::Decode`], [`crate::QkvLayout::blocks`]), so sequences take
//! blocks as they need them and give them back when they end, and the same positions of two
//! sequences can share a block.

use super::KvStore;
use crate::ReadBackError;
use burn::tensor::{backend::Backend, s, BasicOps, Element, Int, Tensor, TensorData};

/// Where each sequence's logical slots lie in a paged store.
#[derive(Debug, Clone)]
pub struct BlockTable<B: Backend> {
    /// `[sequences, width]` (int, low 32 bits read): logical slots `i * block_size..(i + 1) *
    /// block_size` of sequence `b` are block `blocks[b, i]` of the store.
    pub blocks: Tensor<B, 2, Int>,
    /// Slots per block.
    pub block_size: usize,
}

impl<B: Backend> BlockTable<B> {
    /// A table of `rows` (`rows[b][i]`: the block of sequence `b`'s `i`-th `block_size` slots,
    /// every row as wide) on `device`.
    pub fn from_rows(rows: &[Vec<u32>], block_size: usize, device: &B::Device) -> Self {
        let width = rows.first().map_or(0, Vec::len);
        let flat: Vec<i64> = rows.iter().flat_map(|r| r.iter().map(|&b| i64::from(b))).collect();
        let blocks = Tensor::from_data(TensorData::new(flat, vec![rows.len(), width]), device);
        Self { blocks, block_size }
    }

    /// Blocks per sequence.
    pub fn width(&self) -> usize {
        self.blocks.dims()[1]
    }

    /// Logical slots per sequence, `width * block_size`.
    pub fn slots(&self) -> usize {
        self.width() * self.block_size
    }

    /// The table on the host, a row per sequence (a synchronizing read: for the references).
    pub fn rows(&self) -> Result<Vec<Vec<usize>>, ReadBackError> {
        crate::graph::unsupported(|| "an operation read a block table back to the host".into());
        let fail = |reason: String| ReadBackError { what: "a block table", reason };
        let data = self.blocks.clone().try_into_data().map_err(|e| fail(format!("{e:?}")))?;
        let all = data.convert::<i64>().into_vec::<i64>().map_err(|e| fail(format!("{e:?}")))?;
        let width = self.width().max(1);
        all.chunks(width)
            .map(|row| row.iter().map(|&b| usize::try_from(b).map_err(|_| fail(format!("block {b}")))).collect())
            .collect()
    }

    /// The block holding sequence `row`'s logical slot `slot` (`rows` as [`BlockTable::rows`]
    /// returns them); the slot in it is `slot % block_size`.
    pub fn block_of(&self, rows: &[Vec<usize>], row: usize, slot: usize) -> Option<usize> {
        rows.get(row)?.get(slot / self.block_size.max(1)).copied()
    }
}

/// Reference: the first `sequences` sequences' logical slots gathered from the paged `store`
/// into a store of their own, `[sequences, kv_heads, table.slots(), head_dim]` (int8 in the
/// backend's code layout).
pub fn gather_reference<B: Backend>(store: &KvStore<B>, table: &BlockTable<B>, sequences: usize) -> KvStore<B> {
    let width = table.width();
    let ids = table.blocks.clone().slice(s![0..sequences, ..]).reshape([sequences * width]);
    match store {
        KvStore::Dense { keys, values } => {
            KvStore::Dense { keys: gather(keys, &ids, width), values: gather(values, &ids, width) }
        }
        KvStore::Int8 { keys, values } => {
            let one = |kv: &super::Int8Kv<B>| {
                let scales = gather(&kv.scales.clone().unsqueeze_dim::<4>(3), &ids, width).squeeze_dim::<3>(3);
                let codes = gather(&kv.codes, &ids, width);
                let [sequences, heads, slots] = scales.dims();
                super::Int8Kv { codes, scales, shape: [sequences, heads, slots, kv.shape[3]] }
            };
            KvStore::Int8 { keys: one(keys), values: one(values) }
        }
    }
}

/// Blocks `ids` (`width` per sequence, in slot order) of a pool `[blocks, heads, block, rest]`
/// laid out as sequences, `[ids.len() / width, heads, width * block, rest]`.
fn gather<B: Backend, K: BasicOps<B>>(pool: &Tensor<B, 4, K>, ids: &Tensor<B, 1, Int>, width: usize) -> Tensor<B, 4, K>
where
    K::Elem: Element,
{
    let [_, heads, block, rest] = pool.dims();
    let sequences = ids.dims()[0] / width.max(1);
    pool.clone().select(0, ids.clone()).reshape([sequences, width, heads, block * rest]).swap_dims(1, 2).reshape([
        sequences,
        heads,
        width * block,
        rest,
    ])
}

/// Runs of consecutive blocks in `blocks`: `(first block, first index in blocks, length)`, so
/// that a copy into a sequence's blocks takes one write per run.
pub fn runs(blocks: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (i, &b) in blocks.iter().enumerate() {
        match out.last_mut() {
            Some((first, _, len)) if *first + *len == b as usize => *len += 1,
            _ => out.push((b as usize, i, 1)),
        }
    }
    out
}

/// The paged `store` with `rows` (one sequence in a store of its own, `[1, kv_heads, slots,
/// head_dim]` in the same format) copied into the blocks of its table row `blocks`: slots
/// `i * block_size..` of `rows` into block `blocks[i]`, for the blocks that cover its first
/// `len` slots (the last one whole: slots past `len` are never read).
pub fn scatter_sequence<B: Backend>(
    store: KvStore<B>,
    rows: &KvStore<B>,
    blocks: &[u32],
    block_size: usize,
    len: usize,
) -> KvStore<B> {
    let slots = rows.shape()[2];
    let used = blocks_used(slots, blocks.len(), block_size, len);
    let mut store = store;
    for (first, index, n) in runs(&blocks[..used]) {
        // Slots of `rows` for blocks `index..index + n`, the last run cut at the rows' end.
        let from = index * block_size;
        let to = ((index + n) * block_size).min(slots);
        let whole = (to - from) / block_size;
        let part = (to - from) % block_size;
        if whole > 0 {
            store = write_blocks(store, rows, from, whole, block_size, first);
        }
        if part > 0 {
            store = write_blocks(store, rows, from + whole * block_size, 1, part, first + whole);
        }
    }
    store
}

/// Blocks a copy of the first `len` slots of a sequence of `slots` slots into `blocks` blocks
/// of `block_size` writes ([`scatter_sequence`]).
pub fn blocks_used(slots: usize, blocks: usize, block_size: usize, len: usize) -> usize {
    len.min(slots).div_ceil(block_size.max(1)).min(blocks)
}

/// Writes `count` blocks of `take` slots (from slot `from` of the one-sequence `rows`) into
/// blocks `block..block + count` of the paged `store`, at their first slots.
fn write_blocks<B: Backend>(
    store: KvStore<B>,
    rows: &KvStore<B>,
    from: usize,
    count: usize,
    take: usize,
    block: usize,
) -> KvStore<B> {
    let target = s![block..block + count, .., 0..take, ..];
    let put = |pool: Tensor<B, 4>, one: &Tensor<B, 4>| pool.slice_assign(target, as_blocks(one, from, count, take));
    match (store, rows) {
        (KvStore::Dense { keys, values }, KvStore::Dense { keys: k, values: v }) => {
            KvStore::Dense { keys: put(keys, k), values: put(values, v) }
        }
        (KvStore::Int8 { keys, values }, KvStore::Int8 { keys: k, values: v }) => {
            let put = |pool: super::Int8Kv<B>, one: &super::Int8Kv<B>| {
                let scales = as_blocks(&one.scales.clone().unsqueeze_dim::<4>(3), from, count, take).squeeze_dim(3);
                super::Int8Kv {
                    codes: pool.codes.slice_assign(target, as_blocks(&one.codes, from, count, take)),
                    scales: pool.scales.slice_assign(s![block..block + count, .., 0..take], scales),
                    shape: pool.shape,
                }
            };
            KvStore::Int8 { keys: put(keys, k), values: put(values, v) }
        }
        // The callers check the formats first; a mismatch leaves the store as it was.
        (store, _) => store,
    }
}

/// Slots `from..from + count * take` of a one-sequence `[1, heads, slots, rest]` tensor as
/// `count` blocks, `[count, heads, take, rest]`.
fn as_blocks<B: Backend, K: BasicOps<B>>(t: &Tensor<B, 4, K>, from: usize, count: usize, take: usize) -> Tensor<B, 4, K>
where
    K::Elem: Element,
{
    let [_, heads, _, rest] = t.dims();
    t.clone().slice(s![0..1, .., from..from + count * take, ..]).reshape([heads, count, take, rest]).swap_dims(0, 1)
}

/// The table as the kernels take it.
pub(crate) mod kernel {
    use crate::cube::elementwise;
    use crate::graph::{arg, launch, tensor_arg};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// CubeCL kernel: the first `used` slots of a one-sequence tensor `rows` (`[1, heads,
    /// slots, rest]`) into a paged `store` (`[blocks, heads, block_size, rest]`, same dtype):
    /// slot `s` to slot `s % block_size` of block `blocks[s / block_size]`. One unit per element.
    #[cube(launch)]
    fn scatter_kernel<N: Numeric>(
        rows: &Tensor<N>,
        store: &mut Tensor<N>,
        blocks: &Array<u32>,
        used: u32,
        #[define(N)] _dtype: StorageType,
    ) {
        let i = (CUBE_POS_Y * CUBE_COUNT_X + CUBE_POS_X) as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
        let (heads, rest, used) = (rows.shape(1), rows.shape(3), used as usize);
        if i >= heads * used * rest {
            terminate!();
        }
        let d = i % rest;
        let s = (i / rest) % used;
        let h = i / (rest * used);
        let block_size = store.shape(2);
        let block = blocks[s / block_size] as usize;
        let to =
            block * store.stride(0) + h * store.stride(1) + (s % block_size) * store.stride(2) + d * store.stride(3);
        store[to] = rows[h * rows.stride(1) + s * rows.stride(2) + d * rows.stride(3)];
    }

    /// Slots `0..used` of `rows` (`[1, heads, slots, rest]`) into the blocks `blocks` (a
    /// contiguous int tensor, low 32 bits read: the `i`-th `block_size` slots go to block
    /// `blocks[i]`) of the paged `store`, in place: whoever else holds the store's buffer (a
    /// recorded decode step) sees the write.
    pub fn scatter<R: CubeRuntime>(rows: &CubeTensor<R>, store: &CubeTensor<R>, blocks: &CubeTensor<R>, used: usize) {
        let elements = rows.meta.shape()[1] * used * rows.meta.shape()[3];
        if elements == 0 {
            return;
        }
        let (count, dim) = elementwise(elements, 256);
        let dtype = rows.dtype.into();
        launch!(scatter_kernel(
            &rows.client,
            count,
            dim,
            tensor_arg(rows),
            tensor_arg(store),
            arg(blocks),
            used as u32,
            dtype,
        ));
    }

    /// A table's device buffer (contiguous, low 32 bits of each entry read) and sizes, built
    /// per launch.
    #[derive(Clone)]
    pub struct Table<R: CubeRuntime> {
        pub blocks: CubeTensor<R>,
        pub width: usize,
        pub block_size: usize,
    }

    impl<R: CubeRuntime> Table<R> {
        /// Logical slots per sequence.
        pub fn slots(&self) -> usize {
            self.width * self.block_size
        }
    }

    /// Whether the kernels take a table of blocks of `block_size` slots: a power of two (they
    /// split a slot into its block and the slot in it by a shift and a mask).
    pub fn kernels_take(block_size: usize) -> bool {
        block_size.is_power_of_two()
    }

    /// The launch values of an optional table: `(buffer or stand_in, width, log2 of the block
    /// size)`; the kernels read none of them where `table` is `None` (their `paged` switch is
    /// off). The block size must be a power of two ([`kernels_take`]).
    pub fn args<R: CubeRuntime>(table: Option<&Table<R>>, stand_in: &CubeTensor<R>) -> (CubeTensor<R>, u32, u32) {
        match table {
            Some(t) => (t.blocks.clone(), t.width as u32, t.block_size.trailing_zeros()),
            None => (stand_in.clone(), 0, 0),
        }
    }

    /// The store row holding sequence `b`'s logical slot `slot`: its block in a paged store
    /// (blocks of `2^shift` slots), else `b`.
    #[cube]
    pub fn store_row(
        blocks: &Array<u32>,
        b: usize,
        slot: usize,
        width: u32,
        shift: u32,
        #[comptime] paged: bool,
    ) -> usize {
        let mut row = b;
        if paged {
            row = blocks[b * width as usize + (slot >> shift as usize)] as usize;
        }
        row
    }

    /// Where logical slot `slot` lies in its store row: its slot in its block in a paged store.
    #[cube]
    pub fn store_slot(slot: usize, shift: u32, #[comptime] paged: bool) -> usize {
        let mut at = slot;
        if paged {
            at = slot & ((1usize << shift as usize) - 1);
        }
        at
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_join_consecutive_blocks() {
        assert_eq!(runs(&[4, 5, 6, 9, 2, 3]), vec![(4, 0, 3), (9, 3, 1), (2, 4, 2)]);
        assert!(runs(&[]).is_empty());
    }
}

#[cfg(test)]
mod gpu {
    use super::{blocks_used, scatter_sequence};
    use crate::gpu_test::{assert_close, host_seed, seed};
    use crate::{GemmaBackend, KvFormat, KvStore};
    use burn::tensor::{DType, Distribution, Tensor};

    /// Every block of a paged store in f32, `[blocks, heads, block_size, head_dim]` (int8
    /// dequantized: a copy is exact either way).
    fn blocks<B: GemmaBackend>(store: &KvStore<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        B::kv_read(store, 0..store.shape()[2], DType::F32)
    }

    /// One sequence copied into shuffled blocks of a pool that already holds other values
    /// (dense and int8; block sizes a power of two and not; a last block cut by the sequence's
    /// end, and copies that stop short of it): the same as the reference, the blocks it does
    /// not cover untouched, and the write in the pool's own buffers, which a second holder
    /// sees.
    pub fn scatter_into_blocks<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "scatter_into_blocks");
        let shuffle = host_seed("scatter_into_blocks shuffle");
        // (heads, slots, dim, block size, len)
        let cases: [(usize, usize, usize, usize, usize); 4] =
            [(3, 23, 12, 4, 23), (1, 23, 256, 5, 17), (2, 64, 64, 16, 33), (4, 9, 8, 3, 1)];
        for (heads, slots, dim, block_size, len) in cases {
            for format in [KvFormat::Dense(dtype), KvFormat::Int8] {
                let width = slots.div_ceil(block_size);
                let count = width + 3;
                // A permutation of the pool's blocks from the printed seed; the first `width`
                // are the sequence's.
                let mut ids: Vec<u32> = (0..count as u32).collect();
                let mut state = shuffle ^ (heads * 1000 + slots) as u64;
                for i in (1..count).rev() {
                    state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                    ids.swap(i, (state >> 33) as usize % (i + 1));
                }
                let row = &ids[..width];
                let random = |shape: [usize; 4], mean: f64| {
                    Tensor::<B, 4>::random(shape, Distribution::Normal(mean, 1.0), device).cast(dtype)
                };
                let one = B::kv_write(
                    B::kv_zeros([1, heads, slots, dim], format, device),
                    random([1, heads, slots, dim], 0.0),
                    random([1, heads, slots, dim], 0.5),
                    0,
                );
                let pool = B::kv_write(
                    B::kv_zeros([count, heads, block_size, dim], format, device),
                    random([count, heads, block_size, dim], -1.0),
                    random([count, heads, block_size, dim], 2.0),
                    0,
                );
                let what =
                    format!("scatter {format:?} h{heads} slots {slots} d{dim} blocks of {block_size}, len {len}");
                let before = blocks(&pool);
                // The reference writes copies (its pool's buffers are shared with `pool`).
                let expected = blocks(&scatter_sequence(pool.clone(), &one, row, block_size, len));
                let shared = pool.clone();
                let got = blocks(&B::kv_scatter_blocks(pool, &one, row, block_size, len));
                let seen = blocks(&shared);
                let used = blocks_used(slots, width, block_size, len);
                let pairs =
                    [("keys", got.0, expected.0, seen.0, before.0), ("values", got.1, expected.1, seen.1, before.1)];
                for (name, got, expected, seen, before) in pairs {
                    assert_close(got.clone(), expected, 0.0, &format!("{what}: {name}"));
                    assert_close(seen, got.clone(), 0.0, &format!("{what}: {name} through a second holder"));
                    // The blocks it does not cover keep their values.
                    for &block in &ids[used..] {
                        let b = block as usize;
                        let one_block = |t: &Tensor<B, 4>| t.clone().slice([b..b + 1, 0..heads, 0..block_size, 0..dim]);
                        assert_close(one_block(&got), one_block(&before), 0.0, &format!("{what}: {name} block {b}"));
                    }
                }
            }
        }
    }

    gpu_tests!(scatter_into_blocks_matches_reference_in_place => scatter_into_blocks);
}
