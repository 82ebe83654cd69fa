//! How an engine runs: its limits, its steps, its drafts.

use crate::{CudaGraph, WindowStore};

use std::num::NonZeroUsize;

/// How many requests an [`Engine`] serves at once and keeps waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Sequences generating at once: the batched KV cache holds this many.
    pub max_running: NonZeroUsize,
    /// Requests waiting for a place among the running; one more is refused.
    pub max_waiting: usize,
    /// Tokens a round runs through the model: one per generating sequence, then prompt chunks
    /// (each [`GenerationConfig::prefill_chunk`] long, the last shorter) while they fit. The
    /// first prompt chunk waiting runs whatever the budget, so prompts always advance; a long
    /// prompt delays the generating sequences by at most this many tokens' work per round.
    pub round_tokens: NonZeroUsize,
    /// Positions (prompt and generated) each sequence holds, at most the model's context. A
    /// longer prompt is refused; a sequence that fills its positions ends with
    /// [`StopReason::ContextFull`].
    pub max_sequence_len: NonZeroUsize,
    /// Positions the KV cache holds over all the generating sequences (per layer; the
    /// sliding-window layers hold at most a window per sequence). The cache is paged: each
    /// sequence holds blocks for its prompt and the tokens it may generate, taken when it is
    /// admitted and given back when it ends, and a request waits while the free blocks do not
    /// cover it. `None`: `max_running * max_sequence_len`, so that no request ever waits for
    /// blocks; less saves memory where requests are shorter than `max_sequence_len`.
    pub kv_positions: Option<NonZeroUsize>,
    /// Positions per KV block at most (a power of two; the cache takes the largest one up to
    /// this that divides `max_sequence_len` and the sliding windows).
    pub kv_block_size: NonZeroUsize,
    /// Whether batched decode steps replay CUDA graphs, recorded once per count of rows and
    /// bucket of positions ([`BatchGraphs`]). `Auto`: on CUDA, eager where a step cannot be
    /// recorded ([`Engine::eager_reason`] says why), and then for every step of as many rows or
    /// more (a model's products record up to some count of rows: 64 for this crate's Q4/Q8, 8
    /// for k-quant and dense weights; drafts are cut to stay below it); `On`: an error where it
    /// cannot work.
    pub cuda_graph: CudaGraph,
    /// Whether prompts' blocks stay cached for later prompts with the same beginning (a shared
    /// system prompt, the other choices of one request), which then run only the rest: their
    /// full-attention blocks are shared, the sliding windows' copied. `On` runs prompts in
    /// chunks of at most the shortest sliding window (so that every block can be cached), and
    /// a request whose prompt begins like one still running waits for it to be cached.
    pub prefix_cache: PrefixCache,
    /// Whether each generating sequence drafts tokens that its batched step verifies
    /// (speculative decoding, each sequence on its own: [`EngineDrafts`]).
    pub drafts: EngineDrafts,
}

/// Drafts in the batched engine: each generating sequence proposes the next few tokens, which
/// its rows of the next batched step score beside its own (the sequence's drafted positions as
/// rows reading and writing its KV blocks), and keeps the longest prefix the model agrees with
/// plus one token of its own ([`crate::speculative`]). Greedy sequences give the tokens they
/// give without drafts; sampled ones keep the model's distribution (the rejection rule); a
/// sequence with a repetition penalty does not draft.
///
/// Sequences draft while at most 8 generate (`DRAFTING_SEQUENCES`: more at once already share
/// each read of the weights), their drafts cut to the rows a recorded step takes
/// ([`EngineConfig::cuda_graph`]), shared out a token at a time.
///
/// The KV cache then keeps every position of the sliding-window layers (a slot per position,
/// masked by the window, [`WindowStore::EveryPosition`]): a full layer's memory for each of
/// them, where rings hold a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineDrafts {
    /// No drafts: one token per sequence and step.
    #[default]
    Off,
    /// Prompt lookup ([`PromptLookup`], over the sequence's prompt and what it generated so
    /// far): up to `tokens` drafts a step, none where its last tokens did not occur before.
    PromptLookup { tokens: NonZeroUsize },
}

impl EngineDrafts {
    /// The most tokens a sequence drafts in a step.
    pub fn max_tokens(self) -> usize {
        match self {
            Self::Off => 0,
            Self::PromptLookup { tokens } => tokens.get(),
        }
    }

    /// How the KV cache keeps the sliding windows for these drafts.
    pub(super) fn window_store(self) -> WindowStore {
        match self {
            Self::Off => WindowStore::Ring,
            Self::PromptLookup { .. } => WindowStore::EveryPosition,
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_running: NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN),
            max_waiting: 256,
            round_tokens: NonZeroUsize::new(2048).unwrap_or(NonZeroUsize::MIN),
            max_sequence_len: NonZeroUsize::new(4096).unwrap_or(NonZeroUsize::MIN),
            kv_positions: None,
            kv_block_size: NonZeroUsize::new(32).unwrap_or(NonZeroUsize::MIN),
            cuda_graph: CudaGraph::Auto,
            prefix_cache: PrefixCache::On,
            drafts: EngineDrafts::Off,
        }
    }
}

/// Whether the engine keeps prompts' blocks for later prompts with the same beginning
/// ([`EngineConfig::prefix_cache`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefixCache {
    /// Every prompt runs whole.
    Off,
    /// A prompt starting with a cached prefix runs only the rest, sharing the prefix's
    /// full-attention blocks; the sliding-window pools hold a sequence's length of positions
    /// more for the copies the index keeps.
    #[default]
    On,
}

impl std::str::FromStr for PrefixCache {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "on" => Ok(Self::On),
            "off" => Ok(Self::Off),
            other => Err(format!("unknown prefix-cache mode `{other}` (expected on or off)")),
        }
    }
}

impl std::fmt::Display for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::On => "on",
            Self::Off => "off",
        })
    }
}
