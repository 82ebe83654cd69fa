//! What a caller chooses of prompt attention: the kernel ([`PrefillAttention`]) and the flash
//! kernel's layout ([`FlashLayout`]). A leaf: the tuning value ([`crate::KernelTuning`]) names
//! these without depending on the kernels that read it.

/// Which kernel attends a prompt (one mask for every sequence) where several take its shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillAttention {
    /// The measured default: flash attention on the matrix units where it runs (CUDA, f16/bf16,
    /// head sizes that are multiples of 16 up to 512, at least [`super::FLASH_MIN_QUERIES`] query
    /// positions), except for global layers whose score products reach [`super::BLOCKED_MIN_MACS`]
    /// and short chunks after long caches ([`super::FLASH_FEW_CUBES_KEYS`]); else the blocked GEMM
    /// path for dense prompts, else the tiled kernel.
    #[default]
    Auto,
    /// Flash attention wherever it runs, short prompts included.
    Flash,
    /// The blocked GEMM path (scores of 512 queries at a time in memory) where it runs.
    Blocked,
    /// The tiled kernel (shared memory and barriers only; every backend).
    Tiled,
}

/// When a tile's keys and values are loaded from memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Prefetch {
    /// At the start of the tile: every unit waits for its loads before the tile's products.
    None,
    /// During the previous tile's products (held in registers until the tile starts).
    NextTile,
}

/// How a launch divides the work, apart from the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashLayout {
    /// Planes (32 units) per cube, 16 query rows each.
    pub planes: usize,
    /// Keys per tile (a multiple of 32).
    pub bk: usize,
    pub prefetch: Prefetch,
}

/// The default layouts, best first (H200, bf16, `docs/runs/gpu/2026-11-28-flash.md` call 3, causal
/// prompts of 8k and 16k tokens): for heads of 256, eight planes and 64 keys per tile (188 KiB
/// of shared memory; 60-89 TFLOP/s on Gemma 3's global and local layers), then four planes and
/// 32 keys (82 KiB, two cubes per multiprocessor, within 10% of it); for Gemma 4's 512 eight
/// planes and 32 keys, prefetching the next tile (64 TFLOP/s where four planes and 64 keys, the
/// first design, gave 40).
pub const DEFAULT_LAYOUTS: [FlashLayout; 3] = [
    FlashLayout { planes: 8, bk: 64, prefetch: Prefetch::None },
    FlashLayout { planes: 8, bk: 32, prefetch: Prefetch::NextTile },
    FlashLayout { planes: 4, bk: 32, prefetch: Prefetch::None },
];
