//! Attention with grouped KV heads, causal and sliding-window masks, and logit softcapping.

use burn::tensor::{activation::softmax, backend::Backend, DType, Int, Tensor};

/// Which keys each query may attend to, from absolute positions.
///
/// Query `i` sits at position `q_offset + i` and key `j` at `k_offset + j`. A key is visible when
/// it is not in the future and, with a sliding window of `W`, when `q_pos - k_pos < W` (the window
/// covers `W` keys including the current one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionMask {
    /// Absolute position of the first query.
    pub q_offset: usize,
    /// Absolute position of the first key.
    pub k_offset: usize,
    /// Sliding-window size, `None` for global attention.
    pub window: Option<usize>,
}

impl AttentionMask {
    /// Whether the key at absolute position `k_pos` is visible from the query at `q_pos`.
    pub fn visible(&self, q_pos: usize, k_pos: usize) -> bool {
        k_pos <= q_pos && self.window.is_none_or(|w| q_pos - k_pos < w)
    }

    /// Whether any (query, key) pair of a `q_len` x `k_len` block is hidden.
    pub fn masks_anything(&self, q_len: usize, k_len: usize) -> bool {
        if q_len == 0 || k_len == 0 {
            return false;
        }
        let last_key = self.k_offset + k_len - 1;
        let last_query = self.q_offset + q_len - 1;
        last_key > self.q_offset || self.window.is_some_and(|w| last_query - self.k_offset >= w)
    }
}

/// Reference attention. KV heads are shared by reshaping the queries into groups, so the
/// repeated KV heads are never materialized.
pub fn reference<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: AttentionMask,
    scale: f64,
    softcap: Option<f64>,
) -> Tensor<B, 4> {
    let [batch, q_heads, q_len, head_dim] = q.dims();
    let [_, kv_heads, k_len, _] = k.dims();
    let groups = q_heads / kv_heads;
    let dtype = q.dtype();
    let device = q.device();

    let q = q.reshape([batch, kv_heads, groups * q_len, head_dim]);
    let mut scores = q.matmul(k.swap_dims(2, 3)).cast(DType::F32).mul_scalar(scale);
    if let Some(cap) = softcap {
        scores = crate::softcap::reference(scores, cap);
    }
    let mut scores = scores.reshape([batch, kv_heads, groups, q_len, k_len]);
    if mask.masks_anything(q_len, k_len) {
        let q_pos = Tensor::<B, 1, Int>::arange(mask.q_offset as i64..(mask.q_offset + q_len) as i64, &device)
            .reshape([q_len, 1])
            .expand([q_len, k_len]);
        let k_pos = Tensor::<B, 1, Int>::arange(mask.k_offset as i64..(mask.k_offset + k_len) as i64, &device)
            .reshape([1, k_len])
            .expand([q_len, k_len]);
        let distance = q_pos - k_pos;
        let mut hidden = distance.clone().lower_elem(0);
        if let Some(window) = mask.window {
            hidden = hidden.bool_or(distance.greater_equal_elem(window as i64));
        }
        let hidden = hidden.reshape([1, 1, 1, q_len, k_len]).expand([batch, kv_heads, groups, q_len, k_len]);
        scores = scores.mask_fill(hidden, f32::MIN);
    }
    let probs = softmax(scores, 4).cast(dtype).reshape([batch, kv_heads, groups * q_len, k_len]);
    probs.matmul(v).reshape([batch, q_heads, q_len, head_dim])
}

#[cfg(all(test, feature = "ndarray"))]
mod tests {
    use super::*;
    use crate::test_util::TestBackend;
    use burn::tensor::{Distribution, TensorData};

    /// Naive per-element attention on host vectors, for checking the reference itself.
    fn naive(q: &[f32], k: &[f32], v: &[f32], dims: [usize; 5], mask: AttentionMask, scale: f32) -> Vec<f32> {
        let [hq, hkv, tq, tk, d] = dims;
        let mut out = vec![0.0; hq * tq * d];
        for h in 0..hq {
            let kh = h / (hq / hkv);
            for i in 0..tq {
                let mut s: Vec<f32> = (0..tk)
                    .map(|j| {
                        if !mask.visible(mask.q_offset + i, mask.k_offset + j) {
                            return f32::NEG_INFINITY;
                        }
                        (0..d).map(|c| q[(h * tq + i) * d + c] * k[(kh * tk + j) * d + c]).sum::<f32>() * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter_mut().map(|x| { *x = (*x - m).exp(); *x }).sum();
                for c in 0..d {
                    out[(h * tq + i) * d + c] = (0..tk).map(|j| s[j] / z * v[(kh * tk + j) * d + c]).sum();
                }
            }
        }
        out
    }

    #[test]
    fn reference_matches_naive_with_gqa_and_window() {
        let device = Default::default();
        for (hq, hkv, tq, tk, d, q_offset, k_offset, window) in
            [(4, 2, 5, 9, 8, 4, 0, Some(3)), (3, 1, 7, 7, 5, 0, 0, None), (2, 2, 1, 6, 4, 9, 4, Some(6))]
        {
            let q = Tensor::<TestBackend, 4>::random([1, hq, tq, d], Distribution::Normal(0.0, 1.0), &device);
            let k = Tensor::<TestBackend, 4>::random([1, hkv, tk, d], Distribution::Normal(0.0, 1.0), &device);
            let v = Tensor::<TestBackend, 4>::random([1, hkv, tk, d], Distribution::Normal(0.0, 1.0), &device);
            let mask = AttentionMask { q_offset, k_offset, window };
            let scale = 0.37;
            let got = reference(q.clone(), k.clone(), v.clone(), mask, scale, None).into_data();
            let vec = |t: Tensor<TestBackend, 4>| t.into_data().to_vec::<f32>().unwrap();
            let expected = naive(&vec(q), &vec(k), &vec(v), [hq, hkv, tq, tk, d], mask, scale as f32);
            assert!(got.to_vec::<f32>().unwrap().iter().all(|x| x.is_finite()));
            got.assert_approx_eq::<f32>(&TensorData::new(expected, [1, hq, tq, d]), Default::default());
        }
    }

    #[test]
    fn mask_window_covers_current_key() {
        let m = AttentionMask { q_offset: 0, k_offset: 0, window: Some(3) };
        assert!(m.visible(5, 3) && m.visible(5, 5) && !m.visible(5, 2) && !m.visible(5, 6));
        assert!(!AttentionMask { q_offset: 10, k_offset: 8, window: Some(3) }.masks_anything(1, 3));
        assert!(AttentionMask { q_offset: 10, k_offset: 7, window: Some(3) }.masks_anything(1, 4));
    }
}
