//! The prefill GEMM's candidate kernels, named ([`GemmKernel`]), and the measured default
//! sets the tuner chooses among ([`super::tune`]). A leaf: the tuning value
//! ([`crate::KernelTuning`]) names these without depending on the kernels that read it.

/// A tiled matmul kernel of CubeCL's (`cubek`) for the prefill products.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// CubeCL's default (`Strategy::Auto`): one cooperative-matrix stage per cube, its tile
    /// sizes inferred from the shape.
    Auto,
    /// One stage, cooperative-matrix (`cmma`) tiles; `multi_rows` gives each plane several
    /// rows of tiles.
    Simple { tiles: TileKind, multi_rows: bool },
    /// Two stages in flight (loads of the next overlap the products of this one).
    DoubleCyclic { tiles: TileKind },
    /// Two stages, partitions ordered along `k`, `rows` tile rows per cube.
    OrderedDouble { tiles: TileKind, rows: u32 },
    /// One stage loaded by the tensor memory accelerator (Hopper's TMA).
    SimpleTma { tiles: TileKind, multi_rows: bool },
    /// Loader planes and compute planes apart, stages loaded by TMA.
    SpecializedTma { tiles: TileKind },
    /// Two stages loaded by TMA.
    DoubleTma { tiles: TileKind },
    /// No matrix units: each unit computes a small tile with scalar products.
    Unit,
    /// NVIDIA's cuBLASLt (CUDA only, loaded at run time; `cublas`): its heuristic's first
    /// algorithm for the shape, `wgmma` on Hopper.
    CublasLt,
    /// AMD's hipBLASLt (ROCm only, loaded at run time; `hipblas`, built with the `rocm`
    /// feature): its heuristic's first algorithm for the shape, ordered by host waits. Compiled
    /// but never run (no ROCm device here), so not among the default candidates.
    HipBlasLt,
}

/// Which instruction the tiles are multiplied with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TileKind {
    /// Cooperative-matrix fragments (`wmma` on CUDA, `OpCooperativeMatrix` on Vulkan).
    Cmma,
    /// Register-level `mma` instructions (CUDA, HIP).
    Mma,
}

impl std::fmt::Display for GemmKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tiles = |t: &TileKind| match t {
            TileKind::Cmma => "cmma",
            TileKind::Mma => "mma",
        };
        match self {
            Self::Auto => write!(f, "auto"),
            Self::Simple { tiles: t, multi_rows } => {
                write!(f, "simple-{}{}", tiles(t), if *multi_rows { "-multirow" } else { "" })
            }
            Self::DoubleCyclic { tiles: t } => write!(f, "double-{}", tiles(t)),
            Self::OrderedDouble { tiles: t, rows } => write!(f, "ordered-{}-r{rows}", tiles(t)),
            Self::SimpleTma { tiles: t, multi_rows } => {
                write!(f, "tma-{}{}", tiles(t), if *multi_rows { "-multirow" } else { "" })
            }
            Self::SpecializedTma { tiles: t } => write!(f, "specialized-tma-{}", tiles(t)),
            Self::DoubleTma { tiles: t } => write!(f, "double-tma-{}", tiles(t)),
            Self::Unit => write!(f, "unit"),
            Self::CublasLt => write!(f, "cublaslt"),
            Self::HipBlasLt => write!(f, "hipblaslt"),
        }
    }
}

impl GemmKernel {
    /// Every candidate, for measuring them side by side (`kernel_bench --section gemm`).
    pub fn candidates() -> Vec<Self> {
        let mut all = vec![Self::Auto, Self::Unit, Self::CublasLt, Self::HipBlasLt];
        for tiles in [TileKind::Cmma, TileKind::Mma] {
            all.extend([
                Self::Simple { tiles, multi_rows: false },
                Self::Simple { tiles, multi_rows: true },
                Self::DoubleCyclic { tiles },
                Self::OrderedDouble { tiles, rows: 4 },
                Self::OrderedDouble { tiles, rows: 8 },
                Self::SimpleTma { tiles, multi_rows: false },
                Self::SimpleTma { tiles, multi_rows: true },
                Self::SpecializedTma { tiles },
                Self::DoubleTma { tiles },
            ]);
        }
        all
    }

    /// The kernel whose [`Display`](std::fmt::Display) name is `name` (`cublaslt`,
    /// `specialized-tma-mma`, ...).
    pub fn from_name(name: &str) -> Option<Self> {
        Self::candidates().into_iter().find(|k| k.to_string() == name)
    }
}

/// CubeCL's kernels tuning chooses among: on the H100 (`docs/runs/gpu/2026-11-24-prefill.md`,
/// `gemm-sweep.md`) the best of the first four is within 6% of the best of all twenty
/// candidates on every Gemma 3 1B/4B product at 512 and 4,096 rows, and each is the fastest on
/// some of them; the last runs where there is neither TMA nor `mma` (Vulkan's cooperative
/// matrices). Candidates a device cannot launch are skipped.
pub const TUNED: [GemmKernel; 5] = [
    GemmKernel::SpecializedTma { tiles: TileKind::Mma },
    GemmKernel::SpecializedTma { tiles: TileKind::Cmma },
    GemmKernel::SimpleTma { tiles: TileKind::Cmma, multi_rows: true },
    GemmKernel::OrderedDouble { tiles: TileKind::Mma, rows: 8 },
    GemmKernel::Simple { tiles: TileKind::Cmma, multi_rows: true },
];

/// The default candidates: [`TUNED`] and cuBLASLt ([`GemmKernel::CublasLt`], CUDA only; it
/// refuses elsewhere and is skipped), the latter for products of at least
/// [`DEFAULT_CUBLASLT_FLOOR`] multiply-adds.
pub const DEFAULT: [GemmKernel; 6] = [TUNED[0], TUNED[1], TUNED[2], TUNED[3], TUNED[4], GemmKernel::CublasLt];

/// Fewest multiply-adds (batch included) of a product for which cuBLASLt is timed, by default.
/// Measured on the H200 (`docs/runs/gpu/2026-11-27-order.md`, call 4, whole prompts): with no
/// floor the tuner also chose cuBLASLt for the blocked attention's smaller products, and Gemma
/// 3 1B's prompts ran 0.59-0.75x CubeCL's kernels alone (each cuBLASLt product waits for
/// CubeCL's device thread once, which a small product cannot repay where the launches, not
/// the GPU, set the pace); with this floor 1B ran 1.00-1.01x, 4B 1.04x (pp512) and 1.87x
/// (pp4096), and 12B (no floor, nearly all its products above it) 2.4x and 2.3x.
pub const DEFAULT_CUBLASLT_FLOOR: usize = 16_000_000_000;
