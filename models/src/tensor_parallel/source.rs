//! A weight source that hands out one shard's part of each split matrix.

use super::Shard;
use crate::{
    weights::{row_chunks, WeightKind, WeightSource},
    GemmaConfig, ModelError,
};
use burn::tensor::{backend::Backend, DType, Tensor};
use burn_gemma_kernels::{GgmlBlocks, HostQuantized, QuantFormat};
use std::ops::Range;

/// [`WeightSource`] of one shard: the matrices split among the shards (see the
/// [module](super) docs) are read whole from `inner` and cut to the shard's rows or columns;
/// everything else passes through. The model asks for each split matrix in its shard's shape
/// (the shard's [`Shard::config`]); the embedding table is cut to the shard's vocabulary only
/// where it is asked for with fewer rows than the vocabulary (the lm_head's slice), which is
/// cut from the table read whole before (so that every weight is read once, in the order an
/// unsplit model reads them: a [`crate::RandomWeights`] source then gives every shard the
/// unsplit model's values).
pub struct ShardedSource<'a, B: Backend, S> {
    inner: &'a mut S,
    /// The whole model's config.
    config: GemmaConfig,
    shard: Shard,
    /// The whole embedding table as it was read, until the lm_head's slice is cut from it.
    table: Option<Table<B>>,
}

/// The embedding table as one of the source's methods read it.
enum Table<B: Backend> {
    Chunks(Vec<Tensor<B, 2>>),
    Host(HostQuantized),
    Blocks(Option<GgmlBlocks>),
}

const TABLE: &str = "model.embed_tokens.weight";

/// A slice as a tensor of its own, through the host: a device slice is a view that keeps the
/// whole matrix's memory (every shard would hold the whole model) and strides that the products
/// would read column by column. Burn 0.21 has no device copy; the weights pass through the host
/// once when they load anyway.
fn owned<B: Backend, const D: usize>(t: Tensor<B, D>, device: &B::Device) -> Tensor<B, D> {
    let dtype = t.dtype();
    Tensor::from_data(t.into_data(), (device, dtype))
}

/// Which part of a matrix a shard holds.
#[derive(Debug, Clone)]
struct Cut {
    /// 0: rows, 1: columns.
    axis: usize,
    /// The whole matrix's extent along `axis`.
    whole: usize,
    range: Range<usize>,
}

impl Cut {
    /// The whole matrix's shape, of the shard's `shape`.
    fn whole<const D: usize>(&self, shape: [usize; D]) -> [usize; D] {
        let mut whole = shape;
        whole[self.axis] = self.whole;
        whole
    }
}

impl<'a, B: Backend, S> ShardedSource<'a, B, S> {
    /// Shard `shard` of the model `config` describes, read from `inner`.
    pub fn new(inner: &'a mut S, config: &GemmaConfig, shard: Shard) -> Self {
        Self { inner, config: config.clone(), shard, table: None }
    }

    /// The cut of `name` asked for in `shape`, `None` where the shard holds it whole.
    fn cut(&self, name: &str, shape: &[usize]) -> Result<Option<Cut>, ModelError> {
        let c = &self.config;
        if name == TABLE {
            return Ok((shape.first() != Some(&c.vocab_size)).then(|| Cut {
                axis: 0,
                whole: c.vocab_size,
                range: self.shard.part(c.vocab_size),
            }));
        }
        let Some(rest) = name.strip_prefix("model.layers.") else { return Ok(None) };
        let Some((index, rest)) = rest.split_once('.') else { return Ok(None) };
        let Ok(layer) = index.parse::<usize>() else { return Ok(None) };
        let Some(&layer_type) = c.layer_types.get(layer) else { return Ok(None) };
        let d = c.head_dim_of(layer_type);
        let heads = |range: Range<usize>| range.start * d..range.end * d;
        let inter = c.intermediate_size_of(layer);
        let cut = match rest {
            "self_attn.q_proj.weight" => {
                Cut { axis: 0, whole: c.num_attention_heads * d, range: heads(self.shard.part(c.num_attention_heads)) }
            }
            "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
                let kv = c.kv_heads_of(layer_type);
                Cut { axis: 0, whole: kv * d, range: heads(self.shard.kv_heads(kv)) }
            }
            "self_attn.o_proj.weight" => {
                Cut { axis: 1, whole: c.num_attention_heads * d, range: heads(self.shard.part(c.num_attention_heads)) }
            }
            "mlp.gate_proj.weight" | "mlp.up_proj.weight" => {
                Cut { axis: 0, whole: inter, range: self.shard.part(inter) }
            }
            "mlp.down_proj.weight" => Cut { axis: 1, whole: inter, range: self.shard.part(inter) },
            _ => return Ok(None),
        };
        if shape.len() != 2 || shape[cut.axis] != cut.range.len() {
            return Err(ModelError::TensorParallel(format!(
                "`{name}` was asked for in shape {shape:?}, which is not shard {} of {}'s part ({} of {} along axis {})",
                self.shard.rank(),
                self.shard.world(),
                cut.range.len(),
                cut.whole,
                cut.axis
            )));
        }
        Ok(Some(cut))
    }

    /// The whole table kept from its first reading, taken where it is `name` and `fits`.
    fn kept(&mut self, name: &str, fits: impl Fn(&Table<B>) -> bool) -> Option<Table<B>> {
        match self.table.take() {
            Some(table) if name == TABLE && fits(&table) => Some(table),
            other => {
                self.table = other;
                None
            }
        }
    }

    fn quantize_error(name: &str) -> impl FnOnce(burn_gemma_kernels::quant::QuantError) -> ModelError + '_ {
        move |source| ModelError::Quantize { name: format!("{name} (tensor-parallel shard)"), source }
    }
}

impl<B: Backend, S: WeightSource<B>> WeightSource<B> for ShardedSource<'_, B, S> {
    fn load<const D: usize>(
        &mut self,
        name: &str,
        shape: [usize; D],
        kind: WeightKind,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Tensor<B, D>, ModelError> {
        let Some(cut) = self.cut(name, &shape)? else { return self.inner.load(name, shape, kind, dtype, device) };
        let whole = cut.whole(shape);
        let t = self.inner.load(name, whole, kind, dtype, device)?;
        let ranges: [Range<usize>; D] =
            std::array::from_fn(|axis| if axis == cut.axis { cut.range.clone() } else { 0..whole[axis] });
        Ok(owned(t.slice(ranges), device))
    }

    fn load_row_chunks(
        &mut self,
        name: &str,
        shape: [usize; 2],
        rows_per_chunk: usize,
        dtype: DType,
        device: &B::Device,
    ) -> Result<Vec<Tensor<B, 2>>, ModelError> {
        let Some(cut) = self.cut(name, &shape)? else {
            let chunks = self.inner.load_row_chunks(name, shape, rows_per_chunk, dtype, device)?;
            if name == TABLE {
                self.table = Some(Table::Chunks(chunks.clone()));
            }
            return Ok(chunks);
        };
        // The whole matrix, each chunk of the shard's part cut from it and copied once.
        let whole: Tensor<B, 2> = match self.kept(name, |t| matches!(t, Table::Chunks(_))) {
            Some(Table::Chunks(chunks)) => Tensor::cat(chunks, 0),
            _ => self.inner.load(name, cut.whole(shape), WeightKind::Matrix, dtype, device)?,
        };
        let (rows_at, cols) = match cut.axis {
            0 => (cut.range.start, 0..shape[1]),
            _ => (0, cut.range.clone()),
        };
        Ok(row_chunks(shape[0], rows_per_chunk)
            .map(|rows| owned(whole.clone().slice([rows.start + rows_at..rows.end + rows_at, cols.clone()]), device))
            .collect())
    }

    fn load_host_quantized(
        &mut self,
        name: &str,
        shape: &[usize],
        format: QuantFormat,
        device: &B::Device,
    ) -> Result<HostQuantized, ModelError> {
        let Some(cut) = self.cut(name, shape)? else {
            let host = self.inner.load_host_quantized(name, shape, format, device)?;
            if name == TABLE {
                self.table = Some(Table::Host(host.clone()));
            }
            return Ok(host);
        };
        let whole = cut.whole([shape[0], shape[1]]);
        let host = match self.kept(name, |t| matches!(t, Table::Host(h) if h.format == format)) {
            Some(Table::Host(host)) => host,
            _ => self.inner.load_host_quantized(name, &whole, format, device)?,
        };
        match cut.axis {
            0 => Ok(host.rows_slice(cut.range)),
            _ => host.cols_slice(cut.range).map_err(Self::quantize_error(name)),
        }
    }

    fn load_blocks(&mut self, name: &str, shape: &[usize]) -> Result<Option<GgmlBlocks>, ModelError> {
        let Some(cut) = self.cut(name, shape)? else {
            let blocks = self.inner.load_blocks(name, shape)?;
            if name == TABLE {
                self.table = Some(Table::Blocks(blocks.clone()));
            }
            return Ok(blocks);
        };
        let whole = cut.whole([shape[0], shape[1]]);
        let blocks = match self.kept(name, |t| matches!(t, Table::Blocks(_))) {
            Some(Table::Blocks(blocks)) => blocks,
            _ => self.inner.load_blocks(name, &whole)?,
        };
        let Some(blocks) = blocks else { return Ok(None) };
        match cut.axis {
            0 => Ok(Some(blocks.rows_slice(cut.range))),
            _ => blocks.cols_slice(cut.range).map(Some).map_err(Self::quantize_error(name)),
        }
    }
}
