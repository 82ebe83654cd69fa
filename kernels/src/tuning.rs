//! Kernel tuning as a value: which kernels the prefill GEMM tuner times, how cuBLASLt's products
//! are ordered, which kernel attends prompts, the flash kernel's layout, and how a CUDA graph's
//! launches overlap.
//!
//! ```
//! use burn_gemma_kernels::{attention::PrefillAttention, KernelTuning};
//!
//! let tuning = KernelTuning { prefill_attention: PrefillAttention::Tiled, ..KernelTuning::DEFAULT };
//! let chosen = tuning.run(|| burn_gemma_kernels::tuning::current(|t| t.prefill_attention));
//! assert_eq!(chosen, PrefillAttention::Tiled);
//! // Outside the scope the defaults hold again.
//! assert_eq!(burn_gemma_kernels::tuning::current(|t| t.prefill_attention), PrefillAttention::Auto);
//! ```
//!
//! A model holds one (`LoadOptions::tuning` in `burn-gemma`) and runs each of its passes inside
//! [`KernelTuning::run`]. The kernels read it there through [`current`]. Why a scope and not an
//! argument: the value is read deep inside the backend operations (`project`,
//! `grouped_attention`, `project_experts`), which every backend implements and most ignore; a
//! parameter on each would reach every caller and every backend for a setting only the CubeCL
//! kernels read. The scope belongs to one thread and ends with the call, so two models in one
//! process can run with different tunings, and nothing is left set afterwards. A graph's launch
//! order is given to [`crate::graph::StepGraph::new`] directly.

use crate::attention::choice::{FlashLayout, PrefillAttention};
use crate::gemm::candidates::{self as tune, GemmKernel};
use crate::graph::DependentLaunch;
use std::borrow::Cow;
use std::cell::RefCell;

/// How the CUDA and ROCm kernels are chosen and launched. [`KernelTuning::DEFAULT`] is what was
/// measured fastest; the other settings exist to measure against it.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelTuning {
    /// The kernels the prefill GEMM tuner times for a new product shape ([`tune::DEFAULT`]).
    /// Choices made among another set are cached apart from the default's.
    pub gemm_candidates: Cow<'static, [GemmKernel]>,
    /// Fewest multiply-adds (batch included) of a product for which cuBLASLt (or hipBLASLt) is
    /// timed ([`tune::DEFAULT_CUBLASLT_FLOOR`]).
    pub cublaslt_floor: usize,
    /// How cuBLASLt's products are ordered against CubeCL's stream (CUDA builds only).
    pub blas_ordering: BlasOrdering,
    /// Which kernel attends a prompt where several take its shapes.
    pub prefill_attention: PrefillAttention,
    /// The flash kernel's layout where it fits the head size and the device; `None`: its
    /// default layouts ([`crate::attention::flash::DEFAULT_LAYOUTS`]).
    pub flash_layout: Option<FlashLayout>,
    /// Whether the launches of a CUDA graph overlap ([`crate::graph`]).
    pub dependent_launch: DependentLaunch,
}

/// How cuBLASLt's products, run on a stream of ours, are ordered against CubeCL's stream (see
/// `gemm::cublas::order`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BlasOrdering {
    /// Host waits around each product.
    Host,
    /// Flags in device memory polled by one-thread kernels on both streams; no host wait.
    #[default]
    Device,
}

impl KernelTuning {
    /// The measured defaults.
    pub const DEFAULT: Self = Self {
        gemm_candidates: Cow::Borrowed(&tune::DEFAULT),
        cublaslt_floor: tune::DEFAULT_CUBLASLT_FLOOR,
        blas_ordering: BlasOrdering::Device,
        prefill_attention: PrefillAttention::Auto,
        flash_layout: None,
        dependent_launch: DependentLaunch::Auto,
    };

    /// Runs `work` with this tuning on the calling thread; the tuning in effect before (an
    /// enclosing scope's, or the defaults) holds again afterwards, also when `work` panics.
    pub fn run<R>(&self, work: impl FnOnce() -> R) -> R {
        /// Puts the enclosing scope's tuning back when dropped.
        struct Restore(Option<KernelTuning>);
        impl Drop for Restore {
            fn drop(&mut self) {
                let previous = self.0.take();
                CURRENT.with(|current| *current.borrow_mut() = previous);
            }
        }
        let previous = CURRENT.with(|current| current.replace(Some(self.clone())));
        let _restore = Restore(previous);
        work()
    }
}

impl Default for KernelTuning {
    fn default() -> Self {
        Self::DEFAULT
    }
}

thread_local! {
    /// The tuning of the innermost [`KernelTuning::run`] on this thread.
    static CURRENT: RefCell<Option<KernelTuning>> = const { RefCell::new(None) };
}

/// Reads the tuning in effect on this thread: the innermost [`KernelTuning::run`]'s, else
/// [`KernelTuning::DEFAULT`].
pub fn current<T>(read: impl FnOnce(&KernelTuning) -> T) -> T {
    CURRENT.with(|current| match current.try_borrow().ok().as_deref() {
        Some(Some(tuning)) => read(tuning),
        _ => read(&KernelTuning::DEFAULT),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_end() {
        let outer = KernelTuning { cublaslt_floor: 7, ..KernelTuning::DEFAULT };
        let inner = KernelTuning { dependent_launch: DependentLaunch::Off, ..KernelTuning::DEFAULT };
        let seen = outer.run(|| {
            let before = current(|t| t.cublaslt_floor);
            let nested = inner.run(|| current(|t| (t.cublaslt_floor, t.dependent_launch)));
            let after = current(|t| t.cublaslt_floor);
            (before, nested, after)
        });
        assert_eq!(seen, (7, (tune::DEFAULT_CUBLASLT_FLOOR, DependentLaunch::Off), 7));
        assert_eq!(current(KernelTuning::clone), KernelTuning::DEFAULT);
    }

    #[test]
    fn a_panic_inside_ends_the_scope() {
        let tuning = KernelTuning { prefill_attention: PrefillAttention::Blocked, ..KernelTuning::DEFAULT };
        let result = std::panic::catch_unwind(|| tuning.run(|| panic!("inside the scope")));
        assert!(result.is_err());
        assert_eq!(current(|t| t.prefill_attention), PrefillAttention::Auto);
    }

    #[test]
    fn other_threads_keep_the_defaults() {
        let tuning =
            KernelTuning { flash_layout: Some(crate::attention::choice::DEFAULT_LAYOUTS[2]), ..KernelTuning::DEFAULT };
        let elsewhere = tuning.run(|| std::thread::spawn(|| current(|t| t.flash_layout)).join());
        assert_eq!(elsewhere.ok(), Some(None));
    }
}
