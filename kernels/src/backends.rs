//! Which implementation each backend gets.

use crate::{
    cube,
    quant::device::packed,
    quant::kquant::{gemv::KPacked, HostKQuant, KQuantFormat, KQuantMatrix},
    quant::CodeLayout,
    AddNorm, AttentionOptions, Draws, Epilogue, ExpertProduct, ExpertWeights, Experts, GateUpLayout, GemmaBackend,
    HeadChoice, HostMatrix, Int8Kv, KvFormat, KvStore, KvView, Matrix, QkvLayout, QuantError, QuantizedMatrix,
    ReadBackError, ReservedMemory, RopeTables, Routes, SamplingParams, StepPosition,
};
use burn::module::Param;
use burn::tensor::{backend::Backend, DType, Int, Tensor, TensorData};
use burn_cubecl::{tensor::CubeTensor, BoolElement, CubeBackend, CubeRuntime, FloatElement, IntElement};
use std::ops::Range;

/// Every CubeCL runtime (CUDA, ROCm/HIP, wgpu) shares one implementation: the kernels in each
/// operation's module.
impl<R, F, I, BT> GemmaBackend for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    /// Converted to Q8/Q4 (see [`crate::PreferredBlocks::Converted`]).
    fn preferred_blocks() -> crate::PreferredBlocks {
        crate::PreferredBlocks::Converted
    }

    /// bf16 on CUDA (matrix units), f32 elsewhere.
    fn preferred_dtype(_device: &Self::Device) -> DType {
        #[cfg(feature = "cuda")]
        if is_cuda::<R>() {
            return DType::BF16;
        }
        DType::F32
    }

    /// Dense weights packed; quantized codes packed into `u32` words, scales in f16 where the
    /// device has it. GGUF's Q4_K, Q5_K and Q6_K blocks are kept with their own bits
    /// ([`crate::quant::kquant`]); other GGUF blocks are converted to the closest of Q8 and Q4.
    fn upload_matrix(matrix: HostMatrix<Self>, device: &Self::Device) -> Result<Matrix<Self>, QuantError> {
        let scale_dtype = if Self::supports_dtype(device, DType::F16) { DType::F16 } else { DType::F32 };
        Ok(match matrix {
            HostMatrix::Dense(w) => Matrix::Dense(Param::from_tensor(cube::tensor(cube::float(w)))),
            HostMatrix::Quantized(host) => {
                Matrix::Quantized(QuantizedMatrix::upload(&host, CodeLayout::Words, scale_dtype, device))
            }
            HostMatrix::Ggml(blocks) if KQuantFormat::of(blocks.dtype()).is_some() => {
                Matrix::KQuant(KQuantMatrix::upload(&HostKQuant::from_blocks(&blocks)?, scale_dtype, device))
            }
            HostMatrix::Ggml(blocks) => {
                return Self::upload_matrix(HostMatrix::Quantized(blocks.to_quantized()?), device)
            }
        })
    }

    /// Quantized weights with 3 to 64 rows in f16/bf16 on CUDA with cooperative matrices go
    /// to the quantized mma kernel ([`crate::quant::mma`], the epilogue in its reduction);
    /// otherwise decode-sized inputs (at most `GEMV_MAX_ROWS` rows) go to the matrix-vector
    /// kernels, the epilogue inside them (one launch, the GELU halving what is written); larger
    /// ones to the prefill GEMM on the matrix units ([`crate::gemm`]; quantized weights
    /// dequantized into a transient dense matrix first), then one GELU kernel over the
    /// interleaved product. K-quant matrices take the matrix-vector kernel up to `GEMV_MAX_ROWS`
    /// rows and the dequantized prefill GEMM above.
    fn project(x: Tensor<Self, 2>, weight: &Matrix<Self>, epilogue: Epilogue) -> Tensor<Self, 2> {
        let [rows, cols] = x.dims();
        let gemv_rows = rows <= crate::linear::GEMV_MAX_ROWS;
        // A few rows to a few dozen of quantized weights: each block read once, multiplied on
        // the matrix units.
        let mma_rows = crate::quant::mma::takes(&R::client(&x.device()), x.dtype(), rows, cols);
        // Matrices whose product a kernel writes straight into columns of an output (the
        // quantized mma kernel, the matrix-vector kernels), epilogue included.
        // The direct kernels index their inputs unchecked: only a matching input width reaches
        // them (a mismatch takes the general path, where the matmul checks the shapes).
        let direct = |w: &Matrix<Self>| {
            w.dims()[1] == cols
                && match w {
                    Matrix::Dense(w) => gemv_rows && x.dtype() == w.val().dtype(),
                    Matrix::Quantized(_) => mma_rows || gemv_rows,
                    Matrix::KQuant(_) => gemv_rows,
                    Matrix::Stacked(_) | Matrix::Ggml(_) => false,
                }
        };
        let into_columns = |x: &CubeTensor<R>, w: &Matrix<Self>, epilogue: Epilogue, out: &CubeTensor<R>, at: usize| {
            match w {
                Matrix::Dense(w) => {
                    crate::linear::kernel::gemv_into(x.clone(), cube::float(w.val()), epilogue, out, at)
                }
                Matrix::Quantized(w) if mma_rows => {
                    crate::quant::mma::product_into(x.clone(), &packed(w), epilogue, out, at)
                }
                Matrix::Quantized(w) => crate::quant::kernel::gemv_into(x.clone(), &packed(w), epilogue, out, at),
                Matrix::KQuant(w) => crate::quant::kquant::gemv::gemv_into(x.clone(), &kpacked(w), epilogue, out, at),
                // Not direct: the callers' guards keep these out.
                Matrix::Stacked(_) | Matrix::Ggml(_) => {}
            }
        };
        let product = match weight {
            Matrix::Dense(_) | Matrix::Quantized(_) | Matrix::KQuant(_) if direct(weight) => {
                let x = cube::float(x);
                let out = crate::cube::empty(&x, [rows, epilogue.out_width(weight.dims()[0])], x.dtype);
                into_columns(&x, weight, epilogue, &out, 0);
                return cube::tensor(out);
            }
            // Each block's product writes its own columns of one output.
            Matrix::Stacked(parts) if parts.iter().all(|p| direct(&p.matrix())) => {
                let x = cube::float(x);
                let out = crate::cube::empty(&x, [rows, weight.dims()[0]], x.dtype);
                let mut offset = 0;
                for part in parts {
                    let part = part.matrix();
                    into_columns(&x, &part, Epilogue::Identity, &out, offset);
                    offset += part.dims()[0];
                }
                cube::tensor(out)
            }
            Matrix::Dense(w) if x.dtype() == w.val().dtype() => {
                crate::graph::unsupported(|| "a prefill product".into());
                prefill_product(x, w.val())
            }
            Matrix::Dense(w) => {
                crate::graph::unsupported(|| "a projection through Burn's matmul".into());
                crate::linear::reference(x, w.val())
            }
            Matrix::Quantized(w) => {
                crate::graph::unsupported(|| "a prefill product".into());
                let w = packed(w);
                dequantized_product(x, weight.dims(), |rows, dtype| {
                    crate::quant::kernel::dequantize_rows(&w, rows, dtype)
                })
            }
            Matrix::KQuant(w) => {
                crate::graph::unsupported(|| "a prefill product".into());
                let w = kpacked(w);
                dequantized_product(x, weight.dims(), |rows, dtype| {
                    crate::quant::kquant::dequant::dequantize_rows(&w, rows, dtype)
                })
            }
            // Only built by the Candle backend's upload; multiplied on the host if handed here.
            Matrix::Ggml(w) => {
                crate::graph::unsupported(|| "a GGUF block matrix multiplied on the host".into());
                w.product(x, Epilogue::Identity)
            }
            Matrix::Stacked(parts) => {
                crate::graph::unsupported(|| "a stacked projection joined by Burn".into());
                Tensor::cat(
                    parts.iter().map(|p| Self::project(x.clone(), &p.matrix(), Epilogue::Identity)).collect(),
                    1,
                )
            }
        };
        match epilogue {
            Epilogue::Identity => product,
            Epilogue::GeluPairs => {
                cube::tensor(crate::gelu::kernel::gelu_mul_joined(cube::float(product), GateUpLayout::Pairs))
            }
        }
    }

    /// One kernel launch per table (dense or quantized); a table mixing the two (which the
    /// loader never builds) gathers from the quantized blocks dequantized whole.
    fn embed(table: &[Matrix<Self>], ids: Tensor<Self, 2, Int>, scale: f64, dtype: DType) -> Tensor<Self, 3> {
        if let Some(blocks) = every_block(table, |b| if let Matrix::Quantized(q) = b { Some(packed(q)) } else { None })
        {
            return cube::tensor(crate::quant::kernel::embed(&blocks, cube::int(ids), scale, dtype));
        }
        if let Some(blocks) = every_block(table, |b| if let Matrix::KQuant(q) = b { Some(kpacked(q)) } else { None }) {
            return cube::tensor(crate::quant::kquant::dequant::embed(&blocks, cube::int(ids), scale, dtype));
        }
        if table.iter().any(|b| matches!(b, Matrix::Dense(w) if w.val().dtype() != dtype)) {
            crate::graph::unsupported(|| "an embedding cast by Burn".into());
        }
        let blocks = table
            .iter()
            .map(|block| match block {
                Matrix::Dense(w) => cube::float(w.val()),
                Matrix::Quantized(q) => crate::quant::kernel::dequantize(&packed(q), dtype),
                Matrix::KQuant(q) => crate::quant::kquant::dequant::dequantize(&kpacked(q), dtype),
                Matrix::Stacked(_) | Matrix::Ggml(_) => {
                    crate::graph::unsupported(|| "a stacked or host-held embedding table made dense".into());
                    cube::float(block.dense_reference(dtype, &ids.device()))
                }
            })
            .collect();
        cube::tensor::<R, F, I, BT, 3>(crate::embedding::kernel::embed(blocks, cube::int(ids), scale)).cast(dtype)
    }

    fn rms_norm<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 1>, eps: f64) -> Tensor<Self, D> {
        cube::tensor(crate::rms_norm::kernel::rms_norm(cube::float(x), cube::float(weight), eps))
    }

    fn add_rms_norm(
        residual: Tensor<Self, 3>,
        x: Tensor<Self, 3>,
        norms: &AddNorm<Self>,
    ) -> (Tensor<Self, 3>, Tensor<Self, 3>) {
        let norms = crate::rms_norm::kernel::AddNorm {
            post: norms.post.clone().map(cube::float),
            weight: cube::float(norms.weight.clone()),
            eps: norms.eps,
            scale: norms.scale,
            out_dtype: norms.out_dtype,
        };
        let (sum, normed) = crate::rms_norm::kernel::add_rms_norm(cube::float(residual), cube::float(x), norms);
        (cube::tensor(sum), cube::tensor(normed))
    }

    fn gelu_mul(x: Tensor<Self, 3>, layout: GateUpLayout) -> Tensor<Self, 3> {
        cube::tensor(crate::gelu::kernel::gelu_mul_joined(cube::float(x), layout))
    }

    fn gelu_gate(gate: Tensor<Self, 3>, inputs: Tensor<Self, 4>, layer: usize) -> Tensor<Self, 3> {
        cube::tensor(crate::gelu::kernel::gelu_gate(cube::float(gate), cube::float(inputs), layer))
    }

    fn qk_norm_rope(
        x: Tensor<Self, 4>,
        tables: &RopeTables<Self>,
        position: usize,
        qk_norm: Option<(Tensor<Self, 1>, f64)>,
    ) -> Tensor<Self, 4> {
        let norm = qk_norm.map(|(w, eps)| (cube::float(w), eps));
        cube::tensor(crate::rope::kernel::rope(
            cube::float_strided(x),
            cube::float(tables.cos.clone().cast(DType::F32)),
            cube::float(tables.sin.clone().cast(DType::F32)),
            position,
            norm,
        ))
    }

    /// The kernels write the store's buffers in place (the store owns them).
    fn qkv_rope_append(
        qkv: Tensor<Self, 2>,
        layout: &QkvLayout<Self>,
        store: KvStore<Self>,
    ) -> Result<(Tensor<Self, 4>, KvStore<Self>), ReadBackError> {
        use crate::qkv::kernel::{qkv_rope_append, Layout, Store};
        if layout.blocks.as_ref().is_some_and(|t| !crate::kv::paged::kernel::kernels_take(t.block_size)) {
            // Blocks of a size the kernel does not split: each sequence's block written alone.
            return crate::qkv::reference(qkv, layout, store);
        }
        let args = Layout {
            heads: layout.heads,
            kv_heads: layout.kv_heads,
            head_dim: layout.head_dim,
            kv: layout.kv,
            cos: cube::float(layout.rope.cos.clone().cast(DType::F32)),
            sin: cube::float(layout.rope.sin.clone().cast(DType::F32)),
            position: position(&layout.position),
            blocks: layout.blocks.as_ref().map(table),
            norm: layout.norm.clone().map(|n| (cube::float(n.query), cube::float(n.key), n.eps, n.value)),
        };
        let qkv = cube::float(qkv);
        match store {
            KvStore::Dense { keys, values } => {
                let (keys, values) = (cube::float_strided(keys), cube::float_strided(values));
                let q = qkv_rope_append(qkv, &args, Store::Dense { keys: &keys, values: &values });
                Ok((cube::tensor(q), KvStore::Dense { keys: cube::tensor(keys), values: cube::tensor(values) }))
            }
            KvStore::Int8 { keys, values } => {
                let (k_codes, k_scales) = (cube::int(keys.codes), cube::float(keys.scales));
                let (v_codes, v_scales) = (cube::int(values.codes), cube::float(values.scales));
                let store =
                    Store::Int8 { k_codes: &k_codes, k_scales: &k_scales, v_codes: &v_codes, v_scales: &v_scales };
                let q = qkv_rope_append(qkv, &args, store);
                let keys =
                    Int8Kv { codes: cube::int_tensor(k_codes), scales: cube::tensor(k_scales), shape: keys.shape };
                let values =
                    Int8Kv { codes: cube::int_tensor(v_codes), scales: cube::tensor(v_scales), shape: values.shape };
                Ok((cube::tensor(q), KvStore::Int8 { keys, values }))
            }
        }
    }

    fn softcap<const D: usize>(x: Tensor<Self, D>, cap: f64) -> Tensor<Self, D> {
        cube::tensor(crate::softcap::kernel::softcap(cube::float(x), cap))
    }

    /// A [`KvView::Decode`] with its position on the device attends to the whole store, the
    /// decode kernel reading the position (and so the visible slots) when it runs.
    fn grouped_attention(
        q: Tensor<Self, 4>,
        kv: KvView<'_, Self>,
        options: &AttentionOptions,
    ) -> Result<Tensor<Self, 4>, ReadBackError> {
        use crate::attention::kernel::{attention, Kv};
        let int8 = |keys: &Int8Kv<Self>, values: &Int8Kv<Self>, len| Kv::Int8 {
            k_codes: cube::int(keys.codes.clone()),
            k_scales: cube::float(keys.scales.clone()),
            v_codes: cube::int(values.codes.clone()),
            v_scales: cube::float(values.scales.clone()),
            len,
        };
        let dense = |keys: Tensor<Self, 4>, values: Tensor<Self, 4>| Kv::Dense {
            k: cube::float_strided(keys),
            v: cube::float_strided(values),
        };
        // Every slot of a store (a decode position on the device chooses the visible ones).
        let whole = |store: &KvStore<Self>| match store {
            KvStore::Dense { keys, values } => dense(keys.clone(), values.clone()),
            KvStore::Int8 { keys, values } => int8(keys, values, store.shape()[2]),
        };
        if let KvView::Dense { keys, values } = &kv {
            // Heads the flash kernel does not tile, padded with zeros to a size it does: the
            // scores and the scale are unchanged, and the padded value columns come out zero and
            // are cut off.
            let [b, hq, tq, dim] = q.dims();
            if let Some(padded) = crate::attention::flash::padded_dim(&cube::float_strided(q.clone())) {
                let pad = |t: Tensor<Self, 4>| {
                    let [b, h, len, _] = t.dims();
                    let zeros = Tensor::<Self, 4>::zeros([b, h, len, padded - dim], (&t.device(), t.dtype()));
                    Tensor::cat(vec![t, zeros], 3)
                };
                let kv = KvView::Dense { keys: pad(keys.clone()), values: pad(values.clone()) };
                let out = Self::grouped_attention(pad(q), kv, options)?;
                return Ok(out.slice([0..b, 0..hq, 0..tq, 0..dim]));
            }
        }
        let q = cube::float_strided(q);
        match kv {
            KvView::Dense { keys, values } => Ok(cube::tensor(attention(q, dense(keys, values), options, None, None)?)),
            KvView::Int8 { keys, values, len } => {
                Ok(cube::tensor(attention(q, int8(keys, values, len), options, None, None)?))
            }
            KvView::Decode { store, position, blocks: Some(blocks) } => {
                let kv = whole(store);
                let kernel = matches!(position, StepPosition::Device { .. })
                    && crate::kv::paged::kernel::kernels_take(blocks.block_size)
                    && crate::attention::kernel::decode_kernel_applies(&q, &kv);
                if kernel {
                    return Ok(cube::tensor(attention(
                        q,
                        kv,
                        options,
                        Some(self::position(&position)),
                        Some(table(blocks)),
                    )?));
                }
                // A position on the host, a shape only the one-mask kernels take, or blocks of a
                // size the kernels do not split: the sequences' slots gathered.
                let own = crate::kv::paged::gather_reference(store, blocks, q.meta.shape()[0]);
                Self::grouped_attention(
                    cube::tensor(q),
                    KvView::Decode { store: &own, position, blocks: None },
                    options,
                )
            }
            KvView::Decode { store, position: StepPosition::Host(p), blocks: None } => {
                let (visible, mask) = crate::step::decode_visible(p, store.shape()[2], options.mask.window);
                let options = AttentionOptions { mask, ..*options };
                let kv = match store {
                    KvStore::Dense { keys, values } => {
                        let slots = burn::tensor::s![.., .., 0..visible, ..];
                        dense(keys.clone().slice(slots), values.clone().slice(slots))
                    }
                    KvStore::Int8 { keys, values } => int8(keys, values, visible),
                };
                Ok(cube::tensor(attention(q, kv, &options, None, None)?))
            }
            KvView::Decode { store, position: device @ StepPosition::Device { .. }, blocks: None } => {
                let kv = whole(store);
                if device.per_sequence() && !crate::attention::kernel::decode_kernel_applies(&q, &kv) {
                    // Positions of their own, and a shape only the one-mask kernels take: one
                    // sequence at a time, at its position read back.
                    let positions = device.resolve_rows(q.meta.shape()[0])?;
                    return crate::attention::decode_each_sequence(
                        cube::tensor(q),
                        store,
                        (&device, &positions),
                        options,
                    );
                }
                Ok(cube::tensor(attention(q, kv, options, Some(position(&device)), None)?))
            }
        }
    }

    /// int8: four codes per `u32` word, `[batch, kv_heads, slots, head_dim / 4]`.
    fn kv_zeros(shape: [usize; 4], format: KvFormat, device: &Self::Device) -> KvStore<Self> {
        let [b, h, slots, dim] = shape;
        let int8 = || Int8Kv {
            codes: Tensor::zeros([b, h, slots, dim / 4], (device, DType::U32)),
            scales: Tensor::zeros([b, h, slots], (device, DType::F32)),
            shape,
        };
        match format {
            KvFormat::Dense(_) => crate::kv::zeros_reference(shape, format, device),
            KvFormat::Int8 => KvStore::Int8 { keys: int8(), values: int8() },
        }
    }

    /// Written in place into the store's buffers (cast, or quantized for int8), even where a
    /// recorded decode step also holds them.
    fn kv_write(store: KvStore<Self>, keys: Tensor<Self, 4>, values: Tensor<Self, 4>, slot: usize) -> KvStore<Self> {
        let write = |cache: Int8Kv<Self>, x: Tensor<Self, 4>| {
            let (codes, scales) = (cube::int(cache.codes), cube::float(cache.scales));
            crate::kv::int8::kernel::store(cube::float_strided(x), &codes, &scales, slot);
            Int8Kv { codes: cube::int_tensor(codes), scales: cube::tensor(scales), shape: cache.shape }
        };
        match store {
            KvStore::Dense { keys: cache_k, values: cache_v } => {
                let (cache_k, cache_v) = (cube::float_strided(cache_k), cube::float_strided(cache_v));
                crate::kv::dense::kernel::write(cube::float_strided(keys), &cache_k, slot);
                crate::kv::dense::kernel::write(cube::float_strided(values), &cache_v, slot);
                KvStore::Dense { keys: cube::tensor(cache_k), values: cube::tensor(cache_v) }
            }
            KvStore::Int8 { keys: cache_k, values: cache_v } => {
                KvStore::Int8 { keys: write(cache_k, keys), values: write(cache_v, values) }
            }
        }
    }

    fn kv_read(store: &KvStore<Self>, range: Range<usize>, dtype: DType) -> (Tensor<Self, 4>, Tensor<Self, 4>) {
        let read = |cache: &Int8Kv<Self>| {
            let (codes, scales) = (cube::int(cache.codes.clone()), cube::float(cache.scales.clone()));
            cube::tensor(crate::kv::int8::kernel::load(&codes, &scales, range.start, range.len(), dtype))
        };
        match store {
            KvStore::Dense { .. } => crate::kv::read_reference(store, range.clone(), dtype),
            KvStore::Int8 { keys, values } => (read(keys), read(values)),
        }
    }

    /// One kernel per tensor, written in place (keys and values; int8: codes and scales).
    fn kv_scatter_blocks(
        store: KvStore<Self>,
        rows: &KvStore<Self>,
        blocks: &[u32],
        block_size: usize,
        len: usize,
    ) -> KvStore<Self> {
        let [_, _, slots, _] = rows.shape();
        let used_blocks = crate::kv::paged::blocks_used(slots, blocks.len(), block_size, len);
        let used = (used_blocks * block_size).min(slots);
        // The kernel reads the block size from the store; a store of other blocks, or a format
        // mismatch, takes the reference (which leaves a mismatched store as it was).
        if used == 0 || store.shape()[2] != block_size || store.check_blocks(rows).is_err() {
            return crate::kv::paged::scatter_sequence(store, rows, blocks, block_size, len);
        }
        let device = match rows {
            KvStore::Dense { keys, .. } => keys.device(),
            KvStore::Int8 { keys, .. } => keys.codes.device(),
        };
        let table =
            crate::kv::paged::BlockTable::<Self>::from_rows(&[blocks[..used_blocks].to_vec()], block_size, &device);
        let ids = cube::int(table.blocks);
        let put = |one: CubeTensor<R>, pool: CubeTensor<R>| crate::kv::paged::kernel::scatter(&one, &pool, &ids, used);
        let dense = |one: &Tensor<Self, 4>, pool: &Tensor<Self, 4>| {
            put(cube::float_strided(one.clone()), cube::float_strided(pool.clone()));
        };
        let int8 = |one: &Int8Kv<Self>, pool: &Int8Kv<Self>| {
            put(cube::int(one.codes.clone()), cube::int(pool.codes.clone()));
            let scales = |t: &Tensor<Self, 3>| cube::float_strided(t.clone().unsqueeze_dim::<4>(3));
            put(scales(&one.scales), scales(&pool.scales));
        };
        match (&store, rows) {
            (KvStore::Dense { keys, values }, KvStore::Dense { keys: k, values: v }) => {
                dense(k, keys);
                dense(v, values);
            }
            (KvStore::Int8 { keys, values }, KvStore::Int8 { keys: k, values: v }) => {
                int8(k, keys);
                int8(v, values);
            }
            // `check_blocks` passed: the formats are the same.
            _ => {}
        }
        store
    }

    /// Stacked in one device matrix (GGUF blocks converted as [`Self::upload_matrix`] converts
    /// them) where its largest buffer fits the device's; one matrix per expert otherwise.
    fn upload_experts(
        stacked: HostMatrix<Self>,
        count: usize,
        device: &Self::Device,
    ) -> Result<Experts<Self>, QuantError> {
        let rows = crate::experts::stacked_rows(&stacked, count)?;
        let stacked = match stacked {
            HostMatrix::Ggml(blocks) => HostMatrix::Quantized(blocks.to_quantized()?),
            other => other,
        };
        let largest = match &stacked {
            HostMatrix::Dense(t) => t.shape().num_elements() * t.dtype().size(),
            HostMatrix::Quantized(q) => q.rows * q.cols * q.format.bits() / 8,
            HostMatrix::Ggml(q) => q.bytes().len(),
        };
        if largest > Self::max_buffer_bytes(device) {
            return crate::experts::upload_reference(stacked, count, device);
        }
        let matrix = Self::upload_matrix(stacked, device)?;
        Ok(Experts { weights: ExpertWeights::Stacked(matrix), count, rows })
    }

    fn route_experts(
        scores: Tensor<Self, 2>,
        per_expert_scale: Tensor<Self, 1>,
        top_k: usize,
    ) -> Result<Routes<Self>, crate::ReadBackError> {
        let [_, experts] = scores.dims();
        if top_k == 0 || top_k > experts {
            return crate::experts::route_reference(scores, per_expert_scale, top_k);
        }
        let (ids, weights) = crate::experts::kernel::route(cube::float(scores), cube::float(per_expert_scale), top_k);
        Ok(Routes { ids: cube::int_tensor(ids), weights: cube::tensor(weights) })
    }

    /// Stacked experts: up to [`crate::linear::GEMV_MAX_ROWS`] tokens through the routed
    /// kernels, more (prompts) grouped by expert on the device; neither reads the routes back.
    /// Experts held one matrix each: grouped on the host ([`crate::experts::project_reference`]).
    fn project_experts(
        x: Tensor<Self, 2>,
        experts: &Experts<Self>,
        routes: &Routes<Self>,
        product: ExpertProduct,
        dtype: DType,
    ) -> Result<Tensor<Self, 2>, crate::ReadBackError> {
        let (tokens, top_k) = routes.shape();
        let units = crate::gemm::kernel::has_matrix_units(&R::client(&x.device()), dtype);
        let path = crate::experts::ExpertPath::choose(tokens, top_k, experts.count, units);
        crate::experts::project_on(x, experts, routes, product, dtype, path)
    }

    /// Tables of Q4/Q8 blocks, for the rows a decode step multiplies with the matrix-vector
    /// kernel, take the fused kernels of [`crate::greedy`] (logits capped in the product's
    /// store, each cube's best logit beside them, one small kernel picking each row's best);
    /// other tables the separate product, softcap and sampler.
    fn project_greedy(
        x: Tensor<Self, 2>,
        table: &[Matrix<Self>],
        cap: Option<f64>,
    ) -> Result<HeadChoice<Self>, ReadBackError> {
        let [rows, cols] = x.dims();
        // The rows `project` would give the quantized mma kernel stay with it.
        let gemv = rows <= crate::linear::GEMV_MAX_ROWS
            && !crate::quant::mma::takes(&R::client(&x.device()), x.dtype(), rows, cols);
        let blocks = every_block(table, |b| match b {
            Matrix::Quantized(q) if b.dims()[1] == cols => Some(packed(q)),
            _ => None,
        });
        match blocks {
            Some(blocks) if gemv => {
                let (logits, ids) = crate::greedy::kernel::head_greedy(cube::float(x), &blocks, cap, I::dtype());
                Ok(HeadChoice { logits: cube::tensor(logits), ids: cube::int_tensor(ids) })
            }
            _ => crate::greedy::reference(x, table, cap),
        }
    }

    /// The logits are read in their own dtype; greedy reads no draws.
    fn sample(
        logits: Tensor<Self, 2>,
        params: &SamplingParams,
        draws: Draws<'_, Self>,
    ) -> Result<Tensor<Self, 1, Int>, crate::ReadBackError> {
        let [batch, _] = logits.dims();
        let logits = cube::float(logits);
        let uniform = match draws {
            // Greedy never reads the draws: the logits stand in, so decoding uploads nothing.
            _ if params.temperature == 0.0 => logits.clone(),
            Draws::Device(draws) => cube::float(draws),
            Draws::Host(draws) => {
                let mut draws = draws.to_vec();
                draws.resize(batch, 0.0);
                let device = logits.device.clone();
                cube::float(Tensor::<Self, 1>::from_data(TensorData::new(draws, [batch]), (&device, DType::F32)))
            }
        };
        Ok(cube::int_tensor(crate::sampling::kernel::sample(logits, uniform, params, I::dtype())))
    }
}

/// A block table as the kernels take it.
fn table<R, F, I, BT>(t: &crate::BlockTable<CubeBackend<R, F, I, BT>>) -> crate::kv::paged::kernel::Table<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    crate::kv::paged::kernel::Table { blocks: cube::int(t.blocks.clone()), width: t.width(), block_size: t.block_size }
}

/// A step position as the kernels take it.
fn position<R, F, I, BT>(p: &StepPosition<CubeBackend<R, F, I, BT>>) -> crate::step::kernel::Position<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    match p {
        StepPosition::Host(p) => crate::step::kernel::Position::Host(*p),
        StepPosition::Device { values, bound, rows } => {
            crate::step::kernel::Position::Device { values: cube::int(values.clone()), bound: *bound, rows: *rows }
        }
    }
}

impl<R, F, I, BT> ReservedMemory for CubeBackend<R, F, I, BT>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    fn memory_reserved(device: &Self::Device) -> Option<u64> {
        R::client(device).memory_usage().ok().map(|usage| usage.bytes_reserved)
    }

    /// The largest buffer is CubeCL's page limit (wgpu: the adapter's buffer limit); CUDA's
    /// available memory is the device's (four pages, as CubeCL sizes them from the total) less
    /// what this process holds. wgpu does not report device memory.
    fn memory_limits(device: &Self::Device) -> crate::MemoryLimits {
        let page = R::client(device).properties().memory.max_page_size;
        #[cfg(feature = "cuda")]
        if is_cuda::<R>() {
            let held = Self::memory_reserved(device).unwrap_or(0);
            return crate::MemoryLimits {
                largest_buffer: Some(page),
                available: Some(page.saturating_mul(4).saturating_sub(held)),
            };
        }
        crate::MemoryLimits { largest_buffer: Some(page), available: None }
    }

    fn max_buffer_bytes(device: &Self::Device) -> usize {
        #[cfg(feature = "cuda")]
        if is_cuda::<R>() {
            return R::client(device).properties().memory.max_page_size as usize;
        }
        let _ = device;
        1 << 27
    }
}

/// Whether `R` is CubeCL's CUDA runtime.
#[cfg(feature = "cuda")]
fn is_cuda<R: CubeRuntime>() -> bool {
    std::any::TypeId::of::<R>() == std::any::TypeId::of::<cubecl::cuda::CudaRuntime>()
}

/// The device tensors of a quantized matrix as kernel arguments.
/// `x @ w^T` by the prefill GEMM ([`crate::gemm`]); a shape CubeCL refuses for the device's
/// kernel (none of Gemma's) through Burn's matmul, as every prefill product ran before.
fn prefill_product<R, F, I, BT>(
    x: Tensor<CubeBackend<R, F, I, BT>, 2>,
    w: Tensor<CubeBackend<R, F, I, BT>, 2>,
) -> Tensor<CubeBackend<R, F, I, BT>, 2>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    match crate::gemm::kernel::prefill(cube::float(x.clone()), cube::float(w.clone())) {
        Ok(out) => cube::tensor(out),
        Err(_) => crate::linear::reference(x, w),
    }
}

/// `part` of every block of a table, where every block has one (and there is a block).
fn every_block<B: burn::tensor::backend::Backend, T>(
    table: &[Matrix<B>],
    part: impl Fn(&Matrix<B>) -> Option<T>,
) -> Option<Vec<T>> {
    table.iter().map(part).collect::<Option<Vec<T>>>().filter(|b| !b.is_empty())
}

/// `x @ w^T` for a block-quantized `w` of `dims` (`[out, in]`): its rows dequantized into
/// transient dense matrices (`dequantize(rows, dtype)`) no larger than one buffer of the device
/// may be (wgpu caps a buffer at 128 MiB; a Gemma embedding table dense in f32 is 0.7-3.9 GB),
/// each multiplied by the prefill GEMM, the products side by side.
fn dequantized_product<R, F, I, BT>(
    x: Tensor<CubeBackend<R, F, I, BT>, 2>,
    dims: [usize; 2],
    dequantize: impl Fn(Range<usize>, DType) -> CubeTensor<R>,
) -> Tensor<CubeBackend<R, F, I, BT>, 2>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    let [out, cols] = dims;
    let dtype = x.dtype();
    let max_bytes = <CubeBackend<R, F, I, BT> as ReservedMemory>::max_buffer_bytes(&x.device());
    let chunk = (max_bytes / (cols * dtype.size()).max(1)).max(1);
    if chunk >= out {
        return prefill_product(x, cube::tensor(dequantize(0..out, dtype)));
    }
    let parts: Vec<_> = (0..out)
        .step_by(chunk)
        .map(|start| prefill_product(x.clone(), cube::tensor(dequantize(start..(start + chunk).min(out), dtype))))
        .collect();
    crate::graph::unsupported(|| "a dequantized product joined by Burn".into());
    Tensor::cat(parts, 1)
}

/// The device tensors of a k-quant matrix as kernel arguments.
pub(crate) fn kpacked<R, F, I, BT>(w: &KQuantMatrix<CubeBackend<R, F, I, BT>>) -> KPacked<R>
where
    R: CubeRuntime,
    F: FloatElement,
    I: IntElement,
    BT: BoolElement,
{
    KPacked {
        lo: cube::int(w.lo.val()),
        hi: w.hi.as_ref().map(|h| cube::int(h.val())),
        meta: cube::int(w.meta.val()),
        supers: cube::float(w.supers.val()),
        format: w.format,
    }
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> GemmaBackend for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
{
    fn preferred_blocks() -> crate::PreferredBlocks {
        crate::PreferredBlocks::Dense
    }
}

#[cfg(feature = "ndarray")]
impl<E, I, Q> ReservedMemory for burn::backend::NdArray<E, I, Q>
where
    E: burn::backend::ndarray::FloatNdArrayElement,
    I: burn::backend::ndarray::IntNdArrayElement,
    Q: burn::backend::ndarray::QuantElement,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<E>>,
    burn::backend::ndarray::NdArrayTensor: From<burn::backend::ndarray::SharedArray<I>>,
{
}

// burn-candle is deprecated upstream in Burn 0.21 but still a supported CPU backend here.
/// The references, with every block-quantized matrix held in a GGUF block type and multiplied by
/// candle's quantized CPU kernels ([`crate::quant::ggml`]).
#[cfg(feature = "candle")]
#[allow(deprecated)]
impl<F, I> GemmaBackend for burn::backend::Candle<F, I>
where
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
    /// On rayon's pool, whose threads run Candle's block products ([`crate::on_cpu_pool`]).
    fn run_pass<R: Send>(work: impl FnOnce() -> R + Send) -> R {
        crate::on_cpu_pool(work)
    }

    /// GGUF blocks as they are; this crate's Q8 and Q4 as the GGUF types that hold them exactly
    /// (Q8_0 and Q4_1); dense matrices as they are.
    fn upload_matrix(matrix: HostMatrix<Self>, device: &Self::Device) -> Result<Matrix<Self>, QuantError> {
        Ok(match matrix {
            HostMatrix::Dense(w) => Matrix::Dense(Param::from_tensor(w.to_device(device))),
            HostMatrix::Quantized(q) => Matrix::Ggml(crate::GgmlMatrix::new(&crate::GgmlBlocks::from_quantized(&q))?),
            HostMatrix::Ggml(blocks) => Matrix::Ggml(crate::GgmlMatrix::new(&blocks.for_candle()?)?),
        })
    }

    /// f32 rows normalized on the host in one pass ([`crate::rms_norm::host`]); other dtypes by
    /// the reference.
    fn rms_norm<const D: usize>(x: Tensor<Self, D>, weight: Tensor<Self, 1>, eps: f64) -> Tensor<Self, D> {
        let (dims, device) = (x.dims(), x.device());
        match (host_f32(&x), host_f32(&weight)) {
            (Some(values), Some(w)) => {
                let out = crate::rms_norm::host::rms_norm(&values, &w, eps as f32);
                Tensor::from_data(TensorData::new(out, dims), (&device, DType::F32))
            }
            _ => crate::rms_norm::reference(x, weight, eps),
        }
    }

    /// f32 residual adds and norms on the host in one pass per row ([`crate::rms_norm::host`]);
    /// other dtypes by the reference.
    fn add_rms_norm(
        residual: Tensor<Self, 3>,
        x: Tensor<Self, 3>,
        norms: &AddNorm<Self>,
    ) -> (Tensor<Self, 3>, Tensor<Self, 3>) {
        let host = || {
            if norms.out_dtype != DType::F32 {
                return None;
            }
            let post = match &norms.post {
                Some(post) => Some(host_f32(post)?),
                None => None,
            };
            Some((host_f32(&residual)?, host_f32(&x)?, host_f32(&norms.weight)?, post))
        };
        match host() {
            Some((r, v, w, post)) => {
                let (dims, device) = (x.dims(), x.device());
                let (sum, normed) = crate::rms_norm::host::add_rms_norm(
                    &r,
                    &v,
                    post.as_deref(),
                    &w,
                    norms.eps as f32,
                    norms.scale as f32,
                );
                let make = |values| Tensor::from_data(TensorData::new(values, dims), (&device, DType::F32));
                (make(sum), make(normed))
            }
            None => crate::rms_norm::add_reference(residual, x, norms),
        }
    }

    /// f32 rows normalized and rotated on the host in one pass ([`crate::rope::host`]); other
    /// dtypes, and positions past the tables, by the reference.
    fn qk_norm_rope(
        x: Tensor<Self, 4>,
        tables: &RopeTables<Self>,
        position: usize,
        qk_norm: Option<(Tensor<Self, 1>, f64)>,
    ) -> Tensor<Self, 4> {
        let [_, _, seq, head_dim] = x.dims();
        let half = head_dim / 2;
        let host = || {
            let [positions, table_half] = tables.cos.dims();
            if head_dim % 2 != 0 || table_half != half || position + seq > positions || seq == 0 {
                return None;
            }
            let rows = |t: &Tensor<Self, 2>| host_f32(&t.clone().slice([position..position + seq, 0..half]));
            let norm = match &qk_norm {
                Some((weight, eps)) => Some((host_f32(weight)?, *eps as f32)),
                None => None,
            };
            Some((host_f32(&x)?, rows(&tables.cos)?, rows(&tables.sin)?, norm))
        };
        match host() {
            Some((values, cos, sin, norm)) => {
                let (dims, device) = (x.dims(), x.device());
                let norm = norm.as_ref().map(|(w, eps)| (w.as_slice(), *eps));
                let out = crate::rope::host::qk_norm_rope(&values, &cos, &sin, seq, norm);
                Tensor::from_data(TensorData::new(out, dims), (&device, DType::F32))
            }
            None => crate::rope::reference(x, tables.cos.clone(), tables.sin.clone(), position, qk_norm),
        }
    }

    /// The reference, its queries and keys rotated by [`Self::qk_norm_rope`] (host rows), so
    /// that a one-token step computes each position as a prompt or a verify step does, bit
    /// for bit.
    fn qkv_rope_append(
        qkv: Tensor<Self, 2>,
        layout: &QkvLayout<Self>,
        store: KvStore<Self>,
    ) -> Result<(Tensor<Self, 4>, KvStore<Self>), ReadBackError> {
        crate::qkv::rotated_by(qkv, layout, store, crate::qkv::Rotation::Backend)
    }

    /// Dense stores by [`crate::kv::splice_dense`]: Burn's `slice_assign` on Candle masks and
    /// pads the rows to the store's size, several passes over every layer's whole cache at each
    /// token (a sixth of a 270M decode token's time at 2,048 positions).
    fn kv_write(store: KvStore<Self>, keys: Tensor<Self, 4>, values: Tensor<Self, 4>, slot: usize) -> KvStore<Self> {
        match store {
            KvStore::Dense { keys: cache_k, values: cache_v } => KvStore::Dense {
                keys: crate::kv::splice_dense(cache_k, keys, slot),
                values: crate::kv::splice_dense(cache_v, values, slot),
            },
            int8 => crate::kv::write_reference(int8, keys, values, slot),
        }
    }
}

/// An f32 tensor's values on the host (a copy; candle's CPU tensors share their storage, so the
/// clone is cheap); `None` for other dtypes.
#[cfg(feature = "candle")]
fn host_f32<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Option<Vec<f32>> {
    if t.dtype() != DType::F32 {
        return None;
    }
    t.clone().into_data().into_vec::<f32>().ok()
}

/// Host memory has no per-buffer limit: the embedding table is one matrix.
#[cfg(feature = "candle")]
#[allow(deprecated)]
impl<F, I> ReservedMemory for burn::backend::Candle<F, I>
where
    F: burn::backend::candle::FloatCandleElement,
    I: burn::backend::candle::IntCandleElement,
{
    fn max_buffer_bytes(_device: &Self::Device) -> usize {
        usize::MAX
    }
}
