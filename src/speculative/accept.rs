//! The acceptance rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023): a
//! draft token `x` drawn from the drafter's distribution `q` is kept with probability
//! `min(1, p(x) / q(x))` under the target's distribution `p`; where it is not, the target's
//! token is drawn from the residual `max(0, p - q)`, normalized. Whatever `q` is, the token
//! that comes out is distributed as `p`, so drafting changes the speed, not the text's law.
//! Greedy decoding is the limit where `p` is one token: a draft is kept where it is that token.

/// The distribution a draft token was drawn from.
#[derive(Debug, Clone, PartialEq)]
pub enum Proposal {
    /// The token for sure: prompt lookup, and a draft model decoding greedily.
    Certain,
    /// A sampled draft's candidates, `(token, probability)` summing to 1.
    Sampled(Vec<(u32, f32)>),
}

impl Proposal {
    /// `q(token)`.
    fn probability(&self, token: u32, drafted: u32) -> f64 {
        match self {
            Self::Certain => f64::from(u8::from(token == drafted)),
            Self::Sampled(q) => q.iter().find(|c| c.0 == token).map_or(0.0, |c| f64::from(c.1)),
        }
    }
}

/// `p(token)` in a distribution of `(token, probability)`.
fn probability(p: &[(u32, f32)], token: u32) -> f64 {
    p.iter().find(|c| c.0 == token).map_or(0.0, |c| f64::from(c.1))
}

/// Whether the draft `token`, drawn from `proposal`, is kept under the target's distribution
/// `target`, at the uniform draw `u` in [0, 1): with probability `min(1, p / q)`.
pub fn keeps(target: &[(u32, f32)], token: u32, proposal: &Proposal, u: f32) -> bool {
    let q = proposal.probability(token, token);
    let p = probability(target, token);
    q > 0.0 && f64::from(u) < (p / q).min(1.0)
}

/// The distribution the target's token is drawn from where the draft `token` was refused: the
/// normalized `max(0, p - q)`. Where rounding leaves nothing (`p <= q` everywhere), `p` itself.
pub fn residual(target: &[(u32, f32)], token: u32, proposal: &Proposal) -> Vec<(u32, f32)> {
    let rest: Vec<(u32, f64)> = target
        .iter()
        .map(|&(t, p)| (t, (f64::from(p) - proposal.probability(t, token)).max(0.0)))
        .filter(|c| c.1 > 0.0)
        .collect();
    let total: f64 = rest.iter().map(|c| c.1).sum();
    if total <= 0.0 {
        return target.to_vec();
    }
    rest.into_iter().map(|(t, p)| (t, (p / total) as f32)).collect()
}

/// The token of `distribution` (non-empty, summing to 1) at the uniform draw `u`: the first
/// whose cumulative probability exceeds `u` (the last where rounding leaves `u` past them all).
pub fn pick(distribution: &[(u32, f32)], u: f32) -> Option<u32> {
    let mut cumulative = 0.0f64;
    for &(token, p) in distribution {
        cumulative += f64::from(p);
        if f64::from(u) < cumulative {
            return Some(token);
        }
    }
    distribution.last().map(|c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Pearson's chi-square of `counts` against `probabilities` over `n` draws.
    fn chi_square(counts: &[usize], probabilities: &[f64], n: usize) -> f64 {
        counts
            .iter()
            .zip(probabilities)
            .map(|(&c, &p)| {
                let e = p * n as f64;
                (c as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// The 0.999 quantile of chi-square with 4 degrees of freedom (tables): a correct rule
    /// exceeds it once in a thousand seeds.
    const CHI2_4DOF_999: f64 = 18.467;

    /// One token of speculative sampling: draft from `q`, keep or redraw from the residual.
    fn one_token(p: &[(u32, f32)], q: &[(u32, f32)], rng: &mut StdRng) -> u32 {
        let draft = pick(q, rng.random()).unwrap();
        let proposal = Proposal::Sampled(q.to_vec());
        if keeps(p, draft, &proposal, rng.random()) {
            draft
        } else {
            pick(&residual(p, draft, &proposal), rng.random()).unwrap()
        }
    }

    fn seed() -> u64 {
        let fresh: u64 = rand::rng().random();
        eprintln!("fresh seed: {fresh}");
        fresh
    }

    #[test]
    fn sampled_drafts_leave_the_target_distribution() {
        let p = [(0u32, 0.4f32), (1, 0.25), (2, 0.2), (3, 0.1), (4, 0.05)];
        // A draft that disagrees: it favours what the target finds unlikely, and misses token 0.
        let q = [(4u32, 0.5f32), (3, 0.3), (2, 0.15), (1, 0.05)];
        for seed in [7, seed()] {
            let mut rng = StdRng::seed_from_u64(seed);
            let n = 40_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                counts[one_token(&p, &q, &mut rng) as usize] += 1;
            }
            let probabilities: Vec<f64> = p.iter().map(|c| f64::from(c.1)).collect();
            let chi2 = chi_square(&counts, &probabilities, n);
            assert!(chi2 < CHI2_4DOF_999, "seed {seed}: counts {counts:?}, chi-square {chi2:.2}");
        }
    }

    /// A draft that always proposes one token (prompt lookup) leaves the target's law too.
    #[test]
    fn certain_drafts_leave_the_target_distribution() {
        let p = [(0u32, 0.4f32), (1, 0.25), (2, 0.2), (3, 0.1), (4, 0.05)];
        for (seed, drafted) in [(11, 3u32), (seed(), 0)] {
            let mut rng = StdRng::seed_from_u64(seed);
            let n = 40_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                let token = if keeps(&p, drafted, &Proposal::Certain, rng.random()) {
                    drafted
                } else {
                    pick(&residual(&p, drafted, &Proposal::Certain), rng.random()).unwrap()
                };
                counts[token as usize] += 1;
            }
            let probabilities: Vec<f64> = p.iter().map(|c| f64::from(c.1)).collect();
            let chi2 = chi_square(&counts, &probabilities, n);
            assert!(chi2 < CHI2_4DOF_999, "seed {seed}, draft {drafted}: counts {counts:?}, chi-square {chi2:.2}");
        }
    }

    #[test]
    fn certain_drafts_are_kept_with_the_target_probability() {
        let p = [(0u32, 0.5f32), (1, 0.3), (2, 0.2)];
        // p(1) = 0.3: kept below u = 0.3, refused above, and then never redrawn.
        assert!(keeps(&p, 1, &Proposal::Certain, 0.29));
        assert!(!keeps(&p, 1, &Proposal::Certain, 0.31));
        let rest = residual(&p, 1, &Proposal::Certain);
        assert_eq!(rest.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 2]);
        assert!((rest[0].1 - 0.5 / 0.7).abs() < 1e-6 && (rest[1].1 - 0.2 / 0.7).abs() < 1e-6);
        // A draft outside the target's candidates is never kept.
        assert!(!keeps(&p, 9, &Proposal::Certain, 0.0));
        assert_eq!(residual(&p, 9, &Proposal::Certain), p.to_vec());
    }

    #[test]
    fn picks_by_cumulative_probability() {
        let d = [(5u32, 0.5f32), (6, 0.25), (7, 0.25)];
        assert_eq!(pick(&d, 0.0), Some(5));
        assert_eq!(pick(&d, 0.49), Some(5));
        assert_eq!(pick(&d, 0.5), Some(6));
        assert_eq!(pick(&d, 0.99), Some(7));
        assert_eq!(pick(&[], 0.3), None);
    }
}
