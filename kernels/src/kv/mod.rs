//! Key/value storage of one attention layer: its formats, the store, and the views attention
//! reads.
//!
//! A [`KvStore`] is typed once, when the cache is built ([`crate::GemmaBackend::kv_zeros`]):
//! dense in a float dtype, or int8 codes with a scale per position ([`int8`]). Writing rows
//! ([`crate::GemmaBackend::kv_write`]), reading them back ([`crate::GemmaBackend::kv_read`]) and
//! attending over them ([`KvStore::view`] into [`crate::GemmaBackend::grouped_attention`]) take the store
//! whatever its format, so callers never match on it.

pub mod dense;
pub mod int8;
pub mod paged;

pub use int8::Int8Kv;
pub use paged::BlockTable;

use crate::StepPosition;
use burn::tensor::{backend::Backend, s, DType, Tensor};
use std::ops::Range;

/// How keys and values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvFormat {
    /// Dense in this dtype (f32, f16 or bf16).
    Dense(DType),
    /// int8 codes with one f32 scale per (sequence, KV head, position), quantized on append;
    /// attention reads the codes directly.
    Int8,
}

impl KvFormat {
    /// Bytes of the keys (or of the values) of a `[batch, kv_heads, slots, head_dim]` store;
    /// `None` when the count overflows.
    pub fn store_bytes(self, [batch, heads, slots, head_dim]: [usize; 4]) -> Option<u64> {
        let rows = (batch as u64).checked_mul(heads as u64)?.checked_mul(slots as u64)?;
        let values = rows.checked_mul(head_dim as u64)?;
        match self {
            Self::Dense(dtype) => values.checked_mul(dtype.size() as u64),
            // One byte per code and an f32 scale per row.
            Self::Int8 => values.checked_add(rows.checked_mul(4)?),
        }
    }
}

impl std::fmt::Display for KvFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dense(DType::BF16) => f.write_str("bf16"),
            Self::Dense(DType::F16) => f.write_str("f16"),
            Self::Dense(DType::F32) => f.write_str("f32"),
            Self::Dense(other) => write!(f, "{other:?}"),
            Self::Int8 => f.write_str("int8"),
        }
    }
}

/// The keys and values of one layer: `[batch, kv_heads, slots, head_dim]` each.
#[derive(Debug, Clone)]
pub enum KvStore<B: Backend> {
    /// Dense in the tensors' dtype.
    Dense { keys: Tensor<B, 4>, values: Tensor<B, 4> },
    /// int8 codes with a scale per (sequence, head, slot), in the backend's layout.
    Int8 { keys: Int8Kv<B>, values: Int8Kv<B> },
}

impl<B: Backend> KvStore<B> {
    /// `[batch, kv_heads, slots, head_dim]`.
    pub fn shape(&self) -> [usize; 4] {
        match self {
            Self::Dense { keys, .. } => keys.dims(),
            Self::Int8 { keys, .. } => keys.shape,
        }
    }

    /// The first `len` slots, as attention reads them.
    pub fn view(&self, len: usize) -> KvView<'_, B> {
        match self {
            Self::Dense { keys, values } => KvView::Dense {
                keys: keys.clone().slice(s![.., .., 0..len, ..]),
                values: values.clone().slice(s![.., .., 0..len, ..]),
            },
            Self::Int8 { keys, values } => KvView::Int8 { keys, values, len },
        }
    }

    /// Sequences `rows` of the store (slices of its tensors), `[rows.len(), kv_heads, slots,
    /// head_dim]`.
    pub fn rows(&self, rows: Range<usize>) -> Self {
        match self {
            Self::Dense { keys, values } => Self::Dense {
                keys: keys.clone().slice(s![rows.clone(), .., .., ..]),
                values: values.clone().slice(s![rows, .., .., ..]),
            },
            Self::Int8 { keys, values } => Self::Int8 { keys: keys.rows(rows.clone()), values: values.rows(rows) },
        }
    }

    /// Sequences `rows` copied into buffers of their own (unlike [`KvStore::rows`], whose
    /// slices share the store's: writing the store while they live would copy all of it).
    pub fn copy_rows(&self, rows: Range<usize>) -> Self {
        let fresh = |t: &Tensor<B, 4>| {
            let mut shape = t.dims();
            shape[0] = rows.len();
            Tensor::zeros(shape, (&t.device(), t.dtype()))
                .slice_assign(s![.., .., .., ..], t.clone().slice(s![rows.clone(), .., .., ..]))
        };
        match self {
            Self::Dense { keys, values } => Self::Dense { keys: fresh(keys), values: fresh(values) },
            Self::Int8 { keys, values } => {
                Self::Int8 { keys: keys.copy_rows(rows.clone()), values: values.copy_rows(rows) }
            }
        }
    }

    /// Whether `rows` (`n` sequences, as [`KvStore::rows`] returns them) can replace sequences
    /// `at..at + n` of this store: the same heads, slots, head size and format, within its
    /// sequences.
    pub fn check_rows(&self, at: usize, rows: &Self) -> Result<(), StoreMismatch> {
        let (store, given) = (self.shape(), rows.shape());
        let mismatch = |why: &'static str| StoreMismatch { store, rows: given, at, why };
        if given[1..] != store[1..] || at + given[0] > store[0] {
            return Err(mismatch("its shape does not fit"));
        }
        match (self, rows) {
            (Self::Dense { keys, .. }, Self::Dense { keys: k, .. }) if keys.dtype() == k.dtype() => Ok(()),
            (Self::Int8 { keys, .. }, Self::Int8 { keys: k, .. }) if keys.codes.dtype() == k.codes.dtype() => Ok(()),
            _ => Err(mismatch("its format differs")),
        }
    }

    /// Whether `rows` (one sequence, as [`KvStore::rows`] returns it) can be copied into the
    /// blocks of this paged store ([`paged::scatter_sequence`]): the same heads, head size and
    /// format.
    pub fn check_blocks(&self, rows: &Self) -> Result<(), StoreMismatch> {
        let (store, given) = (self.shape(), rows.shape());
        let mismatch = |why: &'static str| StoreMismatch { store, rows: given, at: 0, why };
        if given[0] != 1 || given[1] != store[1] || given[3] != store[3] {
            return Err(mismatch("its shape does not fit"));
        }
        match (self, rows) {
            (Self::Dense { keys, .. }, Self::Dense { keys: k, .. }) if keys.dtype() == k.dtype() => Ok(()),
            (Self::Int8 { keys, .. }, Self::Int8 { keys: k, .. }) if keys.codes.dtype() == k.codes.dtype() => Ok(()),
            _ => Err(mismatch("its format differs")),
        }
    }

    /// The store with sequences `at..at + n` replaced by `rows`, which must fit
    /// ([`KvStore::check_rows`]; rows that do not are not written).
    pub fn replace_rows(self, at: usize, rows: Self) -> Self {
        if self.check_rows(at, &rows).is_err() {
            return self;
        }
        match (self, rows) {
            (Self::Dense { keys, values }, Self::Dense { keys: k, values: v }) => {
                let range = s![at..at + k.dims()[0], .., .., ..];
                Self::Dense { keys: keys.slice_assign(range, k), values: values.slice_assign(range, v) }
            }
            (Self::Int8 { keys, values }, Self::Int8 { keys: k, values: v }) => {
                Self::Int8 { keys: keys.assign_rows(at, k), values: values.assign_rows(at, v) }
            }
            // Never reached by the callers; the store is left as it was.
            (store, _) => store,
        }
    }

    /// Bytes on the device.
    pub fn device_bytes(&self) -> usize {
        let dense = |t: &Tensor<B, 4>| t.shape().num_elements() * t.dtype().size();
        match self {
            Self::Dense { keys, values } => dense(keys) + dense(values),
            Self::Int8 { keys, values } => keys.device_bytes() + values.device_bytes(),
        }
    }
}

/// Why [`KvStore::check_rows`] refused rows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("rows {rows:?} cannot go into a store of {store:?} at sequence {at}: {why}")]
pub struct StoreMismatch {
    pub store: [usize; 4],
    pub rows: [usize; 4],
    pub at: usize,
    pub why: &'static str,
}

/// Keys and values as attention reads them.
#[derive(Debug, Clone)]
pub enum KvView<'a, B: Backend> {
    /// `[batch, kv_heads, k_len, head_dim]` each, any strides.
    Dense { keys: Tensor<B, 4>, values: Tensor<B, 4> },
    /// The first `len` slots of int8 stores.
    Int8 { keys: &'a Int8Kv<B>, values: &'a Int8Kv<B>, len: usize },
    /// A whole store, for one decode query per sequence at `position`: the slots it attends
    /// to and their mask offsets follow from the position ([`crate::step::decode_visible`]);
    /// of the options' mask only the window is read. Where the position is on the device, the
    /// kernels read it there (a replayed decode step).
    ///
    /// `blocks`: `None` where sequence `b` is row `b` of the store; for a paged store
    /// ([`paged`]), where each sequence's slots lie (its logical slots are then the table's).
    Decode { store: &'a KvStore<B>, position: StepPosition<B>, blocks: Option<&'a BlockTable<B>> },
}

/// Reference: a store of `shape` in `format`, every slot zero (int8 in the reference layout,
/// one `U8` code per element).
pub fn zeros_reference<B: Backend>(shape: [usize; 4], format: KvFormat, device: &B::Device) -> KvStore<B> {
    match format {
        KvFormat::Dense(dtype) => KvStore::Dense {
            keys: Tensor::zeros(shape, (device, dtype)),
            values: Tensor::zeros(shape, (device, dtype)),
        },
        KvFormat::Int8 => {
            KvStore::Int8 { keys: int8::zeros_reference(shape, device), values: int8::zeros_reference(shape, device) }
        }
    }
}

/// Reference: `keys` and `values` (`[batch, kv_heads, t, head_dim]`) written into slots
/// `slot..slot + t`: cast to the store's dtype, or quantized.
pub fn write_reference<B: Backend>(
    store: KvStore<B>,
    keys: Tensor<B, 4>,
    values: Tensor<B, 4>,
    slot: usize,
) -> KvStore<B> {
    let t = keys.dims()[2];
    match store {
        KvStore::Dense { keys: cache_k, values: cache_v } => {
            let dtype = cache_k.dtype();
            let slots = s![.., .., slot..slot + t, ..];
            KvStore::Dense {
                keys: cache_k.slice_assign(slots, keys.cast(dtype)),
                values: cache_v.slice_assign(slots, values.cast(dtype)),
            }
        }
        KvStore::Int8 { keys: cache_k, values: cache_v } => KvStore::Int8 {
            keys: int8::store_reference(cache_k, keys, slot),
            values: int8::store_reference(cache_v, values, slot),
        },
    }
}

/// `rows` (`[batch, kv_heads, t, head_dim]`) in slots `slot..slot + t` of `store` (`[batch,
/// kv_heads, slots, head_dim]`, cast to its dtype) by concatenating the slots before, the rows
/// and the slots after: one copy of the store. For backends whose `slice_assign` costs several
/// passes over the whole store (Candle's masks and pads the rows to the store's size), where
/// [`write_reference`] does that at every token of every layer.
pub fn splice_dense<B: Backend>(store: Tensor<B, 4>, rows: Tensor<B, 4>, slot: usize) -> Tensor<B, 4> {
    let [_, _, slots, _] = store.dims();
    let t = rows.dims()[2];
    let rows = rows.cast(store.dtype());
    let mut parts = Vec::with_capacity(3);
    if slot > 0 {
        parts.push(store.clone().slice(s![.., .., 0..slot, ..]));
    }
    parts.push(rows);
    if slot + t < slots {
        parts.push(store.slice(s![.., .., slot + t..slots, ..]));
    }
    Tensor::cat(parts, 2)
}

/// Reference: slots `range` of the keys and values in `dtype`, `[batch, kv_heads, range.len(),
/// head_dim]` each.
pub fn read_reference<B: Backend>(
    store: &KvStore<B>,
    range: Range<usize>,
    dtype: DType,
) -> (Tensor<B, 4>, Tensor<B, 4>) {
    match store {
        KvStore::Dense { keys, values } => {
            let slots = s![.., .., range, ..];
            (keys.clone().slice(slots).cast(dtype), values.clone().slice(slots).cast(dtype))
        }
        KvStore::Int8 { keys, values } => {
            (int8::load_reference(keys, range.clone(), dtype), int8::load_reference(values, range, dtype))
        }
    }
}

#[cfg(all(test, feature = "candle"))]
mod candle_tests {
    use super::{splice_dense, write_reference, KvStore};
    use crate::GemmaBackend;
    use burn::tensor::{Distribution, Tensor};

    #[allow(deprecated)]
    type C = burn::backend::Candle<f32, i64>;

    /// Candle's dense writes (by [`splice_dense`]) put the rows where the reference's
    /// `slice_assign` does, bit for bit: at the first slot, inside, at the last, rows of 1 and 3,
    /// two heads (slices that are not contiguous).
    #[test]
    fn candle_kv_write_matches_reference() {
        let device = Default::default();
        let normal = Distribution::Normal(0.0, 1.0);
        let store = || Tensor::<C, 4>::random([2, 2, 11, 5], normal, &device);
        for (slot, t) in [(0, 1), (4, 1), (10, 1), (0, 3), (5, 3), (8, 3)] {
            let (k0, v0) = (store(), store());
            let keys = Tensor::<C, 4>::random([2, 2, t, 5], normal, &device);
            let values = Tensor::<C, 4>::random([2, 2, t, 5], normal, &device);
            let expected = write_reference(
                KvStore::Dense { keys: k0.clone(), values: v0.clone() },
                keys.clone(),
                values.clone(),
                slot,
            );
            let got = <C as GemmaBackend>::kv_write(
                KvStore::Dense { keys: k0.clone(), values: v0 },
                keys.clone(),
                values,
                slot,
            );
            let (KvStore::Dense { keys: ek, values: ev }, KvStore::Dense { keys: gk, values: gv }) = (expected, got)
            else {
                unreachable!("dense stores")
            };
            assert_eq!(gk.into_data(), ek.into_data(), "keys, slot {slot}, {t} rows");
            assert_eq!(gv.into_data(), ev.into_data(), "values, slot {slot}, {t} rows");
            assert_eq!(splice_dense(k0.clone(), keys, slot).dims(), k0.dims());
        }
    }
}
