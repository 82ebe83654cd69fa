//! Ordering a cuBLASLt product, run on a stream of ours, against CubeCL's stream, which CubeCL
//! 0.10 does not expose (no handle to record an event on or wait on).
//!
//! [`Ordering::Host`] waits on the host: CubeCL's queue is drained before the product and the
//! product is waited for after it. Correct everywhere, but each wait empties the launch queue,
//! and on small models the prompt pass became host-bound (`docs/runs/gpu/2026-11-27-prefill.md`).
//!
//! [`Ordering::Device`] orders the streams on the device, with no host wait, through four 32-bit
//! words in CubeCL's memory ([`Flags`]):
//!
//! 1. a one-thread CubeCL kernel stores the product's sequence number `n` in word 0: it runs
//!    after everything CubeCL queued before it (the product's inputs, and earlier users of the
//!    output's memory);
//! 2. on our stream a one-thread kernel polls word 0 until it reaches `n`, the product runs, and
//!    a one-thread kernel stores `n` in word 1;
//! 3. a one-thread CubeCL kernel polls word 1 until it is `n`, so that CubeCL's later work (the
//!    product's readers, kernels reusing its inputs' memory) runs after the product.
//!
//! Every wait is for work submitted to CUDA before the waiting kernel starts, so no wait
//! depends on a launch not yet made. That takes two precautions, both found by the first run on
//! the H200 (`docs/runs/gpu/2026-11-27-order.md`, where each lane's first device-ordered product
//! stalled until its poll gave up): CubeCL hands launches to a device thread that may hold them,
//! so the product is ordered from that thread (`ComputeClient::exclusive`), where the signal is
//! submitted to CUDA before our poll is launched; and a kernel's first launch may
//! load it lazily, which synchronizes the context, so the four kernels are run once, host-ordered,
//! when a lane's flags are made, and each cuBLASLt problem's first run is host-ordered (loading
//! its kernels). cuBLASLt is also told to plan for two SMs fewer
//! (`CUBLASLT_MATMUL_DESC_SM_COUNT_TARGET`), so that a persistent kernel of its never needs the SM
//! a polling kernel holds. Both polls give up after a bound far above any product's time
//! (seconds) and leave a mark in words 2 and 3; [`Flags::check`] reads the marks every
//! [`CHECK_EVERY`] products and turns a mark into an error, after which the lane orders by host.

use super::call;
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::*;
use cubecl::server::Handle;
use cudarc::driver::{result as drv, sys as drs};
use std::ffi::c_void;

pub use crate::tuning::BlasOrdering as Ordering;

/// How often (in products) the give-up marks are read back.
pub(super) const CHECK_EVERY: u32 = 64;

/// Our stream's poll gives up after this long (a product takes milliseconds).
const OUR_POLL_LIMIT_NS: u64 = 30_000_000_000;

/// CubeCL's poll gives up after this many reads of word 1 (each an L2 round trip, some hundreds
/// of nanoseconds: tens of seconds in all). CubeCL kernels have no clock to read.
const CUBECL_POLL_LIMIT: u32 = 1 << 26;

/// The kernels our stream runs around a product (CUDA C, compiled by NVRTC once, its PTX kept in
/// the disk cache with the CUDA graphs').
const OUR_KERNELS: &str = r#"
extern "C" __global__ void burn_gemma_wait_flag(unsigned int* flags, unsigned int value, unsigned long long limit_ns) {
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    while ((int)(atomicAdd(&flags[0], 0u) - value) < 0) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start > limit_ns) {
            atomicExch(&flags[2], value);
            return;
        }
        __nanosleep(64);
    }
}
extern "C" __global__ void burn_gemma_set_flag(unsigned int* flags, unsigned int value) {
    __threadfence();
    atomicExch(&flags[1], value);
}
"#;

/// Stores `value` in word 0: everything CubeCL queued before this kernel has run.
#[cube(launch)]
fn signal_kernel(flags: &Array<Atomic<u32>>, value: u32) {
    if ABSOLUTE_POS == 0 {
        Atomic::store(&flags[0], value);
    }
}

/// Returns once word 1 is `value` (our stream stored it after the product), or marks word 3
/// after `limit` reads.
#[cube(launch)]
fn wait_kernel(flags: &Array<Atomic<u32>>, value: u32, limit: u32) {
    if ABSOLUTE_POS == 0 {
        let mut reads = 0u32;
        loop {
            // An atomic read goes to L2 each time (no cached value is reused).
            if Atomic::load(&flags[1]) == value {
                break;
            }
            reads += 1;
            if reads >= limit {
                Atomic::store(&flags[3], value);
                break;
            }
        }
    }
}

/// A lane's flag words (in CubeCL's memory, so that CubeCL's kernels can take them) and our
/// stream's two kernels.
pub(super) struct Flags {
    words: Handle,
    ptr: u64,
    wait: drs::CUfunction,
    set: drs::CUfunction,
    sequence: u32,
}

impl Flags {
    /// Zeroed words (written and synchronized before returning) and our kernels loaded, in the
    /// current context.
    pub(super) fn new(client: &ComputeClient<CudaRuntime>, ordinal: usize) -> Result<Self, String> {
        let arch = crate::graph::architecture(ordinal).map_err(|e| e.to_string())?;
        let (ptx, _) = crate::graph::ptx(OUR_KERNELS, arch, "cuBLASLt ordering").map_err(|e| e.to_string())?;
        // SAFETY: the PTX is NUL-terminated; the module lives as long as the process.
        let (wait, set) = unsafe {
            let module = drv::module::load_data(ptx.as_ptr() as *const c_void).map_err(call("cuModuleLoadData"))?;
            let get = |name: &str| {
                let name = std::ffi::CString::new(name).map_err(|e| e.to_string())?;
                drv::module::get_function(module, name).map_err(call("cuModuleGetFunction"))
            };
            (get("burn_gemma_wait_flag")?, get("burn_gemma_set_flag")?)
        };
        let words = client.create_from_slice(&[0u8; 16]);
        let ptr = client.get_resource(words.clone()).map(|r| r.resource().ptr).map_err(call("get_resource"))?;
        cubecl::future::block_on(client.sync()).map_err(call("sync"))?;
        let this = Self { words, ptr, wait, set, sequence: 0 };
        this.load(client)?;
        Ok(this)
    }

    /// Runs each of the four kernels once with nothing to wait for (sequence 0), host-ordered:
    /// a kernel's first launch may load it lazily, and a lazy load synchronizes the context,
    /// which must not happen while a poll waits (the first product of each lane stalled until
    /// the poll gave up before this).
    fn load(&self, client: &ComputeClient<CudaRuntime>) -> Result<(), String> {
        let stream = std::ptr::null_mut();
        self.our_wait(stream, 0)?;
        self.our_store(stream, 0)?;
        // SAFETY: the legacy stream of the current context.
        unsafe { drv::stream::synchronize(stream) }.map_err(call("cuStreamSynchronize"))?;
        self.cubecl_signal(client, 0);
        self.cubecl_wait(client, 0);
        cubecl::future::block_on(client.sync()).map_err(call("sync"))
    }

    fn arg(&self) -> ArrayArg<CudaRuntime> {
        // SAFETY: the handle holds 16 bytes: four u32 words.
        unsafe { ArrayArg::from_raw_parts(self.words.clone(), 4) }
    }

    /// Step 1 on CubeCL's stream: word 0 = `n`.
    fn cubecl_signal(&self, client: &ComputeClient<CudaRuntime>, n: u32) {
        signal_kernel::launch::<CudaRuntime>(client, CubeCount::Static(1, 1, 1), CubeDim::new_1d(1), self.arg(), n);
    }

    /// Step 3 on CubeCL's stream: poll word 1 for `n`.
    fn cubecl_wait(&self, client: &ComputeClient<CudaRuntime>, n: u32) {
        let (count, dim) = (CubeCount::Static(1, 1, 1), CubeDim::new_1d(1));
        wait_kernel::launch::<CudaRuntime>(client, count, dim, self.arg(), n, CUBECL_POLL_LIMIT);
    }

    /// Step 2's poll on `stream`: word 0 reaching `n`.
    fn our_wait(&self, stream: drs::CUstream, n: u32) -> Result<(), String> {
        let (mut ptr, mut value, mut limit) = (self.ptr, n, OUR_POLL_LIMIT_NS);
        let mut params = [
            &mut ptr as *mut u64 as *mut c_void,
            &mut value as *mut u32 as *mut c_void,
            &mut limit as *mut u64 as *mut c_void,
        ];
        // SAFETY: the kernel takes (pointer to four words, u32, u64), as passed; the words live
        // in this lane.
        unsafe { drv::launch_kernel(self.wait, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
            .map_err(call("cuLaunchKernel (wait)"))
    }

    /// Step 2's store on `stream`: word 1 = `n`.
    fn our_store(&self, stream: drs::CUstream, n: u32) -> Result<(), String> {
        let (mut ptr, mut value) = (self.ptr, n);
        let mut params = [&mut ptr as *mut u64 as *mut c_void, &mut value as *mut u32 as *mut c_void];
        // SAFETY: the kernel takes (pointer to four words, u32), as passed.
        unsafe { drv::launch_kernel(self.set, (1, 1, 1), (1, 1, 1), 0, stream, &mut params) }
            .map_err(call("cuLaunchKernel (set)"))
    }

    /// Steps 1 and 2's poll: our stream waits for CubeCL's work so far. Returns `n`.
    pub(super) fn before(&mut self, client: &ComputeClient<CudaRuntime>, stream: drs::CUstream) -> Result<u32, String> {
        let n = self.sequence.wrapping_add(1).max(1);
        self.sequence = n;
        // Called on CubeCL's device thread ([`super::product`]): the signal is submitted to CUDA
        // here, before our poll (a poll launched before its signal is submitted waits on work
        // nobody has issued).
        self.cubecl_signal(client, n);
        self.our_wait(stream, n)?;
        Ok(n)
    }

    /// Step 2's store and step 3: CubeCL's later work waits for our stream's product. Called
    /// also after a failed product launch, so that nothing waits forever.
    pub(super) fn after(
        &mut self,
        client: &ComputeClient<CudaRuntime>,
        stream: drs::CUstream,
        n: u32,
    ) -> Result<(), String> {
        match self.our_store(stream, n) {
            Ok(()) => {
                self.cubecl_wait(client, n);
                Ok(())
            }
            Err(e) => {
                // Without the store CubeCL cannot wait on the device: wait here.
                // SAFETY: this lane's stream.
                let _ = unsafe { drv::stream::synchronize(stream) };
                Err(e)
            }
        }
    }

    /// Whether a poll gave up since the lane began: reads words 2 and 3 (the host waits for
    /// nothing but the copy).
    pub(super) fn check(&self) -> Result<(), String> {
        let mut marks = [0u32; 2];
        // SAFETY: words 2 and 3 of this lane's live buffer; a plain device-to-host copy.
        unsafe { drv::memcpy_dtoh_sync(&mut marks, self.ptr + 8) }.map_err(call("cuMemcpyDtoH"))?;
        match marks {
            [0, 0] => Ok(()),
            [ours, theirs] => Err(format!(
                "a device-side ordering poll gave up (our stream at product {ours}, CubeCL's at {theirs}); \
                 results around it may be wrong; ordering by host waits from now on"
            )),
        }
    }

    /// Products ordered through these flags so far.
    pub(super) fn sequence(&self) -> u32 {
        self.sequence
    }
}
