//! One decode position of an attention layer in one pass: the joined `q | k | v` projection is
//! split into heads, queries and keys get QK-norm and RoPE, keys and values are written into the
//! layer's KV store (dense, or quantized to int8 on the way), and the queries come back for
//! attention.
//!
//! Unfused, this is two RoPE launches, two cache writes and the copies that split the
//! projection; decode issues it once per layer and token, so the launches are what it costs.

use crate::{rope, step, BlockTable, GemmaBackend, KvStore, RopeTables, StepPosition};
use burn::tensor::{backend::Backend, Tensor};

/// Which rows follow the query heads in the joined projection, and what is appended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvRows {
    /// `kv_heads` key heads, then `kv_heads` value heads: both appended.
    Projected,
    /// `kv_heads` key heads only; the values are those rows as projected, before the key norm
    /// and RoPE (Gemma 4's `attention_k_eq_v`): both appended.
    FromKeys,
    /// Queries only: the layer attends over another layer's cache (Gemma 4's KV sharing) and
    /// appends nothing.
    Shared,
}

/// Per-head RMSNorms of a layer (Gemma 3 and 4).
#[derive(Debug, Clone)]
pub struct HeadNorms<B: Backend> {
    /// Query and key weights (`[head_dim]`, f32, applied as `1 + w`).
    pub query: Tensor<B, 1>,
    pub key: Tensor<B, 1>,
    pub eps: f64,
    /// Gemma 4 also normalizes values, without a weight.
    pub value: ValueNorm,
}

/// Whether values are normalized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueNorm {
    None,
    /// RMSNorm with scale 1.
    Unweighted,
}

/// How to read a joined projection and where it sits.
#[derive(Debug, Clone)]
pub struct QkvLayout<B: Backend> {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// What follows the queries.
    pub kv: KvRows,
    /// The layer type's RoPE tables.
    pub rope: RopeTables<B>,
    /// Absolute position of the token (its row of the tables); it goes to slot
    /// `position % slots` of the store ([`step::slot`]).
    pub position: StepPosition<B>,
    /// QK-norm (and value norm), where the layer has them.
    pub norm: Option<HeadNorms<B>>,
    /// For a paged store: where each sequence's slots lie (the position then goes to logical
    /// slot `position % table.slots()`, see [`crate::kv::paged`]).
    pub blocks: Option<BlockTable<B>>,
}

impl<B: Backend> QkvLayout<B> {
    /// Head rows per sequence in the joined projection.
    pub fn projected_heads(&self) -> usize {
        self.heads
            + match self.kv {
                KvRows::Projected => 2 * self.kv_heads,
                KvRows::FromKeys => self.kv_heads,
                KvRows::Shared => 0,
            }
    }

    /// Width of the joined projection, `projected_heads() * head_dim`.
    pub fn width(&self) -> usize {
        self.projected_heads() * self.head_dim
    }
}

/// Reference: splits with slices, rotates with [`rope::reference`], and writes the store with
/// [`GemmaBackend::kv_write`] (whose int8 layout is the backend's).
///
/// - `qkv`: `[batch, width]` in the activation dtype, one position per sequence (the first
///   `batch` sequences of the store, each at its own position where `layout.position` holds
///   one per sequence);
/// - returns the queries `[batch, heads, 1, head_dim]` and the store with each sequence's slot
///   written.
pub fn reference<B: GemmaBackend>(
    qkv: Tensor<B, 2>,
    layout: &QkvLayout<B>,
    store: KvStore<B>,
) -> Result<(Tensor<B, 4>, KvStore<B>), crate::ReadBackError> {
    rotated_by(qkv, layout, store, Rotation::Reference)
}

/// What rotates a decode step's queries and keys in [`rotated_by`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// [`rope::reference`]: the plain reference the kernels are tested against.
    Reference,
    /// The backend's [`GemmaBackend::qk_norm_rope`], the one its prompts use: a backend with its
    /// own rotation (Candle's host rows) keeps a one-token step bit for bit equal to the same
    /// position in a prompt or a verify step.
    Backend,
}

/// [`reference`] with queries and keys rotated by `rotation`.
pub fn rotated_by<B: GemmaBackend>(
    qkv: Tensor<B, 2>,
    layout: &QkvLayout<B>,
    store: KvStore<B>,
    rotation: Rotation,
) -> Result<(Tensor<B, 4>, KvStore<B>), crate::ReadBackError> {
    let [batch, width] = qkv.dims();
    let positions = layout.position.resolve_rows(batch)?;
    let table = match &layout.blocks {
        Some(table) if batch > 0 => Some((table, table.rows()?)),
        _ => None,
    };
    if table.is_none() && (batch == 0 || (batch == store.shape()[0] && positions.windows(2).all(|w| w[0] == w[1]))) {
        return one_position(qkv, layout, positions.first().copied().unwrap_or(0), store, rotation);
    }
    // One sequence at a time (at positions of their own, fewer than the store's, or paged),
    // each into its row of the store: its slot's block in a paged store, whose slot in the
    // block is `position % block_size`.
    let mut store = store;
    let mut queries = Vec::with_capacity(batch);
    for (b, &position) in positions.iter().enumerate() {
        let at = match &table {
            None => layout.position.store_row(b),
            Some((table, rows)) => {
                let slot = step::slot(position, table.slots());
                table.block_of(rows, b, slot).ok_or_else(|| crate::ReadBackError {
                    what: "a block table",
                    reason: format!("no block for slot {slot} of sequence {b}"),
                })?
            }
        };
        let row = qkv.clone().slice([b..b + 1, 0..width]);
        let (q, rows) = one_position(row, layout, position, store.rows(at..at + 1), rotation)?;
        store = store.replace_rows(at, rows);
        queries.push(q);
    }
    Ok((Tensor::cat(queries, 0), store))
}

/// [`reference`] with every sequence of `qkv` and `store` at `position`.
fn one_position<B: GemmaBackend>(
    qkv: Tensor<B, 2>,
    layout: &QkvLayout<B>,
    position: usize,
    store: KvStore<B>,
    rotation: Rotation,
) -> Result<(Tensor<B, 4>, KvStore<B>), crate::ReadBackError> {
    let [batch, _] = qkv.dims();
    let slot = step::slot(position, store.shape()[2]);
    let d = layout.head_dim;
    let part =
        |first: usize, n: usize| qkv.clone().slice([0..batch, first * d..(first + n) * d]).reshape([batch, n, 1, d]);
    let norm = |w: fn(&HeadNorms<B>) -> &Tensor<B, 1>| layout.norm.as_ref().map(|n| (w(n).clone(), n.eps));
    let rotate = |x: Tensor<B, 4>, norm| match rotation {
        Rotation::Reference => rope::reference(x, layout.rope.cos.clone(), layout.rope.sin.clone(), position, norm),
        Rotation::Backend => B::qk_norm_rope(x, &layout.rope, position, norm),
    };
    let q = rotate(part(0, layout.heads), norm(|n| &n.query));
    let (heads, kv_heads) = (layout.heads, layout.kv_heads);
    let v = match layout.kv {
        KvRows::Shared => return Ok((q, store)),
        KvRows::Projected => part(heads + kv_heads, kv_heads),
        KvRows::FromKeys => part(heads, kv_heads),
    };
    let k = rotate(part(heads, kv_heads), norm(|n| &n.key));
    let v = match &layout.norm {
        Some(HeadNorms { value: ValueNorm::Unweighted, eps, .. }) => {
            // The reference norm scales by `1 + w`: a zero weight is scale 1.
            let unit_scale = Tensor::zeros([d], (&v.device(), burn::tensor::DType::F32));
            crate::rms_norm::reference(v, unit_scale, *eps)
        }
        _ => v,
    };
    let store = B::kv_write(store, k, v, slot);
    Ok((q, store))
}

/// CubeCL kernels: one cube per `(head row, sequence)`, where head rows run over the query,
/// key and value heads of the joined projection. Each cube stages its row in shared memory
/// (normalized and rotated in f32, rounded once to the activation dtype, as the unfused RoPE
/// kernel does), then writes queries out, and keys and values into the cache slot: copied to
/// the cache dtype, or quantized with the row's `max|x| / 127` scale as the int8 store does.
#[allow(clippy::manual_div_ceil, clippy::collapsible_if)]
pub(crate) mod kernel {
    use crate::cube::{cube_max, empty, pow2_ceil, Strides4};
    use crate::graph::{arg, launch};
    use crate::kv::int8::kernel::placed;
    use crate::kv::paged::kernel::{args as table_args, store_row, store_slot, Table};
    use crate::rms_norm::kernel::row_inv_rms;
    use crate::step::kernel::Position;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Stages the head row at `base` of `qkv` into `stage[0..dim]`.
    #[cube]
    #[allow(clippy::too_many_arguments)]
    fn stage_row<F: Float, W: Float>(
        qkv: &Array<F>,
        q_weight: &Array<W>,
        k_weight: &Array<W>,
        cos: &Array<f32>,
        sin: &Array<f32>,
        stage: &mut SharedMemory<f32>,
        scratch: &mut SharedMemory<f32>,
        base: usize,
        table: usize,
        kind: u32,
        eps: f32,
        #[comptime] dim: usize,
        #[comptime] norm: bool,
        #[comptime] value_norm: bool,
    ) {
        let half = dim / 2;
        let threads = CUBE_DIM_X as usize;
        let mut inv_rms = 1.0f32;
        // `kind` is the same for the whole cube, so every unit reaches the reduction's barriers.
        if norm {
            if kind <= 1u32 {
                inv_rms = row_inv_rms::<F>(qkv, base, dim, scratch, eps);
            }
        }
        if value_norm {
            if kind == 2u32 {
                inv_rms = row_inv_rms::<F>(qkv, base, dim, scratch, eps);
            }
        }
        let mut p = UNIT_POS_X as usize;
        while p < half {
            let mut x1 = f32::cast_from(qkv[base + p]);
            let mut x2 = f32::cast_from(qkv[base + p + half]);
            if kind <= 1u32 {
                if norm {
                    let mut w1 = f32::cast_from(k_weight[p]);
                    let mut w2 = f32::cast_from(k_weight[p + half]);
                    if kind == 0u32 {
                        w1 = f32::cast_from(q_weight[p]);
                        w2 = f32::cast_from(q_weight[p + half]);
                    }
                    x1 = x1 * inv_rms * (1.0f32 + w1);
                    x2 = x2 * inv_rms * (1.0f32 + w2);
                }
                let c = cos[table + p];
                let sn = sin[table + p];
                let r1 = x1 * c - x2 * sn;
                let r2 = x2 * c + x1 * sn;
                x1 = r1;
                x2 = r2;
            } else if value_norm {
                x1 *= inv_rms;
                x2 *= inv_rms;
            }
            stage[p] = f32::cast_from(F::cast_from(x1));
            stage[p + half] = f32::cast_from(F::cast_from(x2));
            p += threads;
        }
        sync_cube();
    }

    /// The row's role from its index among `heads + 2 kv_heads` head rows: 0 query, 1 key,
    /// 2 value.
    #[cube]
    fn role(r: usize, heads: usize, kv_heads: usize) -> u32 {
        let mut kind = 0u32;
        if r >= heads {
            kind = 1u32;
        }
        if r >= heads + kv_heads {
            kind = 2u32;
        }
        kind
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn qkv_dense_kernel<F: Float, W: Float, C: Float>(
        qkv: &Array<F>,
        q_weight: &Array<W>,
        k_weight: &Array<W>,
        cos: &Array<f32>,
        sin: &Array<f32>,
        q_out: &mut Array<F>,
        keys: &mut Array<C>,
        values: &mut Array<C>,
        step: &Array<u32>,
        blocks: &Array<u32>,
        key_strides: Strides4,
        value_strides: Strides4,
        slots: u32,
        table_width: u32,
        block_shift: u32,
        heads: u32,
        kv_heads: u32,
        row_width: u32,
        value_offset: u32,
        position: u32,
        position_stride: u32,
        row_step: u32,
        store_stride: u32,
        eps: f32,
        #[comptime] dim: usize,
        #[comptime] norm: bool,
        #[comptime] value_norm: bool,
        #[comptime] position_on_device: bool,
        #[comptime] paged: bool,
        #[define(F, W, C)] _dtypes: [StorageType; 3],
    ) {
        let (heads, kv_heads) = (heads as usize, kv_heads as usize);
        let r = CUBE_POS_X as usize;
        let b = CUBE_POS_Y as usize;
        let mut position = position;
        if position_on_device {
            // Consecutive rows of one sequence: row `b` at the first row's position plus `b`,
            // in store row 0.
            position = step[b * position_stride as usize] + b as u32 * row_step;
        }
        let slot = position % slots;
        let row_b = store_row(blocks, b * store_stride as usize, slot as usize, table_width, block_shift, paged);
        let row_slot = store_slot(slot as usize, block_shift, paged);
        let kind = role(r, heads, kv_heads);
        let mut stage = SharedMemory::<f32>::new(dim);
        let mut scratch = SharedMemory::<f32>::new(256usize);
        // Value rows read the key rows where the values are the keys (`value_offset = kv_heads`).
        let mut source = r;
        if kind == 2u32 {
            source = r - value_offset as usize;
        }
        let base = (b * row_width as usize + source) * dim;
        let table = position as usize * (dim / 2);
        stage_row::<F, W>(
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            &mut stage,
            &mut scratch,
            base,
            table,
            kind,
            eps,
            dim,
            norm,
            value_norm,
        );
        let mut p = UNIT_POS_X as usize;
        if kind == 0u32 {
            while p < dim {
                q_out[(b * heads + r) * dim + p] = F::cast_from(stage[p]);
                p += CUBE_DIM_X as usize;
            }
        } else if kind == 1u32 {
            let at = key_strides.at(row_b, r - heads, row_slot, 0);
            while p < dim {
                keys[at + p * key_strides.d] = C::cast_from(stage[p]);
                p += CUBE_DIM_X as usize;
            }
        } else {
            let at = value_strides.at(row_b, r - heads - kv_heads, row_slot, 0);
            while p < dim {
                values[at + p * value_strides.d] = C::cast_from(stage[p]);
                p += CUBE_DIM_X as usize;
            }
        }
    }

    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    fn qkv_int8_kernel<F: Float, W: Float>(
        qkv: &Array<F>,
        q_weight: &Array<W>,
        k_weight: &Array<W>,
        cos: &Array<f32>,
        sin: &Array<f32>,
        q_out: &mut Array<F>,
        k_codes: &mut Array<u32>,
        k_scales: &mut Array<f32>,
        v_codes: &mut Array<u32>,
        v_scales: &mut Array<f32>,
        step: &Array<u32>,
        blocks: &Array<u32>,
        slots: u32,
        store_slots: u32,
        table_width: u32,
        block_shift: u32,
        heads: u32,
        kv_heads: u32,
        row_width: u32,
        value_offset: u32,
        position: u32,
        position_stride: u32,
        row_step: u32,
        store_stride: u32,
        eps: f32,
        #[comptime] dim: usize,
        #[comptime] norm: bool,
        #[comptime] value_norm: bool,
        #[comptime] position_on_device: bool,
        #[comptime] paged: bool,
        #[define(F, W)] _dtypes: [StorageType; 2],
    ) {
        let (heads, kv_heads) = (heads as usize, kv_heads as usize);
        let r = CUBE_POS_X as usize;
        let b = CUBE_POS_Y as usize;
        let mut position = position;
        if position_on_device {
            // Consecutive rows of one sequence: row `b` at the first row's position plus `b`,
            // in store row 0.
            position = step[b * position_stride as usize] + b as u32 * row_step;
        }
        let slot = position % slots;
        let row_b = store_row(blocks, b * store_stride as usize, slot as usize, table_width, block_shift, paged);
        let row_slot = store_slot(slot as usize, block_shift, paged);
        let kind = role(r, heads, kv_heads);
        let mut stage = SharedMemory::<f32>::new(dim);
        let mut scratch = SharedMemory::<f32>::new(256usize);
        // Value rows read the key rows where the values are the keys (`value_offset = kv_heads`).
        let mut source = r;
        if kind == 2u32 {
            source = r - value_offset as usize;
        }
        let base = (b * row_width as usize + source) * dim;
        let table = position as usize * (dim / 2);
        stage_row::<F, W>(
            qkv,
            q_weight,
            k_weight,
            cos,
            sin,
            &mut stage,
            &mut scratch,
            base,
            table,
            kind,
            eps,
            dim,
            norm,
            value_norm,
        );
        let threads = CUBE_DIM_X as usize;
        let unit = UNIT_POS_X as usize;
        if kind == 0u32 {
            let mut p = unit;
            while p < dim {
                q_out[(b * heads + r) * dim + p] = F::cast_from(stage[p]);
                p += threads;
            }
        } else {
            let mut amax = 0.0f32;
            let mut p = unit;
            while p < dim {
                let a = f32::abs(stage[p]);
                if a > amax {
                    amax = a;
                }
                p += threads;
            }
            let scale = cube_max(amax, &mut scratch) / 127.0f32;
            let mut inv = 0.0f32;
            if scale > 0.0f32 {
                inv = 1.0f32 / scale;
            }
            let mut head = r - heads;
            if kind != 1u32 {
                head = r - heads - kv_heads;
            }
            let words = dim / 4;
            let row = (row_b * kv_heads + head) * store_slots as usize + row_slot;
            let mut w = unit;
            while w < words {
                let mut word = 0u32;
                #[unroll]
                for n in 0..4usize {
                    let q = f32::round(stage[w * 4 + n] * inv).clamp(f32::new(-127.0), 127.0f32) + 128.0f32;
                    word |= placed(q, n);
                }
                if kind == 1u32 {
                    k_codes[row * words + w] = word;
                } else {
                    v_codes[row * words + w] = word;
                }
                w += threads;
            }
            if unit == 0 {
                if kind == 1u32 {
                    k_scales[row] = scale;
                } else {
                    v_scales[row] = scale;
                }
            }
        }
    }

    /// The device tensors of a [`super::QkvLayout`].
    pub struct Layout<R: CubeRuntime> {
        pub heads: usize,
        pub kv_heads: usize,
        pub head_dim: usize,
        pub kv: super::KvRows,
        pub cos: CubeTensor<R>,
        pub sin: CubeTensor<R>,
        pub position: Position<R>,
        /// Where each sequence's slots lie in a paged store.
        pub blocks: Option<Table<R>>,
        /// Query and key weights, epsilon, and whether values are normalized.
        pub norm: Option<(CubeTensor<R>, CubeTensor<R>, f64, super::ValueNorm)>,
    }

    /// Where the keys and values go.
    pub enum Store<'a, R: CubeRuntime> {
        /// `[batch, kv_heads, slots, head_dim]`, any strides, written in place.
        Dense { keys: &'a CubeTensor<R>, values: &'a CubeTensor<R> },
        /// Packed codes `[batch, kv_heads, slots, head_dim / 4]` and scales `[batch, kv_heads,
        /// slots]`, contiguous, written in place.
        Int8 {
            k_codes: &'a CubeTensor<R>,
            k_scales: &'a CubeTensor<R>,
            v_codes: &'a CubeTensor<R>,
            v_scales: &'a CubeTensor<R>,
        },
    }

    /// `qkv`: contiguous `[batch, width]`, the first `batch` sequences of `store`. Writes slot
    /// `position % slots` of each (its own position where the buffer holds one per sequence)
    /// and returns the queries `[batch, heads, 1, head_dim]`.
    pub fn qkv_rope_append<R: CubeRuntime>(
        qkv: CubeTensor<R>,
        layout: &Layout<R>,
        store: Store<'_, R>,
    ) -> CubeTensor<R> {
        let batch = qkv.meta.shape()[0];
        let (heads, kv_heads, dim) = (layout.heads, layout.kv_heads, layout.head_dim);
        let q = empty(&qkv, [batch, heads, 1, dim], qkv.dtype);
        if batch == 0 || dim == 0 {
            return q;
        }
        use super::{KvRows, ValueNorm};
        // Value rows read `value_offset` rows back in the projection (the key rows for FromKeys).
        let (rows, row_width, value_offset) = match layout.kv {
            KvRows::Projected => (heads + 2 * kv_heads, heads + 2 * kv_heads, 0),
            KvRows::FromKeys => (heads + 2 * kv_heads, heads + kv_heads, kv_heads),
            KvRows::Shared => (heads, heads, 0),
        };
        let count = CubeCount::Static(rows as u32, batch as u32, 1);
        let cube_dim = CubeDim::new_1d(pow2_ceil(dim / 2).clamp(32, 256) as u32);
        let has_norm = layout.norm.is_some();
        let value_norm = matches!(layout.norm, Some((_, _, _, ValueNorm::Unweighted)));
        // Without QK-norm the weights are never read; the cos table stands in for them.
        let (q_weight, k_weight, eps, _) =
            layout.norm.clone().unwrap_or_else(|| (layout.cos.clone(), layout.cos.clone(), 0.0, ValueNorm::None));
        let client = qkv.client.clone();
        let (f, w) = (qkv.dtype.into(), q_weight.dtype.into());
        let (cos, sin) = (&layout.cos, &layout.sin);
        let step = layout.position.buffer(cos);
        let on_device = layout.position.on_device();
        let position = layout.position.value();
        let (blocks, table_width, block_shift) = table_args(layout.blocks.as_ref(), cos);
        let paged = layout.blocks.is_some();
        // Logical slots per sequence: the table's in a paged store.
        let slots = |store_slots: usize| layout.blocks.as_ref().map_or(store_slots, Table::slots) as u32;
        match store {
            Store::Dense { keys, values } => launch!(qkv_dense_kernel(
                &client,
                count,
                cube_dim,
                arg(&qkv),
                arg(&q_weight),
                arg(&k_weight),
                arg(cos),
                arg(sin),
                arg(&q),
                arg(keys),
                arg(values),
                arg(&step),
                arg(&blocks),
                Strides4::launch(keys),
                Strides4::launch(values),
                slots(keys.meta.shape()[2]),
                table_width,
                block_shift,
                heads as u32,
                kv_heads as u32,
                row_width as u32,
                value_offset as u32,
                position,
                layout.position.stride(),
                layout.position.row_step(),
                layout.position.store_stride(),
                eps as f32,
                dim,
                has_norm,
                value_norm,
                on_device,
                paged,
                [f, w, keys.dtype.into()],
            )),
            Store::Int8 { k_codes, k_scales, v_codes, v_scales } => launch!(qkv_int8_kernel(
                &client,
                count,
                cube_dim,
                arg(&qkv),
                arg(&q_weight),
                arg(&k_weight),
                arg(cos),
                arg(sin),
                arg(&q),
                arg(k_codes),
                arg(k_scales),
                arg(v_codes),
                arg(v_scales),
                arg(&step),
                arg(&blocks),
                slots(k_codes.meta.shape()[2]),
                k_codes.meta.shape()[2] as u32,
                table_width,
                block_shift,
                heads as u32,
                kv_heads as u32,
                row_width as u32,
                value_offset as u32,
                position,
                layout.position.stride(),
                layout.position.row_step(),
                layout.position.store_stride(),
                eps as f32,
                dim,
                has_norm,
                value_norm,
                on_device,
                paged,
                [f, w],
            )),
        }
        q
    }
}

#[cfg(test)]
mod gpu {
    use super::QkvLayout;
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{rope, GemmaBackend, KvFormat, KvStore, RopeTables, StepPosition, StepRows};
    use burn::tensor::{DType, Distribution, Tensor, TensorData};

    /// Two independent stores holding the same earlier rows (the kernels write in place, so
    /// the reference needs its own buffers).
    fn stores<B: GemmaBackend>(
        format: KvFormat,
        shape: [usize; 4],
        dtype: DType,
        device: &B::Device,
    ) -> (KvStore<B>, KvStore<B>) {
        let keys = Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype).into_data();
        let values = Tensor::<B, 4>::random(shape, Distribution::Normal(0.0, 1.0), device).cast(dtype).into_data();
        let make = || {
            let (k, v) =
                (Tensor::<B, 4>::from_data(keys.clone(), device), Tensor::<B, 4>::from_data(values.clone(), device));
            B::kv_write(B::kv_zeros(shape, format, device), k, v, 0)
        };
        (make(), make())
    }

    /// Every slot of a store, dequantized to f32.
    fn contents<B: GemmaBackend>(store: &KvStore<B>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        B::kv_read(store, 0..store.shape()[2], DType::F32)
    }

    /// Where a test step's position comes from.
    #[derive(Debug, Clone, Copy, PartialEq)]
    enum Placement {
        Host,
        /// One device position for the batch.
        Device,
        /// A device position per sequence (`position + 3 b` for sequence `b`), the batch being
        /// the first sequences of a store with one more, which must stay as it was.
        PerSequence,
        /// As `PerSequence`, into a paged store: the sequences' slots in shuffled blocks of a
        /// pool with a spare block, which must stay as it was.
        Paged,
        /// Consecutive rows of one sequence (`position + b` for row `b`, a verify step), all in
        /// the first sequence of a store with one more, which must stay as it was.
        Consecutive,
    }

    /// Gemma's head shapes and odd ones, with and without QK-norm, dense and int8 stores, the
    /// first and last slot (rings that wrapped and stores that did not), batches of 1 to 3, the
    /// position passed at launch, read from a device buffer, read per sequence, per sequence
    /// into a paged store, and for consecutive rows of one sequence; the untouched slots must
    /// stay as they were.
    pub fn qkv_rope_append<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "qkv_rope_append");
        let cases = [
            (1, 4, 1, 256, 9, 521),
            (2, 8, 4, 128, 5, 5),
            (3, 3, 3, 12, 4, 2),
            (1, 2, 1, 64, 7, 41),
            (1, 1, 1, 32, 64, 0),
            // Gemma 4's full layers: head size 512, a quarter of the pairs rotating.
            (1, 8, 2, 512, 6, 700),
        ];
        use super::{HeadNorms, KvRows, ValueNorm};
        // (QK-norm with its value norm, rows after the queries, int8 store)
        let variants = [
            (Some(ValueNorm::None), KvRows::Projected, false),
            (None, KvRows::Projected, false),
            (Some(ValueNorm::None), KvRows::Projected, true),
            (None, KvRows::Projected, true),
            (Some(ValueNorm::Unweighted), KvRows::Projected, false),
            (Some(ValueNorm::Unweighted), KvRows::FromKeys, false),
            (Some(ValueNorm::Unweighted), KvRows::FromKeys, true),
            (Some(ValueNorm::Unweighted), KvRows::Shared, false),
        ];
        let placements =
            [Placement::Host, Placement::Device, Placement::PerSequence, Placement::Paged, Placement::Consecutive];
        for ((batch, heads, kv_heads, dim, slots, position), placement) in
            cases.into_iter().flat_map(|case| placements.map(|p| (case, p)))
        {
            let slot = position % slots;
            let last = position + 3 * (batch - 1);
            let step = match placement {
                Placement::Host => StepPosition::Host(position),
                Placement::Device => {
                    let values = Tensor::<B, 1, burn::tensor::Int>::from_data([position as i64], device);
                    StepPosition::Device { values, bound: position + 3, rows: StepRows::Sequences }
                }
                Placement::PerSequence | Placement::Paged => {
                    let own: Vec<i64> = (0..batch).map(|b| (position + 3 * b) as i64).collect();
                    let values = Tensor::<B, 1, burn::tensor::Int>::from_data(TensorData::new(own, [batch]), device);
                    StepPosition::Device { values, bound: last + 2, rows: StepRows::Sequences }
                }
                Placement::Consecutive => {
                    let values = Tensor::<B, 1, burn::tensor::Int>::from_data([position as i64], device);
                    StepPosition::Device { values, bound: position + batch + 1, rows: StepRows::Consecutive }
                }
            };
            let store_batch = match placement {
                Placement::PerSequence | Placement::Consecutive => batch + 1,
                _ => batch,
            };
            // Paged: blocks of the largest of 4, 3, 2 or 1 slots dividing `slots`, sequence
            // `b`'s `i`-th at `(b * width + i) * 5 + 1` modulo the pool (one block spare).
            let block = [4, 3, 2, 1].into_iter().find(|b| slots.is_multiple_of(*b)).unwrap_or(1);
            let width = slots / block;
            let pool = batch * width + 1;
            let stride = if pool.is_multiple_of(5) { 1 } else { 5 };
            let rows: Vec<Vec<u32>> = (0..batch)
                .map(|b| (0..width).map(|i| (((b * width + i) * stride + 1) % pool) as u32).collect())
                .collect();
            let blocks = (placement == Placement::Paged).then(|| crate::BlockTable::from_rows(&rows, block, device));
            let store_shape = match blocks {
                Some(_) => [pool, kv_heads, block, dim],
                None => [store_batch, kv_heads, slots, dim],
            };
            let positions = last + 5;
            let partial = if dim == 512 { 0.25 } else { 1.0 };
            let frequencies =
                rope::Frequencies { head_dim: dim, theta: 10_000.0, factor: 1.0, partial_rotary_factor: partial };
            let (cos, sin) = rope::tables(positions, &frequencies);
            let table =
                |v: Vec<f32>| Tensor::<B, 2>::from_data(TensorData::new(v, [positions, dim / 2]), (device, DType::F32));
            let weight = || Tensor::<B, 1>::random([dim], Distribution::Normal(0.0, 0.5), device);
            for (norm, kv, int8) in variants {
                let layout = QkvLayout {
                    heads,
                    kv_heads,
                    head_dim: dim,
                    kv,
                    rope: RopeTables { cos: table(cos.clone()), sin: table(sin.clone()) },
                    position: step.clone(),
                    norm: norm.map(|value| HeadNorms { query: weight(), key: weight(), eps: 1e-6, value }),
                    blocks: blocks.clone(),
                };
                let qkv =
                    Tensor::<B, 2>::random([batch, layout.width()], Distribution::Normal(0.0, 2.0), device).cast(dtype);
                let format = if int8 { KvFormat::Int8 } else { KvFormat::Dense(dtype) };
                let (store, reference_store) = stores::<B>(format, store_shape, dtype, device);
                let (q, store) = B::qkv_rope_append(qkv.clone(), &layout, store).expect("the step position reads back");
                let (q_ref, reference_store) = super::reference(qkv.cast(DType::F32), &layout, reference_store)
                    .expect("the step position reads back");
                let what = format!(
                    "qkv b{batch} h{heads}/{kv_heads} d{dim} slot {slot}/{slots} pos {position} norm {norm:?} {kv:?} int8 {int8} position {placement:?}"
                );
                assert_eq!(q.dtype(), dtype, "{what}");
                assert_close(q, q_ref, tolerance(dtype), &format!("{what}: queries"));
                let ((k, v), (k_ref, v_ref)) = (contents(&store), contents(&reference_store));
                if int8 {
                    assert_within_a_step(k, k_ref, dim, tolerance(dtype), &format!("{what}: keys"));
                    assert_within_a_step(v, v_ref, dim, tolerance(dtype), &format!("{what}: values"));
                } else {
                    assert_close(k, k_ref, tolerance(dtype), &format!("{what}: keys"));
                    assert_close(v, v_ref, tolerance(dtype), &format!("{what}: values"));
                }
            }
        }
    }

    /// int8 rows (`dim` values each) against the reference's: the kernel rounds from values in
    /// the activation dtype and the reference from f32 ones, so a value at a rounding boundary may
    /// take the neighbouring code: each value must be within one quantization step of its row
    /// (`max|row| / 127`) plus `tol * (1 + |expected|)`, and finite.
    fn assert_within_a_step<B: GemmaBackend>(
        got: Tensor<B, 4>,
        expected: Tensor<B, 4>,
        dim: usize,
        tol: f32,
        what: &str,
    ) {
        assert_eq!(got.dims(), expected.dims(), "{what}: shape");
        let got = got.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data");
        let expected = expected.cast(DType::F32).into_data().to_vec::<f32>().expect("f32 data");
        assert!(got.iter().chain(&expected).all(|v| v.is_finite()), "{what}: non-finite values");
        let mut worst = 0.0f32;
        for (row, (g, e)) in got.chunks_exact(dim).zip(expected.chunks_exact(dim)).enumerate() {
            let step = e.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0;
            for (i, (g, e)) in g.iter().zip(e).enumerate() {
                let allowed = step * 1.001 + tol * (1.0 + e.abs());
                let err = (g - e).abs();
                worst = worst.max(err / allowed);
                assert!(err <= allowed, "{what}: row {row} value {i}: got {g}, expected {e} (one step {step:.3e})");
            }
        }
        println!("{what}: worst error {worst:.3} of the allowed step");
    }

    gpu_tests!(qkv_rope_append_matches_reference => qkv_rope_append);
}
