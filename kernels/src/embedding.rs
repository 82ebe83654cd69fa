//! Scaled embedding gather over a table stored as row blocks.

use crate::{quant, Matrix};
use burn::tensor::{backend::Backend, DType, Int, Tensor};

/// Reference over a table of [`Matrix`] row blocks, in `dtype`: a quantized table gathers and
/// dequantizes only the rows asked for ([`quant::embed_reference`], or for GGUF blocks
/// [`quant::ggml::embed_reference`]); a dense one (or one mixing
/// dense and quantized blocks, which the loader never builds: the quantized blocks are then
/// dequantized whole) gathers with [`reference()`].
pub fn table_reference<B: Backend>(
    table: &[Matrix<B>],
    ids: Tensor<B, 2, Int>,
    scale: f64,
    dtype: DType,
) -> Tensor<B, 3> {
    let quantized: Option<Vec<_>> = table
        .iter()
        .map(|block| match block {
            Matrix::Quantized(q) => Some(q),
            Matrix::Dense(_) | Matrix::Stacked(_) | Matrix::Ggml(_) | Matrix::KQuant(_) => None,
        })
        .collect();
    if let Some(blocks) = quantized.filter(|b| !b.is_empty()) {
        return quant::embed_reference(&blocks, ids, scale, dtype);
    }
    let ggml: Option<Vec<_>> = table
        .iter()
        .map(|block| match block {
            Matrix::Ggml(q) => Some(q),
            Matrix::Dense(_) | Matrix::Stacked(_) | Matrix::Quantized(_) | Matrix::KQuant(_) => None,
        })
        .collect();
    if let Some(blocks) = ggml.filter(|b| !b.is_empty()) {
        return quant::ggml::embed_reference(&blocks, ids, scale, dtype);
    }
    let blocks: Vec<Tensor<B, 2>> = table
        .iter()
        .map(|block| match block {
            Matrix::Dense(w) => w.val(),
            other => other.dense_reference(dtype, &ids.device()),
        })
        .collect();
    reference(&blocks, ids, scale).cast(dtype)
}

/// Reference: `table[ids] * scale`. Each block gathers the ids that fall in its rows (others
/// are clamped and zeroed), and the blocks' contributions are summed.
pub fn reference<B: Backend>(table: &[Tensor<B, 2>], ids: Tensor<B, 2, Int>, scale: f64) -> Tensor<B, 3> {
    let [batch, seq] = ids.dims();
    let device = ids.device();
    let ids = ids.reshape([batch * seq]);
    let mut start = 0i64;
    let mut out: Option<Tensor<B, 2>> = None;
    for block in table {
        let [rows, hidden] = block.dims();
        let local = ids.clone().sub_scalar(start);
        let rows_here = if table.len() == 1 {
            block.clone().select(0, local)
        } else {
            let inside = local.clone().greater_equal_elem(0).bool_and(local.clone().lower_elem(rows as i64));
            let gathered = block.clone().select(0, local.clamp(0, rows as i64 - 1));
            let keep = inside.float().cast(gathered.dtype()).reshape([batch * seq, 1]).expand([batch * seq, hidden]);
            gathered * keep
        };
        out = Some(match out {
            Some(acc) => acc + rows_here,
            None => rows_here,
        });
        start += rows as i64;
    }
    let Some(out) = out else {
        return Tensor::zeros([batch, seq, 0], &device);
    };
    let hidden = out.dims()[1];
    out.reshape([batch, seq, hidden]).mul_scalar(scale)
}

/// CubeCL kernel: one launch per row block, one cube per token, units striding over the row.
pub(crate) mod kernel {
    use crate::cube::{cube_index, empty, grid};
    use crate::graph::{arg, launch};
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    const THREADS: u32 = 128;

    /// Writes the rows of the tokens whose id falls in `[start, start + rows)`. The launch with
    /// `zero_others` also zeroes the rows of ids outside `[0, vocab)`, so every row is written.
    #[cube(launch)]
    fn embed_kernel<T: Float, I: Int>(
        block: &Array<T>,
        ids: &Array<I>,
        out: &mut Array<T>,
        start: u32,
        rows: u32,
        vocab: u32,
        hidden: u32,
        scale: f32,
        #[comptime] zero_others: bool,
        #[define(T, I)] _dtypes: [StorageType; 2],
    ) {
        let token = cube_index();
        if token >= ids.len() {
            terminate!();
        }
        let hidden = hidden as usize;
        let id = i64::cast_from(ids[token]);
        let base = token * hidden;
        if id >= i64::cast_from(start) && id < i64::cast_from(start + rows) {
            let row = (id - i64::cast_from(start)) as usize * hidden;
            // Rounded to the table dtype first, as Hugging Face multiplies by a tensor of it.
            let scale = f32::cast_from(T::cast_from(scale));
            let mut c = UNIT_POS_X as usize;
            while c < hidden {
                out[base + c] = T::cast_from(f32::cast_from(block[row + c]) * scale);
                c += CUBE_DIM_X as usize;
            }
        } else if zero_others && (id < 0 || id >= i64::cast_from(vocab)) {
            let mut c = UNIT_POS_X as usize;
            while c < hidden {
                out[base + c] = T::cast_from(0.0f32);
                c += CUBE_DIM_X as usize;
            }
        }
    }

    /// `blocks`: contiguous `[rows_i, hidden]` row blocks; `ids`: contiguous `[batch, seq]`.
    pub fn embed<R: CubeRuntime>(blocks: Vec<CubeTensor<R>>, ids: CubeTensor<R>, scale: f64) -> CubeTensor<R> {
        let [batch, seq] = [ids.meta.shape()[0], ids.meta.shape()[1]];
        let hidden = blocks.first().map_or(0, |b| b.meta.shape()[1]);
        let vocab: usize = blocks.iter().map(|b| b.meta.shape()[0]).sum();
        let dtype = blocks.first().map_or(burn::tensor::DType::F32, |b| b.dtype);
        let out = empty(&ids, [batch, seq, hidden], dtype);
        if batch * seq == 0 || hidden == 0 {
            return out;
        }
        let mut start = 0usize;
        for (i, block) in blocks.into_iter().enumerate() {
            let rows = block.meta.shape()[0];
            let dtypes = [block.dtype.into(), ids.dtype.into()];
            launch!(embed_kernel(
                &ids.client,
                grid(batch * seq),
                CubeDim::new_1d(THREADS),
                arg(&block),
                arg(&ids),
                arg(&out),
                start as u32,
                rows as u32,
                vocab as u32,
                hidden as u32,
                scale as f32,
                i == 0,
                dtypes,
            ));
            start += rows;
        }
        out
    }
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::test_util::TestBackend;
    use burn::tensor::{Distribution, TensorData};

    #[test]
    fn blocks_match_one_table() {
        let device = Default::default();
        let table = Tensor::<TestBackend, 2>::random([37, 5], Distribution::Normal(0.0, 1.0), &device);
        let ids =
            Tensor::<TestBackend, 2, Int>::from_data(TensorData::new(vec![0i64, 36, 12, 13, 25, 7], [2, 3]), &device);
        let whole = reference(std::slice::from_ref(&table), ids.clone(), 2.0);
        let blocks: Vec<_> = [0..13, 13..26, 26..37].into_iter().map(|r| table.clone().slice([r, 0..5])).collect();
        let split = reference(&blocks, ids, 2.0);
        whole.into_data().assert_approx_eq::<f32>(&split.into_data(), Default::default());
    }
}

#[cfg(test)]
mod gpu {
    use crate::gpu_test::{assert_close, seed, tolerance};
    use crate::{GemmaBackend, HostMatrix};
    use burn::tensor::{DType, Distribution, Int, Tensor, TensorData};

    /// Unequal row blocks, ids at block edges, and a single-block table.
    pub fn embed<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        let seed = seed::<B>(device, "embed");
        let (vocab, hidden) = (1001, 67);
        let table = Tensor::<B, 2>::random([vocab, hidden], Distribution::Normal(0.0, 1.0), device).cast(dtype);
        let mut ids: Vec<i64> = vec![0, 300, 299, 700, 1000, 699, 1, 3];
        ids.extend(
            (0..13)
                .map(|i| ((seed as i64).wrapping_mul(2_654_435_761).wrapping_add(i * 7919)).rem_euclid(vocab as i64)),
        );
        let ids = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [3, 7]), device);
        let upload = |t: Tensor<B, 2>| B::upload_matrix(HostMatrix::Dense(t), device).expect("dense upload");
        let blocks: Vec<_> =
            [0..300, 300..700, 700..1001].into_iter().map(|r| upload(table.clone().slice([r, 0..hidden]))).collect();
        let scale = (hidden as f64).sqrt();
        let expected = super::reference(&[table.clone().cast(DType::F32)], ids.clone(), scale);
        let got = B::embed(&blocks, ids.clone(), scale, dtype);
        assert_eq!(got.dtype(), dtype);
        // The kernel rounds the scale to the table dtype (as HF does); allow for that in bf16.
        assert_close(got, expected.clone(), 2.0 * tolerance(dtype), "embed (3 blocks)");
        let whole = B::embed(&[upload(table)], ids, scale, dtype);
        assert_close(whole, expected, 2.0 * tolerance(dtype), "embed (1 block)");
    }

    gpu_tests!(embed_matches_reference => embed);
}
