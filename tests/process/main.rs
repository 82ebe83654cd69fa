//! Tests that watch the whole process, one binary apart from `tests/integration`: the fuzzer
//! caps every allocation the process makes, and the soak compares the device memory the process
//! reserves before and after. Each runs while nothing else of its kind does: the fuzzer alone
//! (no soak allocating beside it), the soak's tests beside each other as before.

#[path = "../common/mod.rs"]
mod common;

mod fuzz;
mod soak;

use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

static PROCESS: RwLock<()> = RwLock::new(());

/// Held by the fuzzer while it runs: no other test of this binary runs meanwhile.
fn alone() -> RwLockWriteGuard<'static, ()> {
    // A test that panicked while holding the lock poisons it; the lock guards no data.
    PROCESS.write().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Held by each soak test while it runs: soak tests run beside each other, never beside the fuzzer.
fn shared() -> RwLockReadGuard<'static, ()> {
    PROCESS.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}
