//! The all-reduce through the host: shards on threads of one process meet at a rendezvous,
//! and each leaves with the sum of everyone's values, added in rank order (so every shard gets
//! the same bits).

use super::AllReduce;
use crate::ModelError;
use burn::tensor::{backend::Backend, DType, Tensor, TensorData};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One shard's handle on a host all-reduce shared by `world` shards, each calling
/// [`AllReduce::all_reduce`] from its own thread. [`HostAllReduce::abort`] releases every
/// waiting shard with an error (a shard that failed will not come).
#[derive(Debug, Clone)]
pub struct HostAllReduce {
    rank: usize,
    meeting: Arc<Meeting>,
}

#[derive(Debug)]
struct Meeting {
    world: usize,
    state: Mutex<Round>,
    changed: Condvar,
}

/// How a round joins the shards' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Join {
    /// Added up in rank order.
    Sum,
    /// Concatenated in rank order.
    Gather,
}

#[derive(Debug, Default)]
struct Round {
    /// Each shard's values this round, by rank.
    values: Vec<Option<Vec<f32>>>,
    /// The sum, once every shard has given its values; each shard takes it once.
    sum: Option<Arc<Result<Vec<f32>, String>>>,
    taken: usize,
    aborted: bool,
}

impl HostAllReduce {
    /// The handles of `world` shards, by rank.
    pub fn group(world: usize) -> Vec<Self> {
        let round = Round { values: vec![None; world], ..Round::default() };
        let meeting = Arc::new(Meeting { world, state: Mutex::new(round), changed: Condvar::new() });
        (0..world).map(|rank| Self { rank, meeting: meeting.clone() }).collect()
    }

    /// Releases every shard waiting now or later with an error.
    pub fn abort(&self) {
        if let Ok(mut round) = self.meeting.state.lock() {
            round.aborted = true;
        }
        self.meeting.changed.notify_all();
    }

    fn lock(&self) -> Result<MutexGuard<'_, Round>, ModelError> {
        self.meeting.state.lock().map_err(|_| Self::poisoned())
    }

    fn poisoned() -> ModelError {
        ModelError::TensorParallel("a shard failed inside the all-reduce".into())
    }

    fn aborted() -> ModelError {
        ModelError::TensorParallel("the all-reduce was aborted: another shard failed".into())
    }

    /// Waits while `until` is false, failing once the meeting is aborted.
    fn wait<'a>(
        &self,
        mut round: MutexGuard<'a, Round>,
        until: impl Fn(&Round) -> bool,
    ) -> Result<MutexGuard<'a, Round>, ModelError> {
        while !until(&round) {
            if round.aborted {
                return Err(Self::aborted());
            }
            round = self.meeting.changed.wait(round).map_err(|_| Self::poisoned())?;
        }
        if round.aborted {
            return Err(Self::aborted());
        }
        Ok(round)
    }

    /// Every shard's `values` joined as `join` says (every shard must ask the same).
    fn exchange(&self, values: Vec<f32>, join: Join) -> Result<Vec<f32>, ModelError> {
        let world = self.meeting.world;
        // The previous round's sum must be taken by everyone before this round's values land.
        let mut round = self.wait(self.lock()?, |r| r.sum.is_none() && r.values[self.rank].is_none())?;
        round.values[self.rank] = Some(values);
        if round.values.iter().all(Option::is_some) {
            let parts: Vec<Vec<f32>> = round.values.iter_mut().filter_map(Option::take).collect();
            let len = parts[0].len();
            let sum = if parts.iter().any(|p| p.len() != len) {
                let lens: Vec<usize> = parts.iter().map(Vec::len).collect();
                Err(format!("the shards gave tensors of different sizes to one collective: {lens:?}"))
            } else if join == Join::Gather {
                Ok(parts.concat())
            } else {
                let mut sum = parts[0].clone();
                for part in &parts[1..] {
                    sum.iter_mut().zip(part).for_each(|(s, v)| *s += v);
                }
                Ok(sum)
            };
            round.sum = Some(Arc::new(sum));
            self.meeting.changed.notify_all();
        }
        let mut round = self.wait(round, |r| r.sum.is_some())?;
        let sum = round.sum.clone().ok_or_else(Self::aborted)?;
        round.taken += 1;
        if round.taken == world {
            round.sum = None;
            round.taken = 0;
            self.meeting.changed.notify_all();
        }
        drop(round);
        sum.as_ref().clone().map_err(ModelError::TensorParallel)
    }
}

impl<B: Backend> AllReduce<B> for HostAllReduce {
    fn abort(&self) {
        HostAllReduce::abort(self)
    }

    fn all_reduce(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ModelError> {
        self.join(x, Join::Sum)
    }

    fn all_gather(&self, x: Tensor<B, 2>) -> Result<Tensor<B, 2>, ModelError> {
        self.join(x, Join::Gather)
    }
}

impl HostAllReduce {
    /// `x` read back, joined with the other shards' and put on its device again.
    fn join<B: Backend>(&self, x: Tensor<B, 2>, join: Join) -> Result<Tensor<B, 2>, ModelError> {
        let ([rows, cols], dtype, device) = (x.dims(), x.dtype(), x.device());
        let values = x
            .into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| ModelError::ReadBack { what: "a collective's values", reason: format!("{e:?}") })?;
        let joined = self.exchange(values, join)?;
        let rows = match join {
            Join::Sum => rows,
            Join::Gather => rows * self.meeting.world,
        };
        Ok(Tensor::<B, 2>::from_data(TensorData::new(joined, [rows, cols]), (&device, DType::F32)).cast(dtype))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shard gets the rank-ordered sum, round after round, and a size mismatch reaches
    /// every shard as an error.
    #[test]
    fn shards_get_the_sum_every_round() {
        let world = 3;
        let handles = HostAllReduce::group(world);
        let sums: Vec<Vec<Vec<f32>>> = std::thread::scope(|s| {
            let threads: Vec<_> = handles
                .iter()
                .map(|h| {
                    s.spawn(move || {
                        (0..20)
                            .map(|round| {
                                let values = vec![h.rank as f32 + round as f32, 10.0 * h.rank as f32];
                                h.exchange(values, Join::Sum).expect("sums")
                            })
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("joins")).collect()
        });
        for round in 0..20 {
            let expected = vec![3.0 + 3.0 * round as f32, 30.0];
            for shard in &sums {
                assert_eq!(shard[round], expected, "round {round}");
            }
        }
        let errors: Vec<bool> = std::thread::scope(|s| {
            let threads: Vec<_> = handles
                .iter()
                .map(|h| s.spawn(move || h.exchange(vec![0.0; 1 + h.rank], Join::Sum).is_err()))
                .collect();
            threads.into_iter().map(|t| t.join().expect("joins")).collect()
        });
        assert_eq!(errors, vec![true; world]);
    }

    /// A gather concatenates in rank order, whatever order the shards arrive in.
    #[test]
    fn a_gather_stacks_in_rank_order() {
        let handles = HostAllReduce::group(3);
        let gathered: Vec<Vec<f32>> = std::thread::scope(|s| {
            let threads: Vec<_> = handles
                .iter()
                .rev()
                .map(|h| {
                    s.spawn(move || {
                        std::thread::sleep(std::time::Duration::from_millis(5 * (2 - h.rank as u64)));
                        h.exchange(vec![h.rank as f32, 10.0 + h.rank as f32], Join::Gather).expect("gathers")
                    })
                })
                .collect();
            threads.into_iter().map(|t| t.join().expect("joins")).collect()
        });
        for shard in gathered {
            assert_eq!(shard, vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        }
    }

    /// A shard waiting for others that will not come is released by an abort.
    #[test]
    fn an_abort_releases_the_waiting_shards() {
        let handles = HostAllReduce::group(2);
        std::thread::scope(|s| {
            let waiting = s.spawn(|| handles[0].exchange(vec![1.0], Join::Sum));
            std::thread::sleep(std::time::Duration::from_millis(50));
            handles[1].abort();
            assert!(matches!(waiting.join().expect("joins"), Err(ModelError::TensorParallel(_))));
        });
    }
}
