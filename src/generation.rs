//! Text generation over a [`Gemma`] model: streaming, stop conditions, chat history, statistics.

use crate::{
    chat::{ChatError, ChatMessage, ChatTemplate, ReplyEnd, SystemTurn, ToolResponse},
    error::{RequestError, TokenizerError},
    graph_policy::{EagerReason, GraphFailure, GraphPolicy},
    images::ImageError,
    output::{OutputRules, Room, SequenceOutput},
    sampling::{checked_token, first_sampled, Sampler, SamplingConfig},
    speculative::{
        judge::{greedy_verdict, judge},
        DraftSteps, Drafter, Drafts, Proposal, Speculation, SpeculationStats,
    },
    tokenizer::Bos,
    vision::{Picture, Vision},
    Error, Gemma, GemmaBackend, GemmaConfig, KvCache, Tokenizer,
};
use burn::tensor::{Int, Tensor, TensorData};
use burn_gemma_kernels::SamplingParams;
use burn_gemma_model::{
    CudaGraph, DecodeGraphs, GraphSetup, ImageEmbeds, ModelError, QueryRows, RewindPoint, WindowStore,
};
use std::{
    collections::VecDeque,
    num::NonZeroUsize,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

pub use crate::output::{StopReason, Token};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerationConfig {
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// How tokens are chosen.
    pub sampling: SamplingConfig,
    /// Extra stop tokens beside `<eos>` and the end-of-turn token (`<end_of_turn>`, Gemma 4's
    /// `<turn|>`).
    pub stop_tokens: Vec<u32>,
    /// Strings that end generation: the text stops before the first to appear (it and what
    /// follows are dropped; see [`StopReason::StopString`]).
    pub stop_strings: Vec<String>,
    /// Whether decoding replays a recorded CUDA graph (see [`CudaGraph`]; `Auto`: on CUDA,
    /// with greedy or temperature sampling and no repetition penalty).
    pub cuda_graph: CudaGraph,
    /// Most prompt tokens run through the model in one forward pass: a longer prompt is run in
    /// chunks of this many tokens, each attending to the cache the previous ones filled, so the
    /// activations a prompt needs on the device are bounded by the chunk, not the prompt.
    pub prefill_chunk: NonZeroUsize,
}

/// [`GenerationConfig::prefill_chunk`]'s default: large enough that the products run at the
/// matrix units' speed, small enough that a chunk's activations (and attention scores of the
/// reference path) stay within a few hundred MB on the larger models.
pub const DEFAULT_PREFILL_CHUNK: NonZeroUsize = match NonZeroUsize::new(2048) {
    Some(n) => n,
    None => unreachable!(),
};

impl Default for GenerationConfig {
    fn default() -> Self {
        Self {
            max_new_tokens: 128,
            sampling: SamplingConfig::default(),
            stop_tokens: Vec::new(),
            stop_strings: Vec::new(),
            cuda_graph: CudaGraph::Auto,
            prefill_chunk: DEFAULT_PREFILL_CHUNK,
        }
    }
}

/// Timings of one generation.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    pub prompt_tokens: usize,
    /// Prefill plus the first sampled token.
    pub time_to_first_token: Duration,
    pub prefill: Duration,
    pub generated_tokens: usize,
    /// Time spent producing tokens after the first.
    pub decode: Duration,
    /// Decode steps replayed as a CUDA graph.
    pub graph_steps: usize,
    /// What recording the CUDA graphs of this generation cost (included in `decode`).
    pub graph_setup: GraphSetup,
    /// Time spent choosing prefill GEMM kernels for product shapes not seen before on this
    /// device (included in `prefill`; once per shape, then read from the tuning cache, see
    /// `burn_gemma_kernels::gemm::tune`).
    pub gemm_tuning: Duration,
    /// What drafting did, where a [`Speculation`] is set.
    pub speculation: Option<SpeculationStats>,
}

impl Stats {
    /// Prompt tokens per second of prefill.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill.as_secs_f64().max(1e-9)
    }

    /// Adds what recording cost between two readings of a [`DecodeGraphs::setup`], and its
    /// launches per step.
    fn count_setup(&mut self, before: GraphSetup, after: GraphSetup) {
        let setup = &mut self.graph_setup;
        setup.recordings += after.recordings - before.recordings;
        setup.time += after.time - before.time;
        setup.compiled += after.compiled - before.compiled;
        setup.cached += after.cached - before.cached;
        setup.launches = after.launches;
    }

    /// Tokens per second after the first one.
    pub fn decode_tokens_per_second(&self) -> f64 {
        self.generated_tokens.saturating_sub(1) as f64 / self.decode.as_secs_f64().max(1e-9)
    }
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.generated_tokens == 0 {
            return write!(
                f,
                "prompt tokens: {} | generated tokens: 0 (stopped before the first token)",
                self.prompt_tokens
            );
        }
        write!(
            f,
            "prompt tokens: {} | time to first token: {:.1} ms | prefill: {:.1} tok/s | generated tokens: {} | decode: {:.2} tok/s",
            self.prompt_tokens,
            self.time_to_first_token.as_secs_f64() * 1e3,
            self.prefill_tokens_per_second(),
            self.generated_tokens,
            self.decode_tokens_per_second()
        )?;
        if !self.gemm_tuning.is_zero() {
            write!(
                f,
                " | prefill includes {:.0} ms choosing GEMM kernels for new shapes (cached for later runs)",
                self.gemm_tuning.as_secs_f64() * 1e3
            )?;
        }
        if let Some(spec) = &self.speculation {
            write!(
                f,
                " | speculative: {}/{} drafts accepted ({:.0}%), {:.2} tokens per model step",
                spec.accepted,
                spec.drafted,
                spec.acceptance_rate() * 100.0,
                self.generated_tokens.saturating_sub(1) as f64 / spec.target_steps.max(1) as f64
            )?;
        }
        if self.graph_steps > 0 {
            let setup = &self.graph_setup;
            write!(
                f,
                " | CUDA graph: {} steps of {} launches, {} recording(s) in {:.0} ms",
                self.graph_steps,
                setup.launches,
                setup.recordings,
                setup.time.as_secs_f64() * 1e3
            )?;
        }
        Ok(())
    }
}

/// Generation as an iterator of [`Token`]s ([`Generator::generate_stream`]): each `next()` runs
/// one step; an error ends the stream. Dropping it stops generation at that point.
pub struct TokenStream<'g, B: GemmaBackend> {
    generator: &'g mut Generator<B>,
    run: Option<Run>,
}

impl<B: GemmaBackend> Iterator for TokenStream<'_, B> {
    type Item = Result<Token, Error>;

    fn next(&mut self) -> Option<Self::Item> {
        let run = self.run.as_mut()?;
        self.generator.step(run)
    }
}

impl<B: GemmaBackend> TokenStream<'_, B> {
    /// The generator between steps, read only (its context holds the tokens the model has
    /// run, not the drafts still queued).
    pub fn generator(&self) -> &Generator<B> {
        self.generator
    }

    /// Stops here and returns what was generated (the text includes the rest of a character
    /// left split by the last token).
    pub fn finish(mut self) -> GenerationOutput {
        let Some(run) = self.run.take() else { return GenerationOutput::empty() };
        self.generator.keep_yielded(&run);
        run.finish().0
    }
}

impl<B: GemmaBackend> Drop for TokenStream<'_, B> {
    /// The conversation keeps every token the stream yielded.
    fn drop(&mut self) {
        if let Some(run) = self.run.take() {
            self.generator.keep_yielded(&run);
        }
    }
}

/// The state of one generation between steps.
struct Run {
    sampler: Sampler,
    /// Whether decode steps replay CUDA graphs (cleared when one fails under `Auto`).
    graph: bool,
    cuda_graph: CudaGraph,
    prefill_chunk: NonZeroUsize,
    /// The cache capacity the request needs.
    capacity: usize,
    /// Stop tokens, stop strings, limits and the text held back.
    output: SequenceOutput,
    start: Instant,
    decode_start: Instant,
    tuning_before: Duration,
    stats: Stats,
    text: String,
    tokens: Vec<u32>,
    /// What the next step runs through the model.
    input: Vec<u32>,
    /// Tokens a verify step produced, handed out one per step: `(id, whether the cache holds
    /// it)` (kept drafts are in the cache, the model's own last token is not).
    queue: VecDeque<(u32, bool)>,
    /// A draft model's sampler: the request's settings, draws of its own.
    draft_sampler: Sampler,
    stop: Option<StopReason>,
}

impl Run {
    /// The output, and the rest of a character left split by the last token (also in the
    /// output's text).
    fn finish(mut self) -> (GenerationOutput, String) {
        let rest = self.output.finish();
        self.text.push_str(&rest);
        self.stats.generated_tokens = self.tokens.len();
        self.stats.decode = self.decode_start.elapsed();
        let stop = self.stop.unwrap_or(StopReason::Interrupted);
        (GenerationOutput { tokens: self.tokens, text: self.text, stop, stats: self.stats }, rest)
    }
}

/// The result of one generation.
#[derive(Debug, Clone)]
pub struct GenerationOutput {
    /// Generated ids (including a final stop token).
    pub tokens: Vec<u32>,
    /// Generated text (stop tokens excluded).
    pub text: String,
    pub stop: StopReason,
    pub stats: Stats,
}

impl GenerationOutput {
    fn empty() -> Self {
        Self { tokens: Vec::new(), text: String::new(), stop: StopReason::Interrupted, stats: Stats::default() }
    }
}

/// One sequence of token ids as the model's `[1, len]` input.
pub fn token_tensor<B: burn::tensor::backend::Backend>(ids: &[u32], device: &B::Device) -> Tensor<B, 2, Int> {
    let data: Vec<i64> = ids.iter().map(|&t| i64::from(t)).collect();
    Tensor::from_data(TensorData::new(data, [1, ids.len()]), device)
}

/// Generates text with a model and its tokenizer, keeping the KV cache between calls.
pub struct Generator<B: GemmaBackend> {
    model: Gemma<B>,
    tokenizer: Tokenizer,
    cache: Option<KvCache<B>>,
    /// Tokens currently in the cache (the conversation so far in chat mode).
    context: Vec<u32>,
    /// Stop tokens of the model and its chat layout (a run adds its own and, with tools
    /// declared, `<|tool_response>`).
    default_stops: Vec<u32>,
    interrupt: Arc<AtomicBool>,
    /// Recorded decode steps for the current cache.
    graphs: Option<DecodeGraphs<B>>,
    /// Recorded verify steps of speculative decoding for the current cache, one per row count
    /// (the most drafts a step may make, fewer where the cache's end is near).
    verify_graphs: Vec<DecodeGraphs<B>>,
    /// How the cache stores sliding windows: every position where verify steps are recorded
    /// (they write all their rows before any attends), else rings.
    window_store: WindowStore,
    /// Why decoding stays eager in `Auto` mode.
    /// What replaying decode steps taught so far.
    graph_policy: GraphPolicy,
    /// The model's chat layout.
    template: ChatTemplate,
    /// How a conversation opens (see [`Generator::set_system`]).
    system: SystemTurn,
    /// Drafting, where set ([`Generator::set_speculation`]).
    speculation: Option<Speculation<B>>,
    /// Taken before the last verify step: takes back cached drafts the context did not keep.
    rewind: Option<RewindPoint<B>>,
    /// The model's last final hidden state, where a Gemma 4 assistant drafts from it.
    target_hidden: Option<TargetHidden<B>>,
    /// The vision tower and projector, where images are read ([`Generator::set_vision`]).
    vision: Option<Vision<B>>,
    /// The features of the request's images, by the row of the run's input where their soft
    /// tokens start (placed by the prompt's prefill).
    pending_images: Vec<ImageEmbeds<B>>,
}

/// The model's final hidden state (after its norm, `[1, hidden]`) at `position`: the state whose
/// logits chose the token at `position + 1`.
struct TargetHidden<B: GemmaBackend> {
    position: usize,
    hidden: Tensor<B, 2>,
}

impl<B: GemmaBackend> Generator<B> {
    /// Wraps a model and tokenizer. Fails if they disagree on the vocabulary.
    pub fn new(model: Gemma<B>, tokenizer: Tokenizer) -> Result<Self, Error> {
        refuse_shard(&model)?;
        check_vocabulary(model.config(), &tokenizer)?;
        let template = ChatTemplate::for_architecture(model.config().model_type);
        let default_stops = default_stop_tokens(model.config(), &tokenizer);
        Ok(Self {
            model,
            tokenizer,
            template,
            system: SystemTurn::default(),
            cache: None,
            context: Vec::new(),
            default_stops,
            interrupt: Arc::new(AtomicBool::new(false)),
            graphs: None,
            verify_graphs: Vec::new(),
            window_store: WindowStore::Ring,
            graph_policy: GraphPolicy::default(),
            speculation: None,
            rewind: None,
            target_hidden: None,
            vision: None,
            pending_images: Vec::new(),
        })
    }

    /// Drafts tokens for the model to verify from here on (see [`crate::speculative`]), or
    /// stops drafting (`None`). Greedy output is the same token for token; sampled output keeps
    /// the model's distribution. A draft model must share the model's vocabulary.
    pub fn set_speculation(&mut self, speculation: Option<Speculation<B>>) -> Result<(), Error> {
        match speculation.as_ref().map(Speculation::drafter) {
            Some(Drafter::Model(draft)) => {
                let (target, drafter) = (self.model.config().vocab_size, draft.model().config().vocab_size);
                if target != drafter {
                    return Err(RequestError::DraftVocabulary { target, draft: drafter }.into());
                }
            }
            Some(Drafter::Assistant(drafter)) => {
                let fits = drafter.assistant().check_target(&self.model);
                fits.map_err(|e| RequestError::AssistantMismatch(e.to_string()))?;
            }
            _ => {}
        }
        self.speculation = speculation;
        self.target_hidden = None;
        Ok(())
    }

    /// Takes the drafter back (drafting stops): to lend it to another generator, or to set it
    /// again later without loading a draft model twice.
    pub fn take_speculation(&mut self) -> Option<Speculation<B>> {
        self.target_hidden = None;
        self.speculation.take()
    }

    /// The model's last final hidden state (after its norm, `[1, hidden]`) and its position,
    /// where a Gemma 4 assistant drafts from it (`None` otherwise): the state whose logits chose
    /// the token at the next position.
    pub fn last_hidden_state(&self) -> Option<(usize, Tensor<B, 2>)> {
        self.target_hidden.as_ref().map(|h| (h.position, h.hidden.clone()))
    }

    /// Reads images from here on: a multimodal Gemma 3's or Gemma 4's vision tower
    /// ([`crate::Checkpoint::load_vision_tower`], [`crate::MmprojCheckpoint::load`]), or none.
    /// Fails if the tower does not project to the model's width or marks images with tokens
    /// past its vocabulary.
    pub fn set_vision(&mut self, vision: Option<Vision<B>>) -> Result<(), Error> {
        if let Some(v) = &vision {
            v.check_fits(self.model.config().hidden_size, self.model.config().vocab_size)?;
        }
        self.vision = vision;
        Ok(())
    }

    /// The vision tower, where set: [`Vision::read`] prepares a picture for it.
    pub fn vision(&self) -> Option<&Vision<B>> {
        self.vision.as_ref()
    }

    /// Like [`Generator::continue_ids`] with pictures: `ids` holds a run of the image soft token
    /// for each picture, in order, as long as the picture's soft tokens ([`Vision::soft_tokens`]);
    /// each run's embeddings are the picture's features, its tokens attending to each other both
    /// ways as the model's config says.
    pub fn continue_ids_with_images(
        &mut self,
        ids: &[u32],
        images: &[Picture],
        config: &GenerationConfig,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        let mut run = self.start_with_images(ids, images, config)?;
        while let Some(token) = self.step(&mut run) {
            let token = token?;
            if !token.text.is_empty() {
                on_text(&token.text);
            }
        }
        let (output, rest) = run.finish();
        if !rest.is_empty() {
            on_text(&rest);
        }
        Ok(output)
    }

    /// Like [`Generator::generate`] with pictures: each place in `prompt`
    /// ([`crate::ImageProcessor::placeholder`]: `<start_of_image>` for Gemma 3, `<|image|>`
    /// for Gemma 4) takes the next picture (where the prompt has none, the pictures go first),
    /// expanded as the model's processor does (see [`crate::vision`]).
    pub fn generate_with_images(
        &mut self,
        prompt: &str,
        images: &[Picture],
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt.into());
        }
        let text = self.image_text(prompt, images)?;
        let ids = self.tokenizer.encode(&text, Bos::Prepend)?;
        self.reset();
        self.continue_ids_with_images(&ids, images, config, on_text)
    }

    /// Like [`Generator::chat`] with pictures in the user's turn (before the message unless it
    /// places them with [`crate::ImageProcessor::placeholder`]).
    pub fn chat_with_images(
        &mut self,
        message: &str,
        images: &[Picture],
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        if message.trim().is_empty() {
            return Err(ChatError::EmptyUserMessage { index: 0 }.into());
        }
        let text = self.image_text(message, images)?;
        let ids = self.turn_ids(&text)?;
        self.continue_ids_with_images(&ids, images, config, on_text)
    }

    /// `text` with its image places (or one for each picture first) expanded into the model's
    /// image sequences, each as long as its picture's soft tokens.
    fn image_text(&self, text: &str, images: &[Picture]) -> Result<String, Error> {
        let vision = self.vision.as_ref().ok_or(ImageError::NoVision)?;
        Ok(vision.processor().expand(text, images, &self.tokenizer)?)
    }

    /// A flag that stops generation at the next step when set (e.g. from a Ctrl-C handler).
    pub fn interrupt_flag(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }

    /// The model.
    pub fn model(&self) -> &Gemma<B> {
        &self.model
    }

    /// The tokens of the conversation so far: prompts and generated tokens, as the cache holds
    /// them.
    pub fn context(&self) -> &[u32] {
        &self.context
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Largest context the model supports.
    pub fn max_context(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    /// Forgets the conversation; the cache memory is reused.
    pub fn reset(&mut self) {
        self.context.clear();
        self.rewind = None;
        self.target_hidden = None;
        if let Some(cache) = &mut self.cache {
            cache.reset();
        }
    }

    /// Generates a continuation of `prompt` (with `<bos>` prepended), starting from an empty
    /// context. `on_text` receives the text as it is produced.
    pub fn generate(
        &mut self,
        prompt: &str,
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        let ids = self.prompt_ids(prompt)?;
        self.reset();
        self.continue_ids(&ids, config, on_text)
    }

    /// A prompt's ids with `<bos>` first.
    fn prompt_ids(&self, prompt: &str) -> Result<Vec<u32>, Error> {
        if prompt.is_empty() {
            return Err(RequestError::EmptyPrompt.into());
        }
        self.tokenizer.encode(prompt, Bos::Prepend)
    }

    /// Sets how chat conversations open and starts a new one: instructions, thinking and tool
    /// declarations (Gemma 4's system turn; Gemma 1-3 take instructions only, at the head of the
    /// first user turn, as their template does). With tools declared, generation also stops
    /// where the model hands over to a tool (`<|tool_response>`); answer with
    /// [`Generator::send_tool_responses`], and split replies with
    /// [`crate::chat::ModelReply::parse`].
    pub fn set_system(&mut self, system: SystemTurn) -> Result<(), Error> {
        self.template.check_system(&system)?;
        self.system = system;
        self.reset();
        Ok(())
    }

    /// Continues the model's turn after it called tools (generation stopped at
    /// `<|tool_response>`): the responses go into the context as the chat template writes them
    /// and the model goes on from there. Gemma 4 only.
    pub fn send_tool_responses(
        &mut self,
        responses: &[ToolResponse],
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        let ids = self.tool_response_ids(responses)?;
        self.continue_ids(&ids, config, on_text)
    }

    /// Where the model hands over to a tool (`<|tool_response>`), a stop token when tools are
    /// declared.
    fn tool_handover(&self) -> Option<u32> {
        self.tokenizer.token_id("<|tool_response>").filter(|_| !self.system.tools.is_empty())
    }

    fn tool_response_ids(&self, responses: &[ToolResponse]) -> Result<Vec<u32>, Error> {
        if self.template != ChatTemplate::Gemma4 {
            return Err(ChatError::Gemma4Only { feature: "tool calls" }.into());
        }
        if responses.is_empty() {
            return Err(RequestError::NoToolResponses.into());
        }
        if self.context.is_empty() {
            return Err(RequestError::NoConversation.into());
        }
        // The model opened the first response itself where it stopped on `<|tool_response>`.
        let opened = self.context.last().copied() == self.tokenizer.token_id("<|tool_response>");
        let text: String = responses
            .iter()
            .enumerate()
            .map(|(i, r)| if i == 0 && opened { r.render_after_open() } else { r.render() })
            .collect();
        self.tokenizer.encode(&text, Bos::Omit)
    }

    /// One chat turn: appends the user's message in the model's chat template to the conversation and
    /// generates the model's reply.
    pub fn chat(
        &mut self,
        message: &str,
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        let ids = self.turn_ids(message)?;
        self.continue_ids(&ids, config, on_text)
    }

    /// The ids of a user turn after the conversation so far, in the model's chat template.
    fn turn_ids(&self, message: &str) -> Result<Vec<u32>, Error> {
        let text = match self.context.last() {
            None => self.template.render_with(&self.system, &[ChatMessage::user(message)])?,
            Some(&last) => {
                // The previous reply ended with its end-of-turn token or was cut short.
                let ended = match self.tokenizer.token_id(self.template.end_of_turn()) == Some(last) {
                    true => ReplyEnd::Closed,
                    false => ReplyEnd::Open,
                };
                self.template.next_turn(ended, message)?
            }
        };
        self.tokenizer.encode(&text, if self.context.is_empty() { Bos::Prepend } else { Bos::Omit })
    }

    /// Appends `ids` to the current context and generates from there.
    pub fn continue_ids(
        &mut self,
        ids: &[u32],
        config: &GenerationConfig,
        on_text: impl FnMut(&str),
    ) -> Result<GenerationOutput, Error> {
        self.continue_ids_with_images(ids, &[], config, on_text)
    }

    /// Like [`Generator::generate`], as an iterator of tokens: each `next()` runs one step.
    /// Dropping the stream stops generation there; the conversation keeps every token it
    /// yielded.
    pub fn generate_stream(&mut self, prompt: &str, config: &GenerationConfig) -> Result<TokenStream<'_, B>, Error> {
        let ids = self.prompt_ids(prompt)?;
        self.reset();
        self.stream_ids(&ids, config)
    }

    /// Like [`Generator::chat`], as an iterator of tokens (see [`Generator::generate_stream`]).
    pub fn chat_stream(&mut self, message: &str, config: &GenerationConfig) -> Result<TokenStream<'_, B>, Error> {
        let ids = self.turn_ids(message)?;
        self.stream_ids(&ids, config)
    }

    /// Like [`Generator::continue_ids`], as an iterator of tokens.
    pub fn stream_ids(&mut self, ids: &[u32], config: &GenerationConfig) -> Result<TokenStream<'_, B>, Error> {
        let run = self.start(ids, config)?;
        Ok(TokenStream { generator: self, run: Some(run) })
    }

    /// Checks a request and sets up its run: the cache sized for it, nothing run yet.
    fn start(&mut self, ids: &[u32], config: &GenerationConfig) -> Result<Run, Error> {
        self.start_with_images(ids, &[], config)
    }

    /// [`Generator::start`] with the features of `images` for the soft-token runs of `ids`
    /// (computed before anything else changes).
    fn start_with_images(&mut self, ids: &[u32], images: &[Picture], config: &GenerationConfig) -> Result<Run, Error> {
        check_input(ids, config, self.model.config().vocab_size)?;
        let features = self.image_features(ids, images)?;
        let sampler = Sampler::new(config.sampling.clone())?;
        let graph = self.graph_plan(config.cuda_graph, &sampler)?;
        let needed = self.context.len().saturating_add(ids.len()).saturating_add(config.max_new_tokens);
        let limit = self.max_context();
        if self.context.len() + ids.len() + 1 > limit || (self.context.is_empty() && needed > limit) {
            return Err(RequestError::ContextOverflow {
                context: self.context.len(),
                prompt: ids.len(),
                new: config.max_new_tokens,
                needed,
                limit,
            }
            .into());
        }
        let capacity = needed.min(limit);
        // Verify steps replayed as CUDA graphs write every draft before any attends: the cache
        // then keeps every position of its sliding windows (`graph` is off where an assistant,
        // which reads the model's hidden states, drafts).
        let cuda = burn_gemma_kernels::graph::available::<B>(&self.model.device()).is_ok();
        self.window_store = match graph && cuda && self.speculation.is_some() {
            true => WindowStore::EveryPosition,
            false => WindowStore::Ring,
        };
        self.settle_cache();
        if let Some(spec) = &mut self.speculation {
            spec.restart();
        }
        let cache = self.take_cache(capacity)?;
        // A reply's last token was sampled but never run through the model: it is in the
        // context, not in the cache, so it runs first, ahead of the new ids.
        let mut input = self.context.split_off(cache.len().min(self.context.len()));
        let offset = input.len();
        input.extend_from_slice(ids);
        self.pending_images =
            features.into_iter().map(|image| ImageEmbeds { start: offset + image.start, ..image }).collect();
        self.cache = Some(cache);
        let start = Instant::now();
        Ok(Run {
            sampler,
            graph,
            cuda_graph: config.cuda_graph,
            prefill_chunk: config.prefill_chunk,
            capacity,
            output: SequenceOutput::new(OutputRules {
                stop_tokens: self
                    .default_stops
                    .iter()
                    .chain(&config.stop_tokens)
                    .copied()
                    .chain(self.tool_handover())
                    .collect(),
                stop_strings: config.stop_strings.clone(),
                max_new_tokens: config.max_new_tokens,
            }),
            start,
            decode_start: start,
            tuning_before: burn_gemma_kernels::gemm::tune::summary().time,
            stats: Stats {
                prompt_tokens: ids.len(),
                speculation: self.speculation.as_ref().map(|_| SpeculationStats::default()),
                ..Default::default()
            },
            text: String::new(),
            tokens: Vec::new(),
            input,
            queue: VecDeque::new(),
            draft_sampler: Sampler::new(SamplingConfig {
                seed: config.sampling.seed ^ 0x5eed_d4af,
                ..config.sampling.clone()
            })?,
            stop: None,
        })
    }

    /// The features of each picture, by the row of `ids` where its soft tokens start.
    fn image_features(&self, ids: &[u32], images: &[Picture]) -> Result<Vec<ImageEmbeds<B>>, Error> {
        match self.vision.as_ref() {
            Some(vision) => vision.embeds(ids, images, &self.model.device()),
            None if images.is_empty() => Ok(Vec::new()),
            None => Err(ImageError::NoVision.into()),
        }
    }

    /// One step of `run`: the next token and its text, `None` once the run has stopped. An
    /// error stops the run.
    fn step(&mut self, run: &mut Run) -> Option<Result<Token, Error>> {
        if run.stop.is_some() {
            return None;
        }
        if self.interrupt.swap(false, Ordering::SeqCst) {
            run.stop = Some(StopReason::Interrupted);
            return None;
        }
        let result = self.next_token(run);
        if result.is_err() {
            // Nothing more comes of a failed step.
            run.stop = Some(StopReason::Failed);
        }
        match result {
            Ok(None) => None,
            Ok(Some(token)) => Some(Ok(token)),
            Err(e) => Some(Err(e)),
        }
    }

    fn next_token(&mut self, run: &mut Run) -> Result<Option<Token>, Error> {
        if let Some((token, cached)) = run.queue.pop_front() {
            return Ok(self.take_token(run, token, cached));
        }
        let step = run.tokens.len();
        if step > 0 {
            if let Some(spec) = &mut run.stats.speculation {
                spec.target_steps += 1;
            }
            if let Some((token, cached)) = self.speculative_step(run)? {
                return Ok(self.take_token(run, token, cached));
            }
        }
        let vocab = self.model.config().vocab_size;
        let draws = run.sampler.draws(1);
        let mut token = None;
        if run.graph && run.input.len() == 1 {
            match self.graph_step(&run.input, &draws, &run.sampler, &mut run.stats) {
                Ok(t) => token = Some(t),
                Err(e) => {
                    // Auto: eager from here on (a failed recording ran nothing: the cache is as
                    // it was); On: the step's error.
                    self.graph_failed(run, e)?;
                }
            }
        }
        let token = match token {
            Some(t) => {
                self.context.extend_from_slice(&run.input);
                t
            }
            None => {
                let device = self.model.device();
                let mut cache = self.take_cache(run.capacity)?;
                let chunk = run.prefill_chunk;
                let images = std::mem::take(&mut self.pending_images);
                let result = prefill_with_images(&self.model, &mut cache, &run.input, &images, chunk, &device);
                self.cache = Some(cache);
                let (logits, hidden) = result?;
                let hidden = self.reads_hidden_states().then_some(hidden);
                self.context.extend_from_slice(&run.input);
                let position = self.context.len() - 1;
                self.target_hidden = hidden.map(|hidden| TargetHidden { position, hidden });
                first_sampled(run.sampler.sample_with_draws(logits, &self.context, &draws)?)?
            }
        };
        let token = checked_token(token, vocab, step)?;
        if step == 0 {
            run.stats.prefill = run.start.elapsed();
            run.stats.time_to_first_token = run.start.elapsed();
            run.stats.gemm_tuning = burn_gemma_kernels::gemm::tune::summary().time.saturating_sub(run.tuning_before);
            run.decode_start = Instant::now();
        }
        Ok(self.take_token(run, token, false))
    }

    /// Hands out `token`: ends the run where it is a stop token, reaches a stop string or is
    /// the last the run may make, else makes it the next step's input (or, where the cache
    /// already holds it, a kept draft, part of the context). The token that ends the run
    /// carries the text still held back (a stop token only where some is), so a stream's
    /// tokens add up to the output's text.
    fn take_token(&mut self, run: &mut Run, token: u32, cached: bool) -> Option<Token> {
        run.tokens.push(token);
        let room = Room { used: self.context.len(), capacity: self.cache.as_ref().map_or(0, |c| c.capacity()) };
        let emitted = run.output.push(token, self.tokenizer.token_bytes(token), room);
        run.stop = emitted.stop;
        let text = match (emitted.text, run.stop.is_some()) {
            (Some(text), true) => Some(text + &run.output.finish()),
            (None, true) => Some(run.output.finish()).filter(|rest| !rest.is_empty()),
            (text, false) => text,
        };
        if let Some(text) = &text {
            run.text.push_str(text);
        }
        if run.stop.is_some() || cached {
            self.context.push(token);
        } else {
            run.input = vec![token];
        }
        if run.stop.is_some() {
            // Kept drafts after this one are in the cache, not in the context.
            run.queue.clear();
            self.settle_cache();
        }
        text.map(|text| Token { id: token, text })
    }

    /// Where a run ends before it stopped (a stream dropped or finished early): its last
    /// token, handed out but not yet run, joins the context (the next request runs it first).
    fn keep_yielded(&mut self, run: &Run) {
        if run.stop.is_none() && !run.tokens.is_empty() {
            self.context.extend_from_slice(&run.input);
        }
    }

    /// Takes the cache back to a prefix of the context where it holds drafts the context did
    /// not keep (a run that stopped part way through a verify step's tokens); where the last
    /// checkpoint cannot, empties it (the next request then runs the whole context again).
    fn settle_cache(&mut self) {
        let keep = self.context.len();
        let Some(cache) = self.cache.as_mut() else { return };
        if cache.len() > keep {
            let rewound = self.rewind.as_ref().is_some_and(|c| cache.rewind(c, keep).is_ok());
            if !rewound {
                cache.reset();
            }
        }
    }

    /// A step with drafts: the drafter proposes up to the step's length, the model scores the
    /// pending token and every draft in one forward pass, the longest agreeing prefix is kept
    /// and the model's own next token follows it. Returns the first token (the rest wait in
    /// the run's queue); `None` where nothing was drafted (the step runs as usual).
    fn speculative_step(&mut self, run: &mut Run) -> Result<Option<(u32, bool)>, Error> {
        let Some(mut spec) = self.speculation.take() else { return Ok(None) };
        let result = self.draft_and_verify(run, &mut spec);
        self.speculation = Some(spec);
        result
    }

    fn draft_and_verify(&mut self, run: &mut Run, spec: &mut Speculation<B>) -> Result<Option<(u32, bool)>, Error> {
        let Some(cache) = self.cache.as_ref() else { return Ok(None) };
        if !spec.drafts_now() {
            return Ok(None);
        }
        // The verify step writes the pending token and the drafts; the drafts beyond what the
        // run may still make, or the cache can take back, are not worth drafting.
        let room = cache.capacity().saturating_sub(cache.len() + run.input.len());
        let left = run.output.remaining().saturating_sub(1);
        let k = spec.next_length().min(room).min(left).min(cache.checkpoint_limit().saturating_sub(run.input.len()));
        if k == 0 || run.input.len() != 1 {
            return Ok(None);
        }
        let sequence: Vec<u32> = self.context.iter().chain(&run.input).copied().collect();
        let drafts = match &mut spec.drafter {
            Drafter::PromptLookup(lookup) => {
                let tokens = lookup.draft(&sequence, k);
                Drafts { proposals: vec![Proposal::Certain; tokens.len()], tokens }
            }
            Drafter::Model(model) => {
                let steps = match run.graph && self.window_store == WindowStore::EveryPosition {
                    true => DraftSteps::Graph,
                    false => DraftSteps::Eager,
                };
                model.draft(&sequence, k, &mut run.draft_sampler, (run.prefill_chunk, steps))?
            }
            Drafter::Assistant(assistant) => {
                // Drafts start from the state that chose the pending token.
                let Some(last) = self.target_hidden.as_ref().filter(|h| h.position + 1 == cache.len()) else {
                    return Ok(None);
                };
                let pending = (run.input[0], last.hidden.clone());
                assistant.draft(&self.model, cache, pending, &sequence, k, &mut run.draft_sampler)?
            }
        };
        if drafts.tokens.is_empty() {
            return Ok(None);
        }
        let drafted = drafts.tokens.len();
        let mut verified = None;
        if run.graph && cache.takes_consecutive_rows() {
            // One recording for every draft count: rows for the most drafts a step may make
            // (adaptive lengths move), as many as the cache has room for.
            let most = spec.max_length().min(room).max(k);
            match self.verify_on_graph(run, &drafts, most) {
                Ok(v) => verified = Some(v),
                Err(e) => {
                    // Auto: eager from here on (a failed recording ran nothing).
                    self.graph_failed(run, e)?;
                }
            }
        }
        let (checkpoint, kept, next, hidden) = match verified {
            Some((checkpoint, kept, next)) => (checkpoint, kept, next, None),
            None => {
                let mut cache = self.take_cache(run.capacity)?;
                let verified = (|| {
                    let checkpoint = cache.checkpoint(1 + drafted)?;
                    let ids: Vec<u32> = run.input.iter().chain(&drafts.tokens).copied().collect();
                    let ids = token_tensor(&ids, &self.model.device());
                    let hidden = self.model.forward_hidden(ids, &mut cache, QueryRows::Each)?;
                    Ok::<_, Error>((checkpoint, self.model.logits(hidden.clone())?, hidden))
                })();
                self.cache = Some(cache);
                let (checkpoint, logits, hidden) = verified?;
                self.context.append(&mut run.input);
                let [_, rows, vocab] = logits.dims();
                let step = run.tokens.len();
                let (kept, next) =
                    judge(&mut run.sampler, logits.reshape([rows, vocab]), &self.context, &drafts, step)?;
                (checkpoint, kept, next, Some(hidden))
            }
        };
        let keep = self.context.len() + kept;
        if let Some(cache) = self.cache.as_mut() {
            cache.rewind(&checkpoint, keep)?;
        }
        self.rewind = Some(checkpoint);
        if let Some(hidden) = hidden.filter(|_| spec.drafter.reads_hidden_states()) {
            // Row `kept` chose `next`.
            let [_, _, width] = hidden.dims();
            let row = hidden.slice([0..1, kept..kept + 1, 0..width]).reshape([1, width]);
            self.target_hidden = Some(TargetHidden { position: keep - 1, hidden: row });
        }
        if let Some(stats) = &mut run.stats.speculation {
            stats.verify_steps += 1;
            stats.drafted += drafted;
            stats.accepted += kept;
        }
        spec.adapt(drafted, kept);
        run.queue.extend(drafts.tokens[..kept].iter().map(|&t| (t, true)));
        run.queue.push_back((next, false));
        Ok(run.queue.pop_front())
    }

    /// The verify step replayed as a CUDA graph of `1 + k` rows (recorded first where needed):
    /// the pending token, the drafts, and copies of the last draft up to `k` (their rows are
    /// computed and never kept, so that one recording serves every draft count). Returns the
    /// checkpoint taken before it, the drafts kept and the model's own next token; the pending
    /// token joins the context. Greedy reads back each row's choice only; sampled reads the
    /// logits of the drafted rows.
    fn verify_on_graph(
        &mut self,
        run: &mut Run,
        drafts: &Drafts,
        k: usize,
    ) -> Result<(RewindPoint<B>, usize, u32), Error> {
        let rows = 1 + k;
        let drafted = drafts.tokens.len();
        let mut ids: Vec<u32> = run.input.iter().chain(&drafts.tokens).copied().collect();
        if let Some(&last) = ids.last() {
            ids.resize(rows, last);
        }
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::InvalidInput("KV cache missing".into()))?;
        let checkpoint = cache.checkpoint(rows)?;
        let at = self.verify_graphs.iter().position(|g| g.rows() == rows && g.serves(&SamplingParams::GREEDY, cache));
        let mut graphs = match at {
            Some(i) => self.verify_graphs.swap_remove(i),
            None => DecodeGraphs::verify(SamplingParams::GREEDY, rows, cache.capacity()),
        };
        let before = graphs.setup();
        let stepped = graphs.step(&self.model, cache, &ids, &vec![0.0; rows]);
        run.stats.count_setup(before, graphs.setup());
        let logits = graphs.last_logits();
        self.verify_graphs.push(graphs);
        let choices = stepped?;
        self.context.append(&mut run.input);
        if run.sampler.is_greedy() {
            let choices: Vec<i64> = choices.iter().map(|&t| i64::from(t)).collect();
            let (kept, next) =
                greedy_verdict(&drafts.tokens, &choices, self.model.config().vocab_size, run.tokens.len())?;
            return Ok((checkpoint, kept, next));
        }
        let logits = logits.ok_or_else(|| ModelError::InvalidInput("the verify step kept no logits".into()))?;
        let vocab = logits.dims()[1];
        let logits = logits.slice([0..1 + drafted, 0..vocab]).cast(burn::tensor::DType::F32);
        let (kept, next) = judge(&mut run.sampler, logits, &self.context, drafts, run.tokens.len())?;
        Ok((checkpoint, kept, next))
    }

    /// Whether the drafter starts from the model's final hidden states (a Gemma 4 assistant):
    /// every step then keeps its last one.
    fn reads_hidden_states(&self) -> bool {
        self.speculation.as_ref().is_some_and(|s| s.drafter.reads_hidden_states())
    }

    /// Whether decode steps replay a CUDA graph in `mode` with this sampler: `On` where it
    /// cannot is an error; `Auto` stays eager (the repetition penalty runs as eager tensor
    /// operations, and backends other than CUDA have no graphs).
    fn graph_plan(&mut self, mode: CudaGraph, sampler: &Sampler) -> Result<bool, Error> {
        let reads_hidden = self.reads_hidden_states();
        match mode {
            CudaGraph::Off => Ok(false),
            CudaGraph::On if reads_hidden => Err(RequestError::CudaGraphWithAssistant.into()),
            CudaGraph::Auto if reads_hidden => Ok(false),
            CudaGraph::On if sampler.penalizes() => Err(RequestError::CudaGraphWithPenalty.into()),
            CudaGraph::Auto if sampler.penalizes() || !self.graph_policy.replays(mode, 1) => Ok(false),
            CudaGraph::On => {
                // Said before any work, not after the first token.
                burn_gemma_kernels::graph::available::<B>(&self.model.device()).map_err(ModelError::from)?;
                Ok(true)
            }
            CudaGraph::Auto => Ok(true),
        }
    }

    /// One decode step replayed as a CUDA graph (recorded first where needed).
    fn graph_step(
        &mut self,
        input: &[u32],
        draws: &[f32],
        sampler: &Sampler,
        stats: &mut Stats,
    ) -> Result<i64, ModelError> {
        let cache = self.cache.as_mut().ok_or_else(|| ModelError::InvalidInput("KV cache missing".into()))?;
        let mut graphs = match self.graphs.take() {
            Some(g) if g.serves(&sampler.params(), cache) => g,
            _ => DecodeGraphs::new(sampler.params(), cache.batch(), cache.capacity()),
        };
        let before = graphs.setup();
        let ids = graphs.step(&self.model, cache, input, draws)?;
        stats.graph_steps += 1;
        stats.count_setup(before, graphs.setup());
        self.graphs = Some(graphs);
        Ok(ids.first().map_or(-1, |&t| i64::from(t)))
    }

    /// A step that could not be replayed: under `Auto` this and later runs decode eagerly (a
    /// generator's graphs, decode and verify, go together: the policy is asked for one row),
    /// the reason kept ([`Generator::eager_reason`]); under `On` it is the step's error.
    fn graph_failed<E: GraphFailure>(&mut self, run: &mut Run, failure: E) -> Result<(), E> {
        self.graph_policy.fall_back(run.cuda_graph, 1, failure)?;
        run.graph = false;
        self.graphs = None;
        self.verify_graphs.clear();
        Ok(())
    }

    /// Why decode steps run eagerly under [`CudaGraph::Auto`] (`None` while graphs are used or
    /// not yet tried).
    pub fn eager_reason(&self) -> Option<&EagerReason> {
        self.graph_policy.eager_reason()
    }

    /// The cache, taken out of the generator (put it back after use), reallocated first where it
    /// holds fewer than `capacity` positions.
    fn take_cache(&mut self, capacity: usize) -> Result<KvCache<B>, Error> {
        let old_capacity = self.cache.as_ref().map_or(0, |c| c.capacity());
        let windows = self.window_store;
        // A cache keeping every position serves ring layouts' steps too: kept rather than
        // reallocated (with its recorded steps) when drafting stops.
        let serves = |c: &KvCache<B>| c.window_store() == windows || windows == WindowStore::Ring;
        let cache = match self.cache.take().filter(|c| c.capacity() >= capacity && serves(c)) {
            Some(cache) => cache,
            None => {
                // Grow in steps so that a chat does not reallocate every turn; the old cache is
                // freed before the new one is allocated.
                let limit = self.max_context();
                let capacity = capacity.max(old_capacity * 2).next_multiple_of(256).min(limit);
                let mut cache = match self.model.new_cache_with(1, capacity, windows) {
                    // Every position of the sliding windows does not fit: rings, and verify
                    // steps run eagerly.
                    Err(ModelError::DeviceMemory { .. }) if windows == WindowStore::EveryPosition => {
                        self.window_store = WindowStore::Ring;
                        self.model.new_cache_with(1, capacity, WindowStore::Ring)?
                    }
                    other => other?,
                };
                // The recorded steps write the old cache's buffers.
                self.graphs = None;
                self.verify_graphs.clear();
                if !self.context.is_empty() {
                    // Re-run the conversation into the larger cache.
                    self.model.forward_last(token_tensor(&self.context, &self.model.device()), &mut cache)?;
                }
                cache
            }
        };
        Ok(cache)
    }
}

/// Fails where `tokenizer` has more tokens than the model's embedding table.
pub(crate) fn check_vocabulary(config: &GemmaConfig, tokenizer: &Tokenizer) -> Result<(), Error> {
    let vocab = config.vocab_size;
    if tokenizer.vocab_size() > vocab {
        return Err(TokenizerError::VocabularyTooLarge { tokenizer: tokenizer.vocab_size(), model: vocab }.into());
    }
    Ok(())
}

/// The tokens that end a reply of the model whatever the request: its EOS ids, its chat
/// template's end of turn and `<eos>`, sorted.
pub fn default_stop_tokens(config: &GemmaConfig, tokenizer: &Tokenizer) -> Vec<u32> {
    let template = ChatTemplate::for_architecture(config.model_type);
    let mut stops = config.eos_token_id.clone();
    stops.extend(tokenizer.token_id(template.end_of_turn()));
    stops.extend(tokenizer.token_id("<eos>"));
    stops.sort_unstable();
    stops.dedup();
    stops
}

/// The checks of a request's input `ids` and token budget, for a model of `vocab` tokens.
pub(crate) fn check_input(ids: &[u32], config: &GenerationConfig, vocab: usize) -> Result<(), Error> {
    let rules = OutputRules {
        stop_strings: config.stop_strings.clone(),
        max_new_tokens: config.max_new_tokens,
        ..Default::default()
    };
    rules.check()?;
    if ids.is_empty() {
        return Err(RequestError::NoInput.into());
    }
    if let Some(&id) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(RequestError::TokenOutOfVocabulary { id, vocab }.into());
    }
    Ok(())
}

/// [`prefill`] with pictures (`images`: their features by the row of `input` where their soft
/// tokens start, in order), returning the last position's logits and final hidden state
/// (`[1, hidden]`). A chunk that would end inside a picture's tokens runs on to its end.
pub(crate) fn prefill_with_images<B: GemmaBackend>(
    model: &Gemma<B>,
    cache: &mut KvCache<B>,
    input: &[u32],
    images: &[ImageEmbeds<B>],
    chunk: NonZeroUsize,
    device: &B::Device,
) -> Result<(Tensor<B, 2>, Tensor<B, 2>), Error> {
    let mut start = 0;
    loop {
        let end = chunk_end(images, (start + chunk.get()).min(input.len()));
        let ids = token_tensor(&input[start..end], device);
        let hidden = if end == input.len() || images.iter().any(|i| (start..end).contains(&i.start)) {
            let here: Vec<ImageEmbeds<B>> = images
                .iter()
                .filter(|i| (start..end).contains(&i.start))
                .map(|i| ImageEmbeds { start: i.start - start, features: i.features.clone() })
                .collect();
            match here.is_empty() {
                true => model.forward_hidden(ids, cache, QueryRows::Together)?,
                false => model.forward_hidden_with_images(ids, &here, cache)?,
            }
        } else {
            model.forward_last(ids, cache)?;
            start = end;
            continue;
        };
        if end == input.len() {
            let [batch, seq, width] = hidden.dims();
            let hidden = hidden.slice([0..batch, seq - 1..seq, 0..width]);
            let logits = model.logits(hidden.clone())?;
            return Ok((logits.reshape([batch, model.config().vocab_size]), hidden.reshape([batch, width])));
        }
        start = end;
    }
}

/// Where a prompt chunk that would end at `end` ends: run on to the end of a picture it would
/// end inside (a picture's soft tokens attend to each other in one step).
pub(crate) fn chunk_end<B: GemmaBackend>(images: &[ImageEmbeds<B>], end: usize) -> usize {
    let inside = images.iter().find(|i| i.start < end && i.start + i.features.dims()[0] > end);
    inside.map_or(end, |i| i.start + i.features.dims()[0])
}

/// Runs `input` into `cache` in chunks of at most `chunk` tokens and returns the last position's
/// logits (every chunk but the last only fills the cache).
pub(crate) fn prefill<B: GemmaBackend>(
    model: &Gemma<B>,
    cache: &mut KvCache<B>,
    input: &[u32],
    chunk: NonZeroUsize,
    device: &B::Device,
) -> Result<Tensor<B, 2>, Error> {
    let chunk = chunk.get();
    let last = input.len().saturating_sub(1) / chunk * chunk;
    for filling in input[..last].chunks(chunk) {
        model.forward_last(token_tensor(filling, device), cache)?;
    }
    Ok(model.forward_last(token_tensor(&input[last..], device), cache)?)
}

/// Fails for one shard of a split model: it runs only beside the other shards, through
/// [`ShardedModel`] (alone, its first all-reduce would wait for them for ever).
pub(crate) fn refuse_shard<B: GemmaBackend>(model: &Gemma<B>) -> Result<(), Error> {
    match model.parallel() {
        Some(p) => Err(ModelError::TensorParallel(format!(
            "shard {} of {} of a split model runs only with the other shards, in a ShardedModel",
            p.shard.rank(),
            p.shard.world()
        ))
        .into()),
        None => Ok(()),
    }
}
