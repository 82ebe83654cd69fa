//! The position of a decode step, on the host or on the device.
//!
//! A decode step at position `p` writes its keys and values into slot `p % slots` of each
//! layer's store (a full-attention store has a slot per position, so that is `p`; a
//! sliding-window store is a ring) and attends to the first `min(p + 1, slots)` slots. Eager
//! decoding passes `p` to the kernels as a launch value. A step replayed as a CUDA graph cannot
//! change its launch values, so there the kernels read `p` from a device buffer that the host
//! rewrites before each replay ([`StepPosition::Device`]), and grids are sized by a bound on
//! `p` instead of `p` itself.
//!
//! A batch of sequences can step at positions of their own (many requests served at once):
//! the device buffer then holds one position per sequence, `values[b]` for sequence `b`, and
//! every sequence writes its own slot and attends to its own visible slots. A buffer of one
//! position serves every sequence of the batch.
//!
//! Or the rows are consecutive positions of one sequence ([`StepRows::Consecutive`], the
//! verify step of speculative decoding): row `b` is at `values[0] + b` in the store's first
//! sequence, written before any row attends, and attends up to its own position, so that it
//! sees the rows before it and not those after it.

use crate::{graph, AttentionMask, ReadBackError};
use burn::tensor::{backend::Backend, Int, Tensor};

/// Where a decode step's position comes from.
#[derive(Debug, Clone)]
pub enum StepPosition<B: Backend> {
    /// Known on the host: passed to the kernels as a launch value.
    Host(usize),
    /// On the device (an int tensor; the kernels read its low 32 bits), read by the kernels
    /// when they run: a recorded step replays at any positions up to `bound`, which sizes the
    /// launch grids (every row's position is at most `bound`). One value for the whole batch,
    /// or one per sequence (`values[b]`), or the first of consecutive rows ([`StepRows`]).
    Device { values: Tensor<B, 1, Int>, bound: usize, rows: StepRows },
}

/// What the rows of a step at a device position are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepRows {
    /// Row `b` is sequence `b` of the store, at `values[b]` (or `values[0]` where the buffer
    /// holds one position for the batch).
    #[default]
    Sequences,
    /// Every row is of the store's first sequence, row `b` at position `values[0] + b`.
    Consecutive,
}

impl<B: Backend> StepPosition<B> {
    /// The position on the host, where the whole batch is at one position: read back from the
    /// device for [`StepPosition::Device`] (a synchronizing read, which a recorded step cannot
    /// replay: recording is marked as failed). Fails when the read fails, the buffer holds a
    /// negative position, or it holds positions of their own for several sequences.
    pub fn resolve(&self) -> Result<usize, ReadBackError> {
        let fail = |reason: &str| ReadBackError { what: "the step's position", reason: reason.into() };
        if self.per_sequence() {
            return Err(fail("the buffer holds a position per sequence, not one for the batch"));
        }
        self.resolve_rows(1)?.first().copied().ok_or_else(|| fail("no position"))
    }

    /// Whether the rows of the batch step at positions of their own (sequences with a position
    /// each, or consecutive rows of one sequence).
    pub fn per_sequence(&self) -> bool {
        match self {
            Self::Host(_) => false,
            Self::Device { rows: StepRows::Consecutive, .. } => true,
            Self::Device { values, .. } => values.dims()[0] > 1,
        }
    }

    /// The store row (sequence) that row `b` of the step reads and writes.
    pub fn store_row(&self, b: usize) -> usize {
        match self {
            Self::Device { rows: StepRows::Consecutive, .. } => 0,
            _ => b,
        }
    }

    /// The position of each of `batch` sequences on the host (see [`StepPosition::resolve`]):
    /// a single position repeated, or the first `batch` of the buffer's. Fails where the buffer
    /// holds fewer than `batch` positions of their own, or a negative one.
    pub fn resolve_rows(&self, batch: usize) -> Result<Vec<usize>, ReadBackError> {
        match self {
            Self::Host(p) => Ok(vec![*p; batch]),
            Self::Device { values, rows, .. } => {
                graph::unsupported(|| "an operation read the step's position back to the host".into());
                let fail = |reason: String| ReadBackError { what: "the step's position", reason };
                let held = values.dims()[0];
                if held == 0 || (held > 1 && held < batch) {
                    return Err(fail(format!("the buffer holds {held} positions for {batch} sequences")));
                }
                let data = values.clone().try_into_data().map_err(|e| fail(format!("{e:?}")))?;
                let all = data.convert::<i64>().into_vec::<i64>().map_err(|e| fail(format!("{e:?}")))?;
                let row = |b: usize| {
                    let value = match rows {
                        StepRows::Sequences => all[if held == 1 { 0 } else { b }],
                        StepRows::Consecutive => all[0] + b as i64,
                    };
                    // The kernels read the low 32 bits.
                    usize::try_from(value).map_err(|_| fail(format!("the buffer holds {value}, not a position")))
                };
                (0..batch).map(row).collect()
            }
        }
    }
}

/// The slot position `p` is written to in a store of `slots` slots.
pub fn slot(position: usize, slots: usize) -> usize {
    position % slots.max(1)
}

/// What a decode query at `position` attends to in a store of `slots` slots: the first
/// `visible` slots, with `mask` placing them (`window`: the layer's sliding window). Every key
/// of a ring is inside the window, and attention does not depend on the order of its keys, so
/// the ring is read as it lies.
pub fn decode_visible(position: usize, slots: usize, window: Option<usize>) -> (usize, AttentionMask) {
    let visible = (position + 1).min(slots);
    let mask = AttentionMask { q_offset: position, k_offset: position + 1 - visible, window };
    (visible, mask)
}

/// The position as the kernels take it.
pub(crate) mod kernel {
    use burn_cubecl::{tensor::CubeTensor, CubeRuntime};

    use super::StepRows;

    /// A [`super::StepPosition`] with the device buffer as a kernel argument (built per launch,
    /// never stored).
    #[derive(Clone)]
    #[allow(clippy::large_enum_variant)]
    pub enum Position<R: CubeRuntime> {
        Host(usize),
        /// `values[b]` for sequence `b`, or `values[0]` for all where it holds one (low 32
        /// bits), plus `b` for consecutive rows; at most `bound`.
        Device {
            values: CubeTensor<R>,
            bound: usize,
            rows: StepRows,
        },
    }

    impl<R: CubeRuntime> Position<R> {
        /// The launch value (unused by the kernels for a device position).
        pub fn value(&self) -> u32 {
            match self {
                Self::Host(p) => *p as u32,
                Self::Device { .. } => 0,
            }
        }

        /// Whether the kernels read the position from the buffer (a comptime switch).
        pub fn on_device(&self) -> bool {
            matches!(self, Self::Device { .. })
        }

        /// The buffer index of sequence `b` is `b * stride()`: 1 where the buffer holds a
        /// position per sequence, 0 where one serves the batch.
        pub fn stride(&self) -> u32 {
            match self {
                Self::Device { rows: StepRows::Consecutive, .. } => 0,
                Self::Device { values, .. } if values.meta.shape()[0] > 1 => 1,
                _ => 0,
            }
        }

        /// Row `b`'s position is its buffer value plus `b * row_step()`: 1 for consecutive
        /// rows of one sequence, else 0.
        pub fn row_step(&self) -> u32 {
            u32::from(matches!(self, Self::Device { rows: StepRows::Consecutive, .. }))
        }

        /// Row `b` reads and writes store row `b * store_stride()`: 0 for consecutive rows of
        /// one sequence, else 1.
        pub fn store_stride(&self) -> u32 {
            1 - self.row_step()
        }

        /// Whether the rows are at positions of their own.
        pub fn per_row(&self) -> bool {
            self.stride() > 0 || self.row_step() > 0
        }

        /// The buffer argument: the position's buffer, or `stand_in` (never read).
        pub fn buffer(&self, stand_in: &CubeTensor<R>) -> CubeTensor<R> {
            match self {
                Self::Host(_) => stand_in.clone(),
                Self::Device { values, .. } => values.clone(),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_and_visible_keys_of_full_and_ring_stores() {
        // Full store of 16 slots: slot = position, everything so far visible.
        assert_eq!(slot(5, 16), 5);
        let (visible, mask) = decode_visible(5, 16, None);
        assert_eq!((visible, mask.q_offset, mask.k_offset), (6, 5, 0));
        // Ring of 4 slots: wraps, at most 4 visible, placed so that all are in the window.
        assert_eq!(slot(9, 4), 1);
        let (visible, mask) = decode_visible(9, 4, Some(4));
        assert_eq!((visible, mask.q_offset, mask.k_offset, mask.window), (4, 9, 6, Some(4)));
        let (visible, mask) = decode_visible(2, 4, Some(4));
        assert_eq!((visible, mask.k_offset), (3, 0));
        // A ring larger than the positions so far behaves as a full store.
        assert_eq!(slot(3, 512), 3);
    }
}
