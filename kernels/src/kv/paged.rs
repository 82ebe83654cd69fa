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
    let used = len.min(slots).div_ceil(block_size.max(1)).min(blocks.len());
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
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

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
