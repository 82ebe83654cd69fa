//! A model split over several devices of one host (tensor parallelism, see
//! [`burn_gemma_model::tensor_parallel`]): [`ShardedModel`] keeps one thread per device, each
//! holding its shard and its shard's KV cache, and runs every step on all of them at once; the
//! shards meet only in their all-reduces. On CUDA the all-reduce is NCCL's (the `nccl` module, with the `cuda` feature); on
//! other backends [`HostAllReduce`] adds the shards' values on the host.

#[cfg(feature = "cuda")]
pub mod nccl;

use crate::{
    generation::token_tensor,
    graph_policy::{EagerReason, GraphPolicy},
    sampling::Sampler,
    Checkpoint, Error, LoadOptions, SamplingConfig,
};
use burn::tensor::{DType, Tensor};
use burn_gemma_kernels::SamplingParams;
use burn_gemma_kernels::{GemmaBackend, KernelTuning};
use burn_gemma_model::{
    bucket_bound, CudaGraph, DecodeGraphs, Gemma, GemmaConfig, KvCache, ModelError, ModelOptions, WeightSource,
};
pub use burn_gemma_model::{AllReduce, HostAllReduce, Shard, TensorParallel};
#[cfg(feature = "cuda")]
use std::any::Any;
use std::{
    sync::{mpsc, Arc},
    thread::JoinHandle,
};

/// How long the other shards get to answer once one has failed.
const GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// One all-reduce handle per shard, in rank order.
pub type AllReduces<B> = Vec<Arc<dyn AllReduce<B>>>;

/// What every shard does in one call.
#[derive(Debug, Clone)]
enum Command {
    /// A fresh KV cache of this many positions.
    NewCache(usize),
    /// These tokens after the cache's positions; the last position's logits.
    Logits(Vec<u32>),
    /// These tokens after the cache's positions; the last position's greedy token.
    Greedy(Vec<u32>),
    /// Record the greedy decode step the cache's next position needs, unless recorded.
    Record,
    /// This token through the recorded step; its greedy successor.
    Replay(u32),
    /// Forget the recorded steps: every step eager from now on.
    Eager,
    /// Run passes (and record steps) with this tuning from now on; the recorded steps are forgotten.
    Tuning(KernelTuning),
}

/// What shard 0 gives back (the others give back nothing but success).
enum Reply {
    Done,
    Logits(Vec<f32>),
    Token(u32),
}

/// What a shard's failure does to the others while their replies are awaited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Release {
    /// A step: the all-reduce is aborted, so that shards waiting in it for the failed one
    /// answer (the host all-reduce's do; it stays aborted, as the model is then broken).
    Abort,
    /// A command whose failure leaves the model usable (recording a step, forgetting one):
    /// nothing is aborted.
    Wait,
}

/// The shards' replies to one command.
struct Replies {
    /// By rank.
    all: Vec<Result<Reply, Error>>,
    /// The first shard that failed (not one left waiting for it).
    failed: Option<usize>,
    /// A shard never answered after another failed: it waits in a device collective.
    left_waiting: bool,
}

/// What a shard's thread keeps between commands.
struct ShardState<B: GemmaBackend> {
    cache: Option<KvCache<B>>,
    /// Its greedy decode steps recorded as CUDA graphs (they write `cache`'s buffers).
    graphs: Option<DecodeGraphs<B>>,
}

struct Worker {
    commands: mpsc::Sender<Command>,
    replies: mpsc::Receiver<Result<Reply, Error>>,
    thread: Option<JoinHandle<()>>,
}

/// A Gemma model split over several devices, each shard on a thread of its own.
///
/// ```no_run
/// # #[cfg(feature = "cuda")]
/// # fn main() -> Result<(), burn_gemma::Error> {
/// use burn_gemma::{backends::Cuda, tensor_parallel::ShardedModel, Checkpoint, LoadOptions};
/// let checkpoint = Checkpoint::open("gemma-3-27b-it-Q8_0.gguf")?;
/// let devices = [0, 1].map(burn::backend::cuda::CudaDevice::new);
/// let mut model = ShardedModel::<Cuda>::load_nccl(&checkpoint, &devices, |d| LoadOptions::new().device(d.clone()))?;
/// model.new_cache(4096)?;
/// let logits = model.logits(&[2, 651, 6037, 576, 6081, 603])?; // the last position's
/// # Ok(()) }
/// # #[cfg(not(feature = "cuda"))]
/// # fn main() {}
/// ```
pub struct ShardedModel<B: GemmaBackend> {
    workers: Vec<Worker>,
    reduces: AllReduces<B>,
    config: GemmaConfig,
    /// Positions in the shards' caches.
    position: usize,
    /// Their capacity, once made.
    capacity: Option<usize>,
    /// A step failed part-way on some shards: their caches and all-reduces no longer agree.
    broken: bool,
    /// Whether greedy decode steps replay a recorded CUDA graph on each device.
    cuda_graph: CudaGraph,
    /// The position bound the shards' recorded steps serve (none recorded: `None`).
    recorded: Option<usize>,
    /// What replaying decode steps taught so far.
    graph_policy: GraphPolicy,
}

impl<B: GemmaBackend> ShardedModel<B> {
    /// Loads shard `i` of `checkpoint` on `devices[i]` (`options` gives each device's load
    /// options), every shard on its own thread, joined by `reduces[i]`. One device loads the
    /// whole model, with no all-reduce.
    pub fn load(
        checkpoint: &Checkpoint,
        devices: &[B::Device],
        options: impl Fn(&B::Device) -> LoadOptions<B> + Sync,
        reduces: AllReduces<B>,
    ) -> Result<Self, Error> {
        let world = devices.len();
        if world == 0 || (world > 1 && reduces.len() != world) {
            return Err(ModelError::TensorParallel(format!(
                "{world} devices and {} all-reduce handles: give one handle per device",
                reduces.len()
            ))
            .into());
        }
        if world > 1 {
            // Refused before any thread reads a weight.
            Shard::new(0, world)?.config(checkpoint.config())?;
        }
        let options = &options;
        let shards: Vec<Result<Gemma<B>, Error>> = std::thread::scope(|s| {
            let threads: Vec<_> = devices
                .iter()
                .enumerate()
                .map(|(rank, device)| {
                    let reduce = reduces.get(rank).cloned();
                    s.spawn(move || {
                        let options = options(device);
                        let loaded = match reduce {
                            Some(reduce) if world > 1 => {
                                let shard = Shard::new(rank, world)?;
                                checkpoint.load_shard(options, TensorParallel { shard, reduce })?
                            }
                            _ => checkpoint.load(options)?,
                        };
                        Ok(loaded.model)
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| {
                    t.join().unwrap_or_else(|_| {
                        Err(ModelError::TensorParallel("a shard's loading thread panicked".into()).into())
                    })
                })
                .collect()
        });
        let shards = shards.into_iter().collect::<Result<Vec<_>, _>>()?;
        Self::new(shards, checkpoint.config().clone(), if world > 1 { reduces } else { Vec::new() })
    }

    /// `config`'s model split over `devices` (one whole model for one device), joined by
    /// `reduces`, its shards loaded one after another on this thread, each from a fresh
    /// `source()` that gives the whole model's tensors in order (each shard keeps its part): a
    /// random-weight model ([`burn_gemma_model::RandomWeights`] from one seed) split as a
    /// checkpoint is.
    pub fn load_from<S: WeightSource<B> + Send>(
        config: GemmaConfig,
        mut source: impl FnMut() -> S,
        options: &ModelOptions,
        devices: &[B::Device],
        reduces: AllReduces<B>,
    ) -> Result<Self, Error> {
        let world = devices.len();
        if world == 1 {
            let model = Gemma::load(config.clone(), &mut source(), options, &devices[0])?;
            return Self::new(vec![model], config, Vec::new());
        }
        if reduces.len() != world {
            return Err(ModelError::TensorParallel(format!(
                "{world} devices and {} all-reduce handles: give one handle per device",
                reduces.len()
            ))
            .into());
        }
        let mut shards = Vec::with_capacity(world);
        for (rank, (device, reduce)) in devices.iter().zip(&reduces).enumerate() {
            let parallel = TensorParallel { shard: Shard::new(rank, world)?, reduce: reduce.clone() };
            shards.push(Gemma::load_shard(config.clone(), &mut source(), options, device, parallel)?);
        }
        Self::new(shards, config, reduces)
    }

    /// The shards of `config`'s model (each loaded by [`Gemma::load_shard`], in rank order, or
    /// one whole model), joined by `reduces` (one per shard; none for one whole model).
    pub fn new(shards: Vec<Gemma<B>>, config: GemmaConfig, reduces: AllReduces<B>) -> Result<Self, Error> {
        let world = shards.len();
        for (rank, shard) in shards.iter().enumerate() {
            let place = shard.parallel().map(|p| (p.shard.rank(), p.shard.world()));
            let expected = if world == 1 { None } else { Some((rank, world)) };
            if place != expected && !(world == 1 && place == Some((0, 1))) {
                return Err(ModelError::TensorParallel(format!(
                    "model {rank} of {world} is {}",
                    match place {
                        Some((r, w)) => format!("shard {r} of {w}"),
                        None => "a whole model".into(),
                    }
                ))
                .into());
            }
        }
        let workers = shards.into_iter().enumerate().map(|(rank, model)| Worker::spawn(rank, model)).collect();
        Ok(Self {
            workers,
            reduces,
            config,
            position: 0,
            capacity: None,
            broken: false,
            cuda_graph: CudaGraph::Auto,
            recorded: None,
            graph_policy: GraphPolicy::default(),
        })
    }

    /// Whether greedy decode steps (one token after the prompt, [`ShardedModel::greedy`])
    /// replay a CUDA graph recorded on each device, the shards' all-reduces recorded into it
    /// (NCCL): [`CudaGraph::Auto`] by default (eager where a step cannot be recorded, or off
    /// CUDA), [`CudaGraph::On`] to fail instead.
    pub fn set_cuda_graph(&mut self, mode: CudaGraph) -> Result<(), Error> {
        if mode == CudaGraph::Off && self.recorded.is_some() {
            self.run(Command::Eager)?;
            self.recorded = None;
        }
        self.cuda_graph = mode;
        self.graph_policy = GraphPolicy::default();
        Ok(())
    }

    /// Makes every shard's passes, and the steps recorded from them after this call, choose
    /// and launch kernels as `tuning` says; steps recorded before are forgotten.
    pub fn set_tuning(&mut self, tuning: KernelTuning) -> Result<(), Error> {
        self.each(Command::Tuning(tuning))?;
        self.recorded = None;
        Ok(())
    }

    /// Why decode steps run eagerly in [`CudaGraph::Auto`] mode, once a recording failed.
    pub fn eager_reason(&self) -> Option<&EagerReason> {
        self.graph_policy.eager_reason()
    }

    /// The whole model's config.
    pub fn config(&self) -> &GemmaConfig {
        &self.config
    }

    /// How many devices the model is split over.
    pub fn world(&self) -> usize {
        self.workers.len()
    }

    /// Positions in the KV caches.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Fresh KV caches of `capacity` positions on every shard (the context so far forgotten;
    /// caches of that size already there are emptied and kept, with their recorded steps).
    pub fn new_cache(&mut self, capacity: usize) -> Result<(), Error> {
        if self.capacity != Some(capacity) {
            // A cache of another size: the recorded steps go with the old one.
            self.recorded = None;
        }
        self.capacity = None;
        self.run(Command::NewCache(capacity))?;
        self.position = 0;
        self.capacity = Some(capacity);
        Ok(())
    }

    /// `ids` after the positions in the caches (a prompt, or one generated token); the last
    /// position's logits over the whole vocabulary (f32, capped where the config caps them).
    pub fn logits(&mut self, ids: &[u32]) -> Result<Vec<f32>, Error> {
        match self.step(ids, Command::Logits)? {
            Reply::Logits(logits) => Ok(logits),
            _ => Err(Self::lost()),
        }
    }

    /// Like [`ShardedModel::logits`], but only the last position's greedy token comes back
    /// from the device.
    pub fn greedy(&mut self, ids: &[u32]) -> Result<u32, Error> {
        if let ([id], Some(capacity)) = (ids, self.capacity) {
            if self.graph_ready(capacity)? {
                return match self.step(ids, |_| Command::Replay(*id))? {
                    Reply::Token(id) => Ok(id),
                    _ => Err(Self::lost()),
                };
            }
        }
        match self.step(ids, Command::Greedy)? {
            Reply::Token(id) => Ok(id),
            _ => Err(Self::lost()),
        }
    }

    /// Whether the next decode step replays a graph: records it on every shard first where
    /// the position left the recorded bucket. A recording that fails on any shard turns the
    /// graphs off on all ([`CudaGraph::Auto`]) or is the step's error ([`CudaGraph::On`]).
    fn graph_ready(&mut self, capacity: usize) -> Result<bool, Error> {
        if !self.graph_policy.replays(self.cuda_graph, 1) || self.position >= capacity {
            return Ok(false);
        }
        let bound = bucket_bound(self.position, capacity);
        if self.recorded == Some(bound) {
            return Ok(true);
        }
        let failure = match self.each(Command::Record) {
            Ok(()) => {
                self.recorded = Some(bound);
                return Ok(true);
            }
            Err(e) => e,
        };
        self.recorded = None;
        if self.broken {
            return Err(failure);
        }
        self.each(Command::Eager)?;
        self.graph_policy.fall_back(self.cuda_graph, 1, failure)?;
        Ok(false)
    }

    /// `command` (one that touches no cache: recording a step, forgetting one) on every shard;
    /// the first failure is the error, and the model stays usable unless a shard was left
    /// waiting in a collective.
    fn each(&mut self, command: Command) -> Result<(), Error> {
        let mut replies = self.broadcast(command, Release::Wait)?;
        // A shard left waiting in a collective: nothing more can run on these shards.
        self.broken |= replies.left_waiting;
        match replies.failed {
            Some(rank) => replies.all.swap_remove(rank).map(|_| ()),
            None => Ok(()),
        }
    }

    /// `command` sent to every shard (refused once the model is broken) and their replies; a
    /// shard whose thread is gone counts as failed.
    fn broadcast(&mut self, command: Command, release: Release) -> Result<Replies, Error> {
        if self.broken {
            return Err(ModelError::TensorParallel(
                "an earlier step failed on some shards only; load the model again".into(),
            )
            .into());
        }
        let sent = self.workers.iter().take_while(|worker| worker.commands.send(command.clone()).is_ok()).count();
        let mut replies = self.replies(sent, release);
        if sent < self.workers.len() {
            replies.all.push(Err(ModelError::TensorParallel("a shard's thread stopped".into()).into()));
            replies.failed.get_or_insert(sent);
        }
        Ok(replies)
    }

    /// The replies of the first `sent` shards to the command just sent, and whether one failed.
    /// Once one has failed the others get [`GRACE`] to answer: a shard waiting in a device
    /// collective for the one that failed never does (an NCCL call cannot be called back), and
    /// is left behind with an error naming it.
    fn replies(&self, sent: usize, release: Release) -> Replies {
        use std::time::{Duration, Instant};
        let mut replies: Vec<Option<Result<Reply, Error>>> = (0..sent).map(|_| None).collect();
        let mut failed: Option<(usize, Instant)> = None;
        let mut left_waiting = false;
        while replies.iter().any(Option::is_none) {
            for (rank, worker) in self.workers[..sent].iter().enumerate() {
                if replies[rank].is_some() {
                    continue;
                }
                let reply = match worker.replies.recv_timeout(Duration::from_millis(20)) {
                    Ok(reply) => reply,
                    Err(mpsc::RecvTimeoutError::Timeout) => match failed {
                        Some((failed, at)) if at.elapsed() > GRACE => {
                            left_waiting = true;
                            Err(ModelError::TensorParallel(format!(
                                "shard {rank} is left waiting in a collective after shard {failed} failed"
                            ))
                            .into())
                        }
                        _ => continue,
                    },
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        Err(ModelError::TensorParallel("a shard's thread stopped".into()).into())
                    }
                };
                if reply.is_err() && failed.is_none() {
                    failed = Some((rank, Instant::now()));
                    if release == Release::Abort {
                        // The host all-reduce releases the shards waiting in it.
                        self.reduces.iter().for_each(|r| r.abort());
                    }
                }
                replies[rank] = Some(reply);
            }
        }
        Replies {
            all: replies.into_iter().map(|r| r.unwrap_or_else(|| Err(Self::lost()))).collect(),
            failed: failed.map(|(rank, _)| rank),
            left_waiting,
        }
    }

    fn lost() -> Error {
        ModelError::TensorParallel("shard 0 gave no result".into()).into()
    }

    /// `ids` after the caches' positions as `command` asks, checked here first.
    fn step(&mut self, ids: &[u32], command: impl FnOnce(Vec<u32>) -> Command) -> Result<Reply, Error> {
        let tokens = ids.len();
        if tokens == 0 {
            return Err(ModelError::InvalidInput("empty token sequence".into()).into());
        }
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.config.vocab_size) {
            return Err(ModelError::InvalidInput(format!(
                "token id {id} is past the vocabulary of {}",
                self.config.vocab_size
            ))
            .into());
        }
        let Some(capacity) = self.capacity else {
            return Err(ModelError::InvalidInput("no KV cache yet: call new_cache first".into()).into());
        };
        if self.position + tokens > capacity {
            return Err(ModelError::ContextOverflow { needed: self.position + tokens, capacity }.into());
        }
        let reply = self.run(command(ids.to_vec()))?;
        self.position += tokens;
        Ok(reply)
    }

    /// `command` on every shard; shard 0's reply.
    fn run(&mut self, command: Command) -> Result<Reply, Error> {
        let Replies { mut all, failed, .. } = self.broadcast(command, Release::Abort)?;
        // Requests are checked before they reach the shards, so a failure here is one shard's
        // (a device error): the shards' caches no longer agree.
        if let Some(rank) = failed {
            self.broken = true;
            return Err(all.swap_remove(rank).err().unwrap_or_else(Self::lost));
        }
        all.into_iter().next().unwrap_or_else(|| Err(Self::lost()))
    }
}

impl<B: GemmaBackend> Drop for ShardedModel<B> {
    fn drop(&mut self) {
        if self.broken {
            // A shard may be waiting in a device collective for ever: its thread is left
            // behind rather than waited for.
            return;
        }
        for worker in &mut self.workers {
            // Closing the command channel ends the thread's loop.
            let (closed, _) = mpsc::channel();
            drop(std::mem::replace(&mut worker.commands, closed));
            if let Some(thread) = worker.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

impl Worker {
    fn spawn<B: GemmaBackend>(rank: usize, mut model: Gemma<B>) -> Self {
        let (commands, inbox) = mpsc::channel::<Command>();
        let (outbox, replies) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name(format!("burn-gemma shard {rank}"))
            .spawn(move || {
                let mut state = ShardState { cache: None, graphs: None };
                while let Ok(command) = inbox.recv() {
                    let reply = Self::execute(rank, &mut model, &mut state, command);
                    if outbox.send(reply).is_err() {
                        break;
                    }
                }
            })
            .ok();
        Self { commands, replies, thread }
    }

    fn execute<B: GemmaBackend>(
        rank: usize,
        model: &mut Gemma<B>,
        state: &mut ShardState<B>,
        command: Command,
    ) -> Result<Reply, Error> {
        let no_cache = || ModelError::InvalidInput("no KV cache yet: call new_cache first".into());
        let tokens = match &command {
            Command::NewCache(capacity) => {
                if let Some(cache) = state.cache.as_mut().filter(|c| c.capacity() == *capacity) {
                    // Emptied in place: the recorded steps, which write its buffers, stay valid.
                    cache.reset();
                } else {
                    state.graphs = None;
                    state.cache = None;
                    state.cache = Some(model.new_cache(1, *capacity)?);
                }
                return Ok(Reply::Done);
            }
            Command::Eager => {
                state.graphs = None;
                return Ok(Reply::Done);
            }
            Command::Tuning(tuning) => {
                model.set_tuning(tuning.clone());
                state.graphs = None;
                return Ok(Reply::Done);
            }
            Command::Record => {
                let cache = state.cache.as_mut().ok_or_else(no_cache)?;
                let graphs =
                    state.graphs.get_or_insert_with(|| DecodeGraphs::new(SamplingParams::GREEDY, 1, cache.capacity()));
                graphs.prepare(model, cache)?;
                return Ok(Reply::Done);
            }
            Command::Replay(id) => {
                let cache = state.cache.as_mut().ok_or_else(no_cache)?;
                let graphs = state.graphs.as_mut().ok_or_else(|| {
                    ModelError::TensorParallel("a graph replay asked of a shard with no recorded step".into())
                })?;
                let next = graphs.step(model, cache, &[*id], &[0.0])?;
                return Ok(if rank == 0 {
                    Reply::Token(next.first().copied().unwrap_or(u32::MAX))
                } else {
                    Reply::Done
                });
            }
            Command::Logits(ids) | Command::Greedy(ids) => ids,
        };
        let cache = state.cache.as_mut().ok_or_else(no_cache)?;
        let logits: Tensor<B, 2> = model.forward_last(token_tensor::<B>(tokens, &model.device()), cache)?;
        if rank != 0 {
            return Ok(Reply::Done);
        }
        match command {
            Command::Greedy(_) => {
                let id = logits
                    .argmax(1)
                    .into_data()
                    .convert::<i64>()
                    .into_vec::<i64>()
                    .map_err(|e| ModelError::ReadBack { what: "the greedy token", reason: format!("{e:?}") })?;
                Ok(Reply::Token(id.first().copied().unwrap_or(0) as u32))
            }
            _ => {
                let values = logits
                    .cast(DType::F32)
                    .into_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .map_err(|e| ModelError::ReadBack { what: "the logits", reason: format!("{e:?}") })?;
                Ok(Reply::Logits(values))
            }
        }
    }
}

/// The host all-reduce's handles of `world` shards, as the trait objects
/// [`ShardedModel::load`] takes.
pub fn host_all_reduce<B: GemmaBackend>(world: usize) -> AllReduces<B> {
    HostAllReduce::group(world).into_iter().map(|h| Arc::new(h) as Arc<dyn AllReduce<B>>).collect()
}

/// The devices a model split `world` ways runs on, starting at `first`, and their all-reduce:
/// CUDA devices `first..first + world` joined by NCCL (with the `cuda` feature), or `world`
/// shards on the one CPU device of a CPU backend joined through the host (a way to try the
/// split, not to speed it up). Other backends are refused.
pub fn split_devices<B: GemmaBackend>(
    first: &B::Device,
    world: usize,
) -> Result<(Vec<B::Device>, AllReduces<B>), Error> {
    if world == 0 {
        return Err(ModelError::TensorParallel("a model split over 0 devices".into()).into());
    }
    #[cfg(feature = "cuda")]
    if let Some(cuda) = (first as &dyn Any).downcast_ref::<burn::backend::cuda::CudaDevice>() {
        let devices: Vec<_> = (cuda.index..cuda.index + world).map(burn::backend::cuda::CudaDevice::new).collect();
        let present = burn_gemma_kernels::graph::cuda_device_count();
        if let Some(missing) = devices.iter().find(|d| d.index >= present) {
            return Err(ModelError::TensorParallel(format!(
                "CUDA device {} does not exist ({present} present): a split over {world} devices from device {} needs \
                 devices {}..{}",
                missing.index,
                cuda.index,
                cuda.index,
                cuda.index + world
            ))
            .into());
        }
        let reduces: Box<dyn Any> =
            Box::new(if world > 1 { nccl::NcclAllReduce::group(&devices)? } else { Vec::new() });
        let devices: Box<dyn Any> = Box::new(devices);
        return match (devices.downcast::<Vec<B::Device>>(), reduces.downcast::<AllReduces<B>>()) {
            (Ok(devices), Ok(reduces)) => Ok((*devices, *reduces)),
            _ => Err(ModelError::TensorParallel(format!(
                "CUDA devices on the {} backend: tensor parallelism runs on the crate's `backends::Cuda`",
                B::name(first)
            ))
            .into()),
        };
    }
    let name = B::name(first);
    let lower = name.to_lowercase();
    if !lower.contains("cpu") && !lower.contains("ndarray") {
        return Err(ModelError::TensorParallel(format!(
            "the {name} backend: tensor parallelism runs on CUDA devices (NCCL), or on a CPU backend for trying it"
        ))
        .into());
    }
    let reduces = if world > 1 { host_all_reduce(world) } else { Vec::new() };
    Ok((vec![first.clone(); world], reduces))
}

impl<B: GemmaBackend> ShardedModel<B> {
    /// Generates after `prompt` (token ids, its first the BOS where the model wants one) with
    /// fresh caches: up to `max_new_tokens` tokens drawn by `sampling` (greedy ones picked on
    /// the device), stopping after one of `stop`, or when `on_token` (called with each new
    /// token) returns false, or when the model's context is full. Returns the new tokens.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        sampling: SamplingConfig,
        max_new_tokens: usize,
        stop: &[u32],
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<Vec<u32>, Error> {
        let mut sampler = Sampler::new(sampling)?;
        let on_device = sampler.is_greedy() && !sampler.penalizes();
        // Never more positions than the model holds, whatever `max_new_tokens` asks.
        let capacity = prompt.len().saturating_add(max_new_tokens).min(self.config().max_position_embeddings);
        self.new_cache(capacity)?;
        let mut history = prompt.to_vec();
        let mut generated = Vec::new();
        let mut input = prompt.to_vec();
        while generated.len() < max_new_tokens {
            let next = if on_device {
                self.greedy(&input)?
            } else {
                let mut logits = self.logits(&input)?;
                sampler.sample(&mut logits, &history)
            };
            generated.push(next);
            history.push(next);
            // The next step would feed `next` at position `history.len() - 1`: past the cache, stop.
            if !on_token(next) || stop.contains(&next) || history.len() > capacity {
                break;
            }
            input = vec![next];
        }
        Ok(generated)
    }
}
