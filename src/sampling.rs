//! Token sampling: greedy, temperature, top-k, top-p, min-p and a repetition penalty, seeded.

use crate::{
    error::{BackendError, SamplingError},
    Error, GemmaBackend, ModelError,
};
use burn::tensor::{IndexingUpdateOp, Int, Tensor, TensorData};
use burn_gemma_kernels::sampling::{self as kernel, SamplingParams};
use burn_gemma_kernels::Draws;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// How the next token is chosen from the logits.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingConfig {
    /// 0 picks the most likely token (greedy); higher values flatten the distribution.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens.
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `p`, in (0, 1].
    pub top_p: Option<f32>,
    /// Drop tokens less likely than `min_p` times the most likely one, in [0, 1].
    pub min_p: Option<f32>,
    /// Divides positive (multiplies negative) logits of recently seen tokens; 1 disables.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the random generator.
    pub seed: u64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 42,
        }
    }
}

impl SamplingConfig {
    /// Rejects values outside their ranges, naming the parameter.
    pub fn validate(&self) -> Result<(), Error> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(SamplingError::Temperature(t).into());
        }
        if self.top_k == Some(0) {
            return Err(SamplingError::TopK.into());
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(SamplingError::TopP(p).into());
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(SamplingError::MinP(p).into());
            }
        }
        let r = self.repeat_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(SamplingError::RepeatPenalty(r).into());
        }
        Ok(())
    }
}

/// A seeded sampler.
pub struct Sampler {
    config: SamplingConfig,
    rng: StdRng,
}

impl Sampler {
    /// Validates `config` and seeds the generator.
    pub fn new(config: SamplingConfig) -> Result<Self, Error> {
        config.validate()?;
        let rng = StdRng::seed_from_u64(config.seed);
        Ok(Self { config, rng })
    }

    /// Applies the repetition penalty to `logits` for tokens in the last `repeat_last_n` of
    /// `history`.
    pub fn penalize(&self, logits: &mut [f32], history: &[u32]) {
        let penalty = self.config.repeat_penalty;
        for id in self.penalized_ids(history, logits.len()) {
            let l = &mut logits[id as usize];
            *l = if *l > 0.0 { *l / penalty } else { *l * penalty };
        }
    }

    /// The distinct in-vocabulary tokens of the last `repeat_last_n` of `history`, ascending;
    /// empty when the penalty is off.
    fn penalized_ids(&self, history: &[u32], vocab: usize) -> Vec<u32> {
        if self.config.repeat_penalty == 1.0 {
            return Vec::new();
        }
        let window = &history[history.len().saturating_sub(self.config.repeat_last_n)..];
        let mut ids: Vec<u32> = window.iter().copied().filter(|&t| (t as usize) < vocab).collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// The candidate distribution after temperature, top-k, top-p and min-p, as
    /// `(token, probability)` sorted by decreasing probability and summing to 1.
    pub fn distribution(&self, logits: &[f32]) -> Vec<(u32, f32)> {
        let c = &self.config;
        let mut candidates: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        if let Some(k) = c.top_k {
            if k < candidates.len() {
                candidates.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
                candidates.truncate(k);
            }
        }
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let max = candidates.first().map_or(0.0, |c| c.1);
        let temperature = c.temperature.max(f32::MIN_POSITIVE);
        let mut total = 0.0f64;
        for cand in candidates.iter_mut() {
            cand.1 = ((cand.1 - max) / temperature).exp();
            total += cand.1 as f64;
        }
        for cand in candidates.iter_mut() {
            cand.1 = (cand.1 as f64 / total) as f32;
        }
        if let Some(p) = c.top_p {
            let mut cumulative = 0.0f32;
            let mut keep = candidates.len();
            for (i, cand) in candidates.iter().enumerate() {
                cumulative += cand.1;
                if cumulative >= p {
                    keep = i + 1;
                    break;
                }
            }
            candidates.truncate(keep);
        }
        if let Some(min_p) = c.min_p {
            let threshold = candidates.first().map_or(0.0, |c| c.1) * min_p;
            candidates.retain(|cand| cand.1 >= threshold);
        }
        let total: f32 = candidates.iter().map(|c| c.1).sum();
        for cand in candidates.iter_mut() {
            cand.1 /= total;
        }
        candidates
    }

    /// The filters in the form the device sampler takes.
    pub fn params(&self) -> SamplingParams {
        let c = &self.config;
        SamplingParams { temperature: c.temperature, top_k: c.top_k, top_p: c.top_p, min_p: c.min_p }
    }

    /// Chooses the next token from host `logits` (penalized in place) given the tokens so far:
    /// the same algorithm as [`Sampler::sample_on_device`] (the kernels' reference sampler), so
    /// the kept tokens are [`Sampler::distribution`]'s, ties at a threshold included. Returns
    /// `logits.len()` if a logit is not finite.
    pub fn sample(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        self.penalize(logits, history);
        let u = self.draw();
        kernel::reference(logits, &self.params(), u)
    }

    /// Chooses the next token of each row of the device `logits` (`[batch, vocab]`): the
    /// repetition penalty and the sampler run on the device and only the `[batch]` ids come back.
    /// An id equal to `vocab` means a logit was not finite.
    pub fn sample_on_device<B: GemmaBackend>(
        &mut self,
        logits: Tensor<B, 2>,
        history: &[u32],
    ) -> Result<Tensor<B, 1, Int>, Error> {
        let [batch, _] = logits.dims();
        let uniform = self.draws(batch);
        self.sample_with_draws(logits, history, &uniform)
    }

    /// [`Sampler::sample_on_device`] with the draws already taken ([`Sampler::draws`]).
    pub fn sample_with_draws<B: GemmaBackend>(
        &self,
        logits: Tensor<B, 2>,
        history: &[u32],
        draws: &[f32],
    ) -> Result<Tensor<B, 1, Int>, Error> {
        let logits = self.penalize_on_device(logits, history);
        B::sample(logits, &self.params(), Draws::Host(draws)).map_err(|e| ModelError::from(e).into())
    }

    /// The repetition penalty applied to device logits with tensor ops (a gather and a scatter
    /// of the few penalized entries).
    fn penalize_on_device<B: GemmaBackend>(&self, logits: Tensor<B, 2>, history: &[u32]) -> Tensor<B, 2> {
        let penalty = self.config.repeat_penalty;
        let [_, vocab] = logits.dims();
        let ids: Vec<i64> = self.penalized_ids(history, vocab).into_iter().map(i64::from).collect();
        if ids.is_empty() {
            return logits;
        }
        let device = logits.device();
        let n = ids.len();
        let index = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [n]), &device);
        let picked = logits.clone().select(1, index.clone());
        let positive = picked.clone().greater_elem(0.0);
        let penalized = picked.clone().mul_scalar(penalty).mask_where(positive, picked.clone().div_scalar(penalty));
        logits.select_assign(1, index, penalized - picked, IndexingUpdateOp::Add)
    }

    /// The uniform draws of one sampling step over `batch` rows, as [`Sampler::sample_on_device`]
    /// takes them (none drawn for greedy decoding, which reads none).
    pub fn draws(&mut self, batch: usize) -> Vec<f32> {
        if self.config.temperature == 0.0 {
            vec![0.0; batch]
        } else {
            (0..batch).map(|_| self.draw()).collect()
        }
    }

    /// Whether tokens are chosen greedily (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.config.temperature == 0.0
    }

    /// [`Sampler::distribution`] of one row of device logits (`[1, vocab]`), read back and
    /// penalized for `history`. Empty where a logit is not finite.
    pub fn host_distribution<B: GemmaBackend>(
        &self,
        logits: Tensor<B, 2>,
        history: &[u32],
    ) -> Result<Vec<(u32, f32)>, Error> {
        let read = |reason: String| crate::BackendError::ReadBack { what: "the logits", reason };
        let data = logits.try_into_data().map_err(|e| read(format!("{e:?}")))?.convert::<f32>();
        let mut row = data.into_vec::<f32>().map_err(|e| read(format!("{e:?}")))?;
        if row.iter().any(|l| !l.is_finite()) {
            return Ok(Vec::new());
        }
        self.penalize(&mut row, history);
        Ok(self.distribution(&row))
    }

    /// One uniform draw in [0, 1) from the sampler's generator.
    pub fn uniform(&mut self) -> f32 {
        self.draw()
    }

    /// Whether the repetition penalty changes anything (it runs as eager tensor operations).
    pub fn penalizes(&self) -> bool {
        self.config.repeat_penalty != 1.0
    }

    fn draw(&mut self) -> f32 {
        self.rng.random()
    }
}

pub use burn_gemma_kernels::sampling::argmax;

/// A sampled id as a token of the vocabulary: logits with NaN or infinity sample outside it.
pub(crate) fn checked_token(token: i64, vocab: usize, step: usize) -> Result<u32, Error> {
    u32::try_from(token).ok().filter(|&t| (t as usize) < vocab).ok_or(Error::NonFiniteLogits { step })
}

/// The first id of a sampled batch, read back to the host.
pub(crate) fn first_sampled<B: GemmaBackend>(ids: Tensor<B, 1, Int>) -> Result<i64, BackendError> {
    sampled_ids(ids)?
        .first()
        .copied()
        .ok_or_else(|| BackendError::ReadBack { what: "the sampled token", reason: "no id came back".into() })
}

/// Every sampled id, read back.
pub(crate) fn sampled_ids<B: GemmaBackend>(ids: Tensor<B, 1, Int>) -> Result<Vec<i64>, BackendError> {
    let read = |reason: String| BackendError::ReadBack { what: "the sampled tokens", reason };
    let ids = ids.try_into_data().map_err(|e| read(format!("{e:?}")))?.convert::<i64>();
    ids.into_vec::<i64>().map_err(|e| read(format!("{e:?}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(f: impl FnOnce(&mut SamplingConfig)) -> Sampler {
        let mut c = SamplingConfig { temperature: 1.0, ..Default::default() };
        f(&mut c);
        Sampler::new(c).unwrap()
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-5
    }

    #[test]
    fn temperature_softmax_by_hand() {
        let logits = [1.0f32, 2.0, 3.0];
        let s = sampler(|c| c.temperature = 2.0);
        let d = s.distribution(&logits);
        let e: Vec<f32> = [1.5f32, 1.0, 0.5].iter().map(|x| x.exp()).collect();
        let z: f32 = e.iter().sum();
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2, 1, 0]);
        for (i, p) in [e[0] / z, e[1] / z, e[2] / z].iter().enumerate() {
            assert!(close(d[i].1, *p), "{d:?}");
        }
    }

    #[test]
    fn top_k_top_p_min_p_by_hand() {
        // Probabilities with temperature 1: softmax(ln([0.5, 0.3, 0.15, 0.05])).
        let logits: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let d = sampler(|c| c.top_k = Some(2)).distribution(&logits);
        assert_eq!(d.len(), 2);
        assert!(close(d[0].1, 0.625) && close(d[1].1, 0.375));
        let d = sampler(|c| c.top_p = Some(0.79)).distribution(&logits);
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1]);
        let d = sampler(|c| c.top_p = Some(0.81)).distribution(&logits);
        assert_eq!(d.len(), 3);
        assert!(close(d[2].1, 0.15 / 0.95));
        let d = sampler(|c| c.min_p = Some(0.29)).distribution(&logits);
        assert_eq!(d.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2]);
        assert!(close(d[0].1, 0.5 / 0.95));
    }

    #[test]
    fn repeat_penalty_by_hand() {
        let s = sampler(|c| {
            c.repeat_penalty = 2.0;
            c.repeat_last_n = 2;
        });
        let mut logits = [4.0f32, -1.0, 3.0, 2.0];
        s.penalize(&mut logits, &[3, 0, 1, 1]);
        // Only the last two tokens (1, 1) count; token 1 is penalized once.
        assert_eq!(logits, [4.0, -2.0, 3.0, 2.0]);
    }

    #[test]
    fn greedy_and_seeded_determinism() {
        let mut g = Sampler::new(SamplingConfig::default()).unwrap();
        assert_eq!(g.sample(&mut [0.1, 5.0, 5.0, -1.0], &[]), 1);
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = sampler(|c| c.seed = seed);
            (0..20).map(|_| s.sample(&mut logits.clone(), &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn sampling_frequencies_follow_distribution() {
        let logits: Vec<f32> = [0.6f32, 0.3, 0.1].iter().map(|p| p.ln()).collect();
        let mut s = sampler(|c| c.seed = 3);
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[s.sample(&mut logits.clone(), &[]) as usize] += 1;
        }
        for (count, p) in counts.iter().zip([0.6, 0.3, 0.1]) {
            assert!((*count as f64 / 20_000.0 - p).abs() < 0.02, "{counts:?}");
        }
    }

    /// On tie-free logits the thresholds keep exactly the sorted distribution's tokens.
    #[test]
    fn device_thresholds_keep_the_distribution() {
        let logits: Vec<f32> =
            (0..200).map(|i| ((i * 7919 % 200) as f32 * 0.173).sin() * 4.0 + i as f32 * 1e-4).collect();
        for f in [
            (|c: &mut SamplingConfig| c.top_k = Some(17)) as fn(&mut SamplingConfig),
            |c| c.top_p = Some(0.6),
            |c| c.min_p = Some(0.1),
            |c| {
                c.temperature = 0.5;
                c.top_k = Some(50);
                c.top_p = Some(0.8);
                c.min_p = Some(0.02);
            },
        ] {
            let s = sampler(f);
            let mut expected: Vec<u32> = s.distribution(&logits).iter().map(|c| c.0).collect();
            expected.sort_unstable();
            let kept: Vec<u32> = kernel::kept(&logits, &s.params()).iter().map(|k| k.0).collect();
            assert_eq!(kept, expected, "{:?}", s.params());
        }
    }

    #[test]
    fn device_path_matches_host_path() {
        use burn::backend::NdArray;
        let logits: Vec<f32> = (0..300).map(|i| ((i * 31 % 300) as f32 * 0.05).cos() * 3.0).collect();
        let history = [3u32, 17, 17, 250];
        let config = |c: &mut SamplingConfig| {
            c.top_k = Some(40);
            c.repeat_penalty = 1.3;
            c.seed = 9;
        };
        let (mut host, mut device) = (sampler(config), sampler(config));
        for _ in 0..10 {
            let t = Tensor::<NdArray, 2>::from_data(TensorData::new(logits.clone(), [1, 300]), &Default::default());
            let on_device: Vec<i64> =
                device.sample_on_device(t, &history).unwrap().into_data().convert::<i64>().to_vec().unwrap();
            assert_eq!(on_device, vec![host.sample(&mut logits.clone(), &history) as i64]);
        }
    }

    #[test]
    fn bad_parameters_are_named() {
        let bad = |f: fn(&mut SamplingConfig)| {
            let mut c = SamplingConfig::default();
            f(&mut c);
            c.validate().unwrap_err().to_string()
        };
        assert!(bad(|c| c.temperature = f32::NAN).contains("temperature"));
        assert!(bad(|c| c.temperature = f32::INFINITY).contains("temperature"));
        assert!(bad(|c| c.temperature = -1.0).contains("temperature"));
        assert!(bad(|c| c.top_k = Some(0)).contains("top-k"));
        assert!(bad(|c| c.top_p = Some(0.0)).contains("top-p"));
        assert!(bad(|c| c.top_p = Some(1.5)).contains("top-p"));
        assert!(bad(|c| c.min_p = Some(-0.1)).contains("min-p"));
        assert!(bad(|c| c.repeat_penalty = 0.0).contains("repeat penalty"));
    }
}
