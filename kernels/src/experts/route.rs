//! The router's choice on the device: each token's `top_k` experts and their weights, written
//! to device buffers that the routed products read ([`super::gemv`]).
//!
//! One cube per token. The scores go to shared memory; each unit ranks its experts by counting
//! the scores above theirs (ties to the lower expert), so the `top_k` are found with two
//! barriers and no sort; then the first `top_k` units write `exp(s - s_top) / sum(exp(s_j -
//! s_top))` over the chosen `j`, times the expert's `per_expert_scale`. That is the softmax's
//! top-k renormalized (the softmax denominator cancels), so the full softmax is never formed.
//! The softmax is monotonic, so ranking the scores ranks the probabilities; only scores whose
//! probabilities round to the same f32 could be ordered differently than HF's `topk`.

pub(crate) mod kernel {
    use crate::cube::{cube_index, empty, grid};
    use crate::graph::{arg, launch};
    use burn::tensor::DType;
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};
    use cubecl::prelude::*;

    /// Units per cube at most (experts beyond it are strided over).
    const UNITS: usize = 256;

    #[cube(launch)]
    fn route_kernel<F: Float>(
        scores: &Array<F>,
        scale: &Array<f32>,
        ids: &mut Array<u32>,
        weights: &mut Array<f32>,
        tokens: u32,
        #[comptime] experts: usize,
        #[comptime] top_k: usize,
        #[define(F)] _dtype: StorageType,
    ) {
        let token = cube_index();
        if token >= tokens as usize {
            terminate!();
        }
        let unit = UNIT_POS_X as usize;
        let units = CUBE_DIM_X as usize;
        let base = token * experts;
        let mut s = SharedMemory::<f32>::new(experts);
        let mut chosen = SharedMemory::<u32>::new(top_k);
        let mut chosen_s = SharedMemory::<f32>::new(top_k);
        let mut i = unit;
        while i < experts {
            s[i] = f32::cast_from(scores[base + i]);
            i += units;
        }
        sync_cube();
        // Valid ids whatever the scores (a NaN ranks nowhere): the products index by them.
        if unit < top_k {
            chosen[unit] = unit as u32;
            chosen_s[unit] = s[unit];
        }
        sync_cube();
        let mut i = unit;
        while i < experts {
            let v = s[i];
            let mut rank = 0usize;
            for j in 0..experts {
                let o = s[j];
                if o > v || (o == v && j < i) {
                    rank += 1;
                }
            }
            if rank < top_k {
                chosen[rank] = i as u32;
                chosen_s[rank] = v;
            }
            i += units;
        }
        sync_cube();
        if unit < top_k {
            let top = chosen_s[0];
            let mut total = 0.0f32;
            for r in 0..top_k {
                total += f32::exp(chosen_s[r] - top);
            }
            let e = chosen[unit];
            ids[token * top_k + unit] = e;
            weights[token * top_k + unit] = f32::exp(chosen_s[unit] - top) / total * scale[e as usize];
        }
    }

    /// `scores`: contiguous `[tokens, experts]` (any float dtype); `scale`: `[experts]` f32;
    /// `top_k <= experts`. Returns the ids (`[tokens, top_k]`, `U32`) and weights (f32).
    pub fn route<R: CubeRuntime>(
        scores: CubeTensor<R>,
        scale: CubeTensor<R>,
        top_k: usize,
    ) -> (CubeTensor<R>, CubeTensor<R>) {
        let [tokens, experts] = [scores.meta.shape()[0], scores.meta.shape()[1]];
        let ids = empty(&scores, [tokens, top_k], DType::U32);
        let weights = empty(&scores, [tokens, top_k], DType::F32);
        if tokens == 0 || top_k == 0 {
            return (ids, weights);
        }
        let units = crate::cube::pow2_ceil(experts.max(top_k)).clamp(32, UNITS);
        launch!(route_kernel(
            &scores.client,
            grid(tokens),
            CubeDim::new_1d(units as u32),
            arg(&scores),
            arg(&scale),
            arg(&ids),
            arg(&weights),
            tokens as u32,
            experts,
            top_k,
            scores.dtype.into(),
        ));
        (ids, weights)
    }
}

#[cfg(test)]
mod gpu {
    use crate::experts::route_reference;
    use crate::gpu_test::{assert_close, seed};
    use crate::GemmaBackend;
    use burn::tensor::{DType, Distribution, Tensor};

    /// Ids equal to the reference's, weights within f32 rounding, for odd expert counts, top-k
    /// from 1 to all experts, and Gemma 4 26B-A4B's 128 experts with top 8.
    pub fn route<B: GemmaBackend>(device: &B::Device, dtype: DType) {
        seed::<B>(device, "route");
        for (tokens, experts, top_k) in [(1, 128, 8), (7, 128, 8), (3, 5, 2), (9, 37, 1), (2, 4, 4), (70, 300, 8)] {
            let what = format!("route {tokens} tokens, {experts} experts, top {top_k} ({dtype:?} scores)");
            let scores = Tensor::<B, 2>::random([tokens, experts], Distribution::Normal(0.0, 2.0), device).cast(dtype);
            let scale = Tensor::<B, 1>::random([experts], Distribution::Uniform(0.5, 1.5), device);
            let got = B::route_experts(scores.clone(), scale.clone(), top_k).expect("routes");
            let expected = route_reference(scores, scale, top_k).expect("reference routes");
            let (got_host, expected_host) = (got.to_host().expect("ids"), expected.to_host().expect("ids"));
            for (t, (g, e)) in got_host.iter().zip(&expected_host).enumerate() {
                let (gi, ei): (Vec<usize>, Vec<usize>) =
                    (g.iter().map(|p| p.0).collect(), e.iter().map(|p| p.0).collect());
                assert_eq!(gi, ei, "{what}: token {t}'s experts");
            }
            assert_close(got.weights, expected.weights, 1e-5, &what);
        }
    }

    gpu_tests!(route_matches_reference => route);
}
