//! Scaled embedding gather over a table stored as row blocks.

use burn::tensor::{backend::Backend, Int, Tensor};

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

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::test_util::TestBackend;
    use burn::tensor::{Distribution, TensorData};

    #[test]
    fn blocks_match_one_table() {
        let device = Default::default();
        let table = Tensor::<TestBackend, 2>::random([37, 5], Distribution::Normal(0.0, 1.0), &device);
        let ids = Tensor::<TestBackend, 2, Int>::from_data(TensorData::new(vec![0i64, 36, 12, 13, 25, 7], [2, 3]), &device);
        let whole = reference(&[table.clone()], ids.clone(), 2.0);
        let blocks: Vec<_> = [0..13, 13..26, 26..37].into_iter().map(|r| table.clone().slice([r, 0..5])).collect();
        let split = reference(&blocks, ids, 2.0);
        whole.into_data().assert_approx_eq::<f32>(&split.into_data(), Default::default());
    }
}
