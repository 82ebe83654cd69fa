//! The engine serves many requests at once as each would be served alone: same tokens for every
//! request (greedy and seeded sampling, mixed prompt lengths, requests joining and leaving
//! mid-run, sliding windows wrapping), bad requests refused with their reason, a full queue
//! refused, cancellation and shutdown.

use crate::common;

use burn::tensor::DType;
use burn_gemma::{
    backends::NdArray,
    engine::{Engine, EngineConfig, EngineDrafts, EngineError, Event, Prompt, Request},
    Checkpoint, CudaGraph, Error, Gemma, GemmaBackend, GenerationConfig, Generator, LoadOptions, PagedLayout,
    PrefixCache, SamplingConfig, StepInputs, StopReason, WindowStore,
};
use std::num::NonZeroUsize;

const FIXTURES: [&str; 3] = ["tiny-gemma/gemma3", "tiny-gemma/gemma4-e", "tiny-gemma/gemma4-moe"];

fn model(fixture: &str) -> Gemma<NdArray> {
    model_on::<NdArray>(fixture, &Default::default())
}

fn model_on<B: GemmaBackend>(fixture: &str, device: &B::Device) -> Gemma<B> {
    let options = LoadOptions::<B>::new().device(device.clone()).dtype(DType::F32);
    Checkpoint::open(common::fixtures().join(fixture)).expect("open").load(options).expect("load").model
}

fn input(fixture: &str) -> Vec<u32> {
    common::ids(&common::read_json(common::fixtures().join(fixture).join("reference.json"))["input_ids"])
}

/// Requests of mixed prompt lengths, token budgets and sampling: greedy, and seeded sampling
/// with temperature, top-k and top-p. Budgets of 50 and more pass the fixtures' sliding windows.
/// The token ids of a request these tests built from ids.
fn ids_of(request: &Request) -> &[u32] {
    match &request.prompt {
        Prompt::Ids(ids) => ids,
        other => panic!("the tests build requests from ids, not {other:?}"),
    }
}

fn requests(input: &[u32], prefill_chunk: NonZeroUsize) -> Vec<Request> {
    let cases: [(usize, usize, Option<u64>); 7] = [
        (3, 20, None),
        (40, 9, Some(7)),
        (17, 60, None),
        (1, 33, Some(11)),
        (29, 5, None),
        (8, 50, Some(3)),
        (40, 1, None),
    ];
    cases
        .iter()
        .map(|&(prompt, new, seed)| {
            let sampling = match seed {
                None => SamplingConfig::default(),
                Some(seed) => SamplingConfig {
                    temperature: 0.9,
                    top_k: Some(40),
                    top_p: Some(0.95),
                    seed,
                    ..SamplingConfig::default()
                },
            };
            // Stop tokens: none beyond the model's, so that each runs its whole budget unless the
            // model ends it.
            let generation =
                GenerationConfig { max_new_tokens: new, sampling, prefill_chunk, ..GenerationConfig::default() };
            Request::new(input[..prompt].to_vec(), generation)
        })
        .collect()
}

/// Each request alone through the plain [`Generator`]; and whether its decode steps replayed
/// CUDA graphs (on CUDA, where the model's step can be recorded).
fn alone<B: GemmaBackend>(
    fixture: &str,
    requests: &[Request],
    device: &B::Device,
) -> (Vec<(Vec<u32>, StopReason)>, bool)
where
    Gemma<B>: Send + 'static,
{
    let mut generator = Generator::new(model_on::<B>(fixture, device), common::tiny_tokenizer()).expect("generator");
    let mut graph_steps = 0;
    let outputs = requests
        .iter()
        .map(|r| {
            generator.reset();
            let mut stream = generator.stream_ids(ids_of(r), &r.generation).expect("request");
            let ids: Vec<u32> = stream.by_ref().map(|t| t.expect("token").id).collect();
            let output = stream.finish();
            graph_steps += output.stats.graph_steps;
            (ids, output.stop)
        })
        .collect();
    (outputs, graph_steps > 0)
}

/// Every event of a request from the next on: its token ids and how it ended (`seen`: tokens
/// already taken from the stream).
fn collect_after(seen: usize, stream: burn_gemma::engine::RequestStream) -> (Vec<u32>, StopReason) {
    let mut ids = Vec::new();
    for event in stream {
        match event.expect("event") {
            Event::Token(t) => ids.push(t.id),
            Event::Done(finish) => {
                let stop_token = usize::from(matches!(finish.reason, StopReason::StopToken(_)));
                assert_eq!(finish.generated_tokens, seen + ids.len() + stop_token);
                return (ids, finish.reason);
            }
        }
    }
    panic!("the stream ended without a Done event");
}

/// Every event of a request.
fn collect(stream: burn_gemma::engine::RequestStream) -> (Vec<u32>, StopReason) {
    collect_after(0, stream)
}

/// Seven requests through an engine running three at once against each alone, with
/// `prefill_chunk` and the engine's `round_tokens` (and `kv_positions`, where given), on
/// backend `B`, its batched steps replayed as CUDA graphs as `cuda_graph` says. Under `Auto`,
/// where the plain generator replays graphs, so must the engine.
fn many_requests_match_alone<B: GemmaBackend>(
    prefill_chunk: usize,
    round_tokens: usize,
    kv_positions: Option<usize>,
    cuda_graph: CudaGraph,
    device: &B::Device,
) where
    Gemma<B>: Send + 'static,
{
    let prefill_chunk = NonZeroUsize::new(prefill_chunk).unwrap();
    for fixture in FIXTURES {
        let requests = requests(&input(fixture), prefill_chunk);
        let (expected, generator_graphs) = alone::<B>(fixture, &requests, device);
        // Three run at once, so four wait and join as others leave.
        let config = EngineConfig {
            max_running: NonZeroUsize::new(3).unwrap(),
            max_waiting: 16,
            round_tokens: NonZeroUsize::new(round_tokens).unwrap(),
            kv_positions: kv_positions.and_then(NonZeroUsize::new),
            cuda_graph,
            ..EngineConfig::default()
        };
        let engine = Engine::new(model_on::<B>(fixture, device), common::tiny_tokenizer(), config).expect("engine");
        let got: Vec<(Vec<u32>, StopReason)> = std::thread::scope(|scope| {
            let handles: Vec<_> = requests
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    let engine = &engine;
                    scope.spawn(move || {
                        // Staggered, so that some join while others run.
                        std::thread::sleep(std::time::Duration::from_millis(3 * i as u64));
                        collect(engine.submit(r.clone()).expect("submit"))
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("request thread")).collect()
        });
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            println!("{fixture} request {i}: {} tokens, {:?} (alone: {} tokens, {:?})", g.0.len(), g.1, e.0.len(), e.1);
            assert!(
                !g.0.is_empty() || matches!(g.1, StopReason::StopToken(_)),
                "{fixture} request {i}: nothing generated"
            );
        }
        assert_eq!(got, expected, "{fixture}: the engine's tokens differ from each request alone");
        let metrics = engine.metrics();
        assert_eq!(metrics.running.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(metrics.waiting.load(std::sync::atomic::Ordering::SeqCst), 0);
        assert_eq!(metrics.kv_sequences_in_use.load(std::sync::atomic::Ordering::SeqCst), 0);
        // Every KV block came back.
        assert_eq!(metrics.kv_blocks_in_use.load(std::sync::atomic::Ordering::SeqCst), 0, "{fixture}: blocks held");
        assert!(metrics.kv_blocks_total.load(std::sync::atomic::Ordering::SeqCst) > 0);
        // Some decode steps ran several requests at once.
        let steps = metrics.decode_steps.load(std::sync::atomic::Ordering::SeqCst);
        let rows = metrics.decode_rows.load(std::sync::atomic::Ordering::SeqCst);
        println!("{fixture}: {steps} decode steps of {:.2} sequences on average", rows as f64 / steps.max(1) as f64);
        assert!(rows > steps, "{fixture}: {rows} sequences in {steps} decode steps");
        let graph_steps = metrics.decode_graph_steps.load(std::sync::atomic::Ordering::SeqCst);
        println!(
            "{fixture}: {graph_steps} of {steps} steps replayed as CUDA graphs ({} recordings); generator alone: {}; \
             engine eager because: {:?}",
            metrics.graph_recordings.load(std::sync::atomic::Ordering::SeqCst),
            if generator_graphs { "graphs" } else { "eager" },
            engine.eager_reason()
        );
        match cuda_graph {
            CudaGraph::Off => assert_eq!(graph_steps, 0, "{fixture}: graphs replayed though off"),
            CudaGraph::On => assert_eq!(graph_steps, steps, "{fixture}: steps not replayed"),
            CudaGraph::Auto if generator_graphs => {
                assert_eq!(engine.eager_reason(), None, "{fixture}: the generator replays graphs, the engine not");
                assert_eq!(graph_steps, steps, "{fixture}: steps not replayed");
            }
            CudaGraph::Auto => {}
        }
        assert_eq!(metrics.requests_finished.load(std::sync::atomic::Ordering::SeqCst), requests.len() as u64);
        engine.shutdown();
    }
}

#[test]
fn many_requests_at_once_match_each_alone() {
    many_requests_match_alone::<NdArray>(2048, 2048, None, CudaGraph::Auto, &Default::default());
}

/// A KV cache of 100 positions over the running requests (of up to 77 positions each): a
/// request waits for the blocks of those running to come back, in order, and each still gets
/// its tokens alone.
#[test]
fn requests_wait_for_kv_blocks_and_match_each_alone() {
    many_requests_match_alone::<NdArray>(7, 9, Some(100), CudaGraph::Auto, &Default::default());
}

/// Requests through an engine with the prefix cache, against each alone: requests whose
/// prompts share their beginning (all are prefixes of the fixture's input, as a shared system
/// prompt would be) run only the rest of their prompt, and `n` alike at once (the choices of one
/// request) wait for the first one's prompt. Prompts run in chunks of 8, a multiple of which
/// every cached prefix is, so each request's chunks fall where they fall alone. Returns the
/// engine's prefix hits and the prompt tokens they covered.
fn prefixes_match_alone(fixture: &str, cases: &[(usize, u64)], config: EngineConfig) -> (u64, u64, u64) {
    let chunk = NonZeroUsize::new(8).unwrap();
    let requests: Vec<Request> = cases
        .iter()
        .map(|&(prompt, seed)| {
            let sampling = SamplingConfig { temperature: 0.9, top_k: Some(40), seed, ..SamplingConfig::default() };
            let generation =
                GenerationConfig { max_new_tokens: 12, sampling, prefill_chunk: chunk, ..GenerationConfig::default() };
            Request::new(input(fixture)[..prompt].to_vec(), generation)
        })
        .collect();
    let (expected, _) = alone::<NdArray>(fixture, &requests, &Default::default());
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), config).expect("engine");
    // Submitted at once: those starting like a prompt still running wait for its blocks.
    let streams: Vec<_> = requests.iter().map(|r| engine.submit(r.clone()).expect("submit")).collect();
    let got: Vec<(Vec<u32>, StopReason)> = streams.into_iter().map(collect).collect();
    assert_eq!(got, expected, "{fixture}: with cached prefixes, the tokens differ from each request alone");
    let m = engine.metrics();
    let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::SeqCst);
    let (hits, cached, given_up) =
        (load(&m.prefix_hits), load(&m.prefix_cached_tokens), load(&m.prefix_blocks_given_up));
    println!("{fixture}: {hits} prefix hits covering {cached} prompt tokens; {given_up} cached blocks given up");
    // Every block a request held came back; the cache keeps some.
    assert_eq!(m.kv_blocks_in_use.load(std::sync::atomic::Ordering::SeqCst), 0, "{fixture}: blocks held");
    assert!(m.kv_blocks_cached.load(std::sync::atomic::Ordering::SeqCst) > 0, "{fixture}: nothing cached");
    engine.shutdown();
    (hits, cached, given_up)
}

/// Three choices of one prompt and prompts sharing its beginning: every later one finds the
/// blocks its prompt shares with an earlier one (whole blocks of 8, the last token left out:
/// 32 tokens of a 33-token prompt; of a prompt of 20, 16 where blocks are 8), and gets its
/// tokens alone.
#[test]
fn prompts_sharing_a_beginning_run_from_the_cached_prefix_and_match_each_alone() {
    let config = EngineConfig { max_running: NonZeroUsize::new(3).unwrap(), ..EngineConfig::default() };
    for fixture in FIXTURES.iter().copied().chain(["tiny-gemma/gemma1", "tiny-gemma/gemma2"]) {
        // Blocks of 8 where a sliding window of 8 divides them; of 32 without windows.
        let got = prefixes_match_alone(fixture, &[(33, 1), (33, 2), (33, 3), (20, 4), (40, 5)], config);
        let expected = if fixture.ends_with("gemma1") { (3, 3 * 32, 0) } else { (4, 2 * 32 + 16 + 32, 0) };
        assert_eq!(got, expected, "{fixture}: prefix hits, the tokens they covered, blocks given up");
    }
}

/// A KV cache so small that the prefix cache must give its blocks up for the running requests:
/// a request whose prefix went still gets its tokens, and one waits rather than take what a
/// running request holds.
#[test]
fn a_prefix_given_up_for_room_still_serves_its_requests() {
    let config = EngineConfig {
        max_running: NonZeroUsize::new(2).unwrap(),
        kv_positions: NonZeroUsize::new(64),
        ..EngineConfig::default()
    };
    let (hits, _, given_up) = prefixes_match_alone(FIXTURES[0], &[(24, 1), (40, 2), (17, 3), (40, 4), (9, 5)], config);
    assert!(given_up > 0, "the cache never needed the prefix index's blocks");
    assert!(hits > 0, "no request found its prefix");
}

/// A request whose prompt and new tokens need more KV positions than the cache holds for one
/// sequence is refused at once, naming the limit; the engine serves on.
#[test]
fn a_request_larger_than_the_kv_cache_is_refused() {
    let fixture = FIXTURES[0];
    let config = EngineConfig { kv_positions: NonZeroUsize::new(40), ..EngineConfig::default() };
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), config).expect("engine");
    let prompt = input(fixture)[..10].to_vec();
    let generation = |new| GenerationConfig { max_new_tokens: new, ..GenerationConfig::default() };
    match engine.submit(Request::new(prompt.clone(), generation(100))) {
        Err(e) => assert!(e.to_string().contains("KV positions"), "{e}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let (ids, _) = collect(engine.submit(Request::new(prompt, generation(5))).expect("a request that fits"));
    assert!(!ids.is_empty());
    engine.shutdown();
}

/// The batched step's kernels (a position per sequence in the KV append and decode attention)
/// on a GPU backend, against the plain generator on the same backend.
#[cfg(feature = "wgpu")]
#[test]
fn many_requests_at_once_match_each_alone_on_wgpu() {
    many_requests_match_alone::<burn_gemma::backends::Wgpu>(7, 9, Some(100), CudaGraph::Auto, &Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn many_requests_at_once_match_each_alone_on_cuda() {
    use burn_gemma::backends::Cuda;
    // Replayed as graphs where the model's step records, and eager.
    many_requests_match_alone::<Cuda>(7, 9, None, CudaGraph::Auto, &Default::default());
    many_requests_match_alone::<Cuda>(7, 9, Some(100), CudaGraph::Auto, &Default::default());
    many_requests_match_alone::<Cuda>(7, 9, Some(100), CudaGraph::Off, &Default::default());
}

/// Prompts in chunks of 7 under a budget of 9 tokens a round: prompts advance a chunk or so per
/// round between the others' tokens, and every request still gets its tokens alone.
#[test]
fn prompt_chunks_interleaved_with_generation_match_each_alone() {
    many_requests_match_alone::<NdArray>(7, 9, None, CudaGraph::Auto, &Default::default());
}

/// A stop string cuts a request's text before it: the token events and the finish's held text
/// join to the plain generator's text up to the stop, and the request ends there.
#[test]
fn stop_strings_cut_the_text_where_they_appear() {
    for fixture in FIXTURES {
        let generation = GenerationConfig { max_new_tokens: 30, ..Default::default() };
        let prompt = input(fixture)[..6].to_vec();
        let mut generator = Generator::new(model(fixture), common::tiny_tokenizer()).expect("generator");
        let mut stream = generator.stream_ids(&prompt, &generation).expect("request");
        stream.by_ref().for_each(|t| drop(t.expect("token")));
        let whole = stream.finish().text;
        let chars: Vec<char> = whole.chars().collect();
        assert!(chars.len() >= 8, "{fixture}: too little text to cut: {whole:?}");
        let engine = Engine::new(model(fixture), common::tiny_tokenizer(), EngineConfig::default()).expect("engine");
        // A stop from the middle of the text (its first appearance may come earlier), and one
        // that never appears.
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 3].iter().collect();
        let expected = &whole[..whole.find(&stop).expect("the stop is in the text")];
        let stops = GenerationConfig { stop_strings: vec!["never there \u{1}".into(), stop.clone()], ..generation };
        // The generator cuts its text where the engine does.
        let mut generator = Generator::new(model(fixture), common::tiny_tokenizer()).expect("generator");
        let mut streamed = String::new();
        let mut stream = generator.stream_ids(&prompt, &stops).expect("request");
        stream.by_ref().for_each(|t| streamed.push_str(&t.expect("token").text));
        let output = stream.finish();
        assert_eq!((output.text.as_str(), output.stop), (expected, StopReason::StopString(1)), "{fixture}: generator");
        assert_eq!(streamed, expected, "{fixture}: the generator's stream adds up to its text");
        let request = Request::new(prompt, stops);
        let mut text = String::new();
        let mut finish = None;
        for event in engine.submit(request).expect("submit") {
            match event.expect("event") {
                Event::Token(t) => text.push_str(&t.text),
                Event::Done(f) => {
                    text.push_str(&f.text);
                    finish = Some(f);
                }
            }
        }
        assert_eq!(text, expected, "{fixture}: stop {stop:?} in {whole:?}");
        assert_eq!(finish.expect("a Done event").reason, StopReason::StopString(1), "{fixture}");
        engine.shutdown();
    }
}

#[test]
fn bad_requests_are_refused_with_their_reason_and_the_engine_serves_on() {
    let fixture = FIXTURES[0];
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), EngineConfig::default()).expect("engine");
    let good = Request::new(input(fixture)[..5].to_vec(), GenerationConfig { max_new_tokens: 4, ..Default::default() });
    let cases: Vec<(Request, &str)> = vec![
        (Request { prompt: Prompt::Ids(vec![]), ..good.clone() }, "no input tokens"),
        (
            Request {
                generation: GenerationConfig {
                    stop_strings: vec!["a".into(), String::new()],
                    ..good.generation.clone()
                },
                ..good.clone()
            },
            "stop string 1 is empty",
        ),
        (
            Request {
                generation: GenerationConfig { cuda_graph: CudaGraph::Off, ..good.generation.clone() },
                ..good.clone()
            },
            "an engine request cannot set cuda_graph (Off)",
        ),
        (
            Request { prompt: Prompt::Ids(vec![2, 600_000]), ..good.clone() },
            "token id 600000 is outside the vocabulary",
        ),
        (
            Request { generation: GenerationConfig { max_new_tokens: 0, ..good.generation.clone() }, ..good.clone() },
            "max new tokens must be at least 1",
        ),
        (
            Request {
                generation: GenerationConfig {
                    sampling: SamplingConfig { temperature: f32::NAN, ..Default::default() },
                    ..good.generation.clone()
                },
                ..good.clone()
            },
            "temperature",
        ),
        (Request { prompt: Prompt::Ids(vec![2; 1_000_000]), ..good.clone() }, "exceeds the model's context"),
    ];
    for (request, says) in cases {
        match engine.submit(request) {
            Err(e) => {
                assert!(matches!(e, Error::Request(_) | Error::Sampling(_)), "{e:?}");
                assert!(e.to_string().contains(says), "{e} does not say {says:?}");
            }
            other => panic!("expected a refusal saying {says:?}, got {other:?}"),
        }
    }
    let (ids, reason) = collect(engine.submit(good).expect("submit"));
    assert!(ids.len() == 4 || matches!(reason, StopReason::StopToken(_)), "{ids:?} {reason:?}");
}

#[test]
fn a_full_queue_refuses_and_cancelled_requests_leave() {
    let fixture = FIXTURES[1];
    let config = EngineConfig { max_running: NonZeroUsize::new(1).unwrap(), max_waiting: 2, ..EngineConfig::default() };
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), config).expect("engine");
    let long =
        Request::new(input(fixture)[..4].to_vec(), GenerationConfig { max_new_tokens: 10_000, ..Default::default() });
    let first = engine.submit(long.clone()).expect("first");
    // Running once its first token is out: the next two wait, the fourth finds the queue full.
    assert!(matches!(first.next_event(), Some(Ok(Event::Token(_)))));
    let second = engine.submit(long.clone()).expect("second");
    let third = engine.submit(long.clone()).expect("third");
    match engine.submit(long.clone()) {
        Err(Error::Engine(EngineError::QueueFull { waiting: 2 })) => {}
        other => panic!("expected QueueFull with 2 waiting, got {other:?}"),
    }
    assert_eq!(engine.metrics().requests_refused.load(std::sync::atomic::Ordering::SeqCst), 1);
    // Dropping the waiting second cancels it; cancelling the running first ends it.
    drop(second);
    first.cancel();
    let (_, reason) = collect_after(1, first);
    assert_eq!(reason, StopReason::Interrupted);
    // The third now runs; a short request after it is served too.
    assert!(matches!(third.next_event(), Some(Ok(Event::Token(_)))));
    third.cancel();
    assert_eq!(collect_after(1, third).1, StopReason::Interrupted);
    let short = Request { generation: GenerationConfig { max_new_tokens: 3, ..Default::default() }, ..long };
    let (ids, reason) = collect(engine.submit(short).expect("short"));
    assert!(ids.len() == 3 || matches!(reason, StopReason::StopToken(_)));
    engine.shutdown();
}

#[test]
fn shutdown_lets_running_and_waiting_requests_finish() {
    let fixture = FIXTURES[0];
    let config = EngineConfig { max_running: NonZeroUsize::new(2).unwrap(), max_waiting: 8, ..EngineConfig::default() };
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), config).expect("engine");
    let streams: Vec<_> = (0..5)
        .map(|i| {
            let generation = GenerationConfig { max_new_tokens: 6 + i, ..Default::default() };
            engine.submit(Request::new(input(fixture)[..3 + i].to_vec(), generation)).expect("submit")
        })
        .collect();
    engine.shutdown();
    for (i, stream) in streams.into_iter().enumerate() {
        let (ids, reason) = collect(stream);
        assert!(
            reason == StopReason::MaxTokens && ids.len() == 6 + i || matches!(reason, StopReason::StopToken(_)),
            "request {i}: {reason:?} after {} tokens",
            ids.len()
        );
    }
}

/// Requests whose prompts repeat themselves (so that prompt lookup finds matches from the
/// start), greedy, budgets passing the fixtures' sliding windows of 8 many times over.
fn repeating_requests(input: &[u32]) -> Vec<Request> {
    [(12, 40), (20, 33), (7, 60), (16, 25), (30, 47)]
        .iter()
        .map(|&(prompt, new)| {
            let phrase = &input[1..prompt];
            let prompt = [&input[..1], phrase, &input[prompt..prompt + 3], phrase].concat();
            Request::new(prompt, GenerationConfig { max_new_tokens: new, ..GenerationConfig::default() })
        })
        .collect()
}

/// Positions per sequence of the engines with drafts (and of their references): a few times
/// the longest request, so that reading every slot of a table row stays cheap on the CPU.
const DRAFT_TEST_POSITIONS: usize = 256;

/// Each request's greedy tokens alone, without drafts, in a KV cache keeping every position of
/// its sliding windows as the engine's does with drafts (a ring reads its window's keys in
/// another order, which may round otherwise): its prompt in one chunk, then the engine's decode
/// step (a position per sequence) one token at a time, up to its budget or a stop token.
fn alone_every_position<B: GemmaBackend>(
    fixture: &str,
    requests: &[Request],
    device: &B::Device,
) -> Vec<(Vec<u32>, StopReason)> {
    let model = model_on::<B>(fixture, device);
    let stops = burn_gemma::generation::default_stop_tokens(model.config(), &common::tiny_tokenizer());
    let argmax = |row: Vec<f32>| {
        row.iter().enumerate().fold((0, f32::MIN), |m, (i, &l)| if l > m.1 { (i, l) } else { m }).0 as u32
    };
    let last_row = |logits: burn::tensor::Tensor<B, 3>| -> Vec<f32> {
        let [_, t, vocab] = logits.dims();
        logits.slice([0..1, t - 1..t, 0..vocab]).into_data().convert::<f32>().to_vec().expect("logits")
    };
    requests
        .iter()
        .map(|r| {
            let mut cache = model.new_cache_with(1, DRAFT_TEST_POSITIONS, WindowStore::EveryPosition).expect("cache");
            let prompt = burn_gemma::generation::token_tensor::<B>(ids_of(r), device);
            let mut token = argmax(last_row(model.forward(prompt, &mut cache).expect("prompt")));
            let mut tokens = Vec::new();
            loop {
                if stops.contains(&token) {
                    return (tokens, StopReason::StopToken(token));
                }
                tokens.push(token);
                if tokens.len() == r.generation.max_new_tokens {
                    return (tokens, StopReason::MaxTokens);
                }
                let position = ids_of(r).len() + tokens.len() - 1;
                let inputs = StepInputs::sequences(&[token], &[position], device).expect("step inputs");
                let logits = model.decode_logits(&inputs, &mut cache).expect("step");
                token = argmax(logits.into_data().convert::<f32>().to_vec().expect("logits"));
            }
        })
        .collect()
}

/// Prompt lookup drafts in the batched engine (each sequence drafting on its own, its drafts
/// rows of the shared step over its KV blocks), three sequences at once and two waiting, with
/// and without cached prefixes: every request's greedy tokens are those it gets alone without
/// drafts (in a cache of the same window store), drafts were both kept and refused, and every
/// block came back.
fn drafts_keep_greedy_tokens<B: GemmaBackend>(cuda_graph: CudaGraph, device: &B::Device)
where
    Gemma<B>: Send + 'static,
{
    for fixture in FIXTURES {
        let requests = repeating_requests(&input(fixture));
        let expected = alone_every_position::<B>(fixture, &requests, device);
        for prefix_cache in [PrefixCache::Off, PrefixCache::On] {
            let config = EngineConfig {
                max_running: NonZeroUsize::new(3).unwrap(),
                max_sequence_len: NonZeroUsize::new(DRAFT_TEST_POSITIONS).unwrap(),
                drafts: EngineDrafts::PromptLookup { tokens: NonZeroUsize::new(4).unwrap() },
                prefix_cache,
                cuda_graph,
                ..EngineConfig::default()
            };
            let engine = Engine::new(model_on::<B>(fixture, device), common::tiny_tokenizer(), config).expect("engine");
            let streams: Vec<_> = requests.iter().map(|r| engine.submit(r.clone()).expect("submit")).collect();
            let got: Vec<(Vec<u32>, StopReason)> = streams.into_iter().map(collect).collect();
            assert_eq!(got, expected, "{fixture}, prefix cache {prefix_cache}: drafts changed the tokens");
            let m = engine.metrics();
            let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::SeqCst);
            let (drafted, kept) = (load(&m.draft_tokens), load(&m.draft_tokens_accepted));
            let (steps, generated) = (load(&m.decode_steps), load(&m.generated_tokens));
            println!("{fixture}, prefix cache {prefix_cache}: {kept} of {drafted} drafts kept; {generated} tokens");
            assert!(kept > 0 && kept < drafted, "{fixture}: {kept} of {drafted} drafts kept");
            // Kept drafts are tokens without steps of their own.
            assert!(steps + (requests.len() as u64) < generated, "{fixture}: {steps} steps for {generated} tokens");
            assert_eq!(m.kv_blocks_in_use.load(std::sync::atomic::Ordering::SeqCst), 0, "{fixture}: blocks held");
            if cuda_graph == CudaGraph::On {
                assert_eq!(load(&m.decode_graph_steps), steps, "{fixture}: steps not replayed");
            }
            engine.shutdown();
        }
    }
}

#[test]
fn drafts_in_the_engine_keep_each_requests_greedy_tokens() {
    drafts_keep_greedy_tokens::<NdArray>(CudaGraph::Auto, &Default::default());
}

/// The same on CUDA, the batched steps (a sequence's drafts as rows pointed at its blocks)
/// replayed as CUDA graphs.
#[cfg(feature = "cuda")]
#[test]
fn drafts_in_the_engine_keep_each_requests_greedy_tokens_on_cuda() {
    drafts_keep_greedy_tokens::<burn_gemma::backends::Cuda>(CudaGraph::On, &Default::default());
}

/// The mechanism under the engine's drafts: in a paged cache keeping every position of its
/// sliding windows, two sequences' drafted positions as rows pointed at their blocks give, in
/// one step, the logits of one-token steps of each sequence alone (bit for bit on the CPU);
/// rings, a row holding blocks and a sequence holding none are refused.
#[test]
fn draft_rows_pointed_at_a_sequence_give_its_one_token_steps() {
    let fixture = FIXTURES[0];
    let device = Default::default();
    let model = model(fixture);
    let capacity = 64;
    let prompts = [input(fixture)[..20].to_vec(), input(fixture)[3..14].to_vec()];
    let layout =
        PagedLayout { window_store: WindowStore::EveryPosition, draft_rows: 8, ..PagedLayout::new(2, capacity, 8) };
    let mut paged = model.new_paged_cache(layout).expect("paged cache");
    let mut alone = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let mut cache = model.new_cache_with(1, capacity, WindowStore::EveryPosition).expect("cache");
        model.forward(burn_gemma::generation::token_tensor::<NdArray>(prompt, &device), &mut cache).expect("prompt");
        let blocks = paged.reserve(40).expect("blocks");
        paged.attach(i, blocks).expect("attach");
        paged.copy_sequence(i, &cache, 0).expect("copy");
        alone.push(cache);
    }
    // Refused, changing nothing: a row holding blocks, a sequence holding none, a row twice.
    for rows in [vec![(1, 0)], vec![(2, 5)], vec![(2, 0), (2, 1)]] {
        assert!(paged.set_draft_rows(&rows).is_err(), "{rows:?} accepted");
    }
    // Each sequence feeds 3 tokens (positions past the 8-position window); rows 6 and 7 pad.
    let fed = [[5u32, 6, 7], [8, 9, 10]];
    let rows_of = [[0, 2, 3], [1, 4, 5]];
    paged.set_draft_rows(&[(2, 0), (3, 0), (4, 1), (5, 1)]).expect("draft rows");
    let (p0, p1) = (prompts[0].len(), prompts[1].len());
    let ids = [fed[0][0], fed[1][0], fed[0][1], fed[0][2], fed[1][1], fed[1][2], 0, 0];
    let positions = [p0, p1, p0 + 1, p0 + 2, p1 + 1, p1 + 2, 0, 0];
    let inputs = StepInputs::sequences(&ids, &positions, &device).expect("inputs");
    let got: Vec<f32> = model.decode_logits(&inputs, &mut paged).expect("step").into_data().to_vec().expect("logits");
    let vocab = got.len() / ids.len();
    for (s, cache) in alone.iter_mut().enumerate() {
        for (j, &token) in fed[s].iter().enumerate() {
            let inputs = StepInputs::sequences(&[token], &[prompts[s].len() + j], &device).expect("inputs");
            let want: Vec<f32> =
                model.decode_logits(&inputs, cache).expect("step").into_data().to_vec().expect("logits");
            let row = rows_of[s][j];
            assert_eq!(&got[row * vocab..(row + 1) * vocab], &want[..], "sequence {s}, token {j} (row {row})");
        }
    }
    // A cache whose windows are rings takes no draft rows.
    let mut rings =
        model.new_paged_cache(PagedLayout { draft_rows: 8, ..PagedLayout::new(2, capacity, 8) }).expect("rings");
    let blocks = rings.reserve(40).expect("blocks");
    rings.attach(0, blocks).expect("attach");
    let refused = rings.set_draft_rows(&[(2, 0)]).expect_err("draft rows over rings");
    assert!(refused.to_string().contains("EveryPosition"), "{refused}");
}

/// The mechanism under the engine's prefix cache: a block of a prompt copied into a block set
/// and shared by a later reservation fills a fresh prompt cache that steps on exactly as the
/// original (bit for bit on the CPU); each shortfall of `take_block_set` is named, and a set
/// given up frees its blocks.
#[test]
fn block_sets_carry_a_prompt_block_to_a_later_prompt() {
    use burn_gemma::BlockShortfall;
    let fixture = FIXTURES[0];
    let device = Default::default();
    let model = model(fixture);
    let (capacity, bs) = (64, 8);
    let layout = PagedLayout { ring_copies: capacity, ..PagedLayout::new(2, capacity, bs) };
    let mut paged = model.new_paged_cache(layout).expect("paged cache");
    // The fixture's window is one block: its ring pool is what `ring_copies` sizes.
    assert_eq!(paged.ring_slots(), Some(bs), "{fixture}: a sliding window of one block");
    let prompt = &input(fixture)[..bs + 1];
    let mut first = model.new_cache_with(1, capacity, WindowStore::Ring).expect("cache");
    model.forward(burn_gemma::generation::token_tensor::<NdArray>(&prompt[..bs], &device), &mut first).expect("prompt");
    let mut reservation = paged.reserve(40).expect("blocks");
    let set = paged.take_block_set(&mut reservation).expect("a block set");
    paged.copy_into_block_sets(&first, 0, &[&set], bs).expect("copy");
    paged.attach(0, reservation).expect("attach");
    paged.copy_sequence(0, &first, 0).expect("copy the prompt");

    // A later prompt starting alike shares the block and runs on from it.
    let mut later = paged.reserve_sharing(40, &[&set]).expect("blocks sharing the set");
    assert_eq!(later.cached_positions(), bs);
    let mut second = model.new_cache_with(1, capacity, WindowStore::Ring).expect("cache");
    paged.fill_prefix(&mut later, &mut second).expect("fill");
    assert_eq!(second.len(), bs);
    let step = |cache: &mut burn_gemma::KvCache<NdArray>| -> Vec<f32> {
        let inputs = StepInputs::sequences(&prompt[bs..], &[bs], &device).expect("inputs");
        model.decode_logits(&inputs, cache).expect("step").into_data().to_vec().expect("logits")
    };
    assert_eq!(step(&mut second), step(&mut first), "the shared prefix steps on as the original");

    // Shortfalls: a reservation of another cache; a promise used up; rings with no free block.
    let mut other = model.new_paged_cache(PagedLayout::new(1, capacity, bs)).expect("other cache");
    let mut foreign = other.reserve(bs).expect("blocks");
    assert_eq!(paged.take_block_set(&mut foreign).err(), Some(BlockShortfall::NotThisCache));
    other.release_reservation(foreign);
    let mut one_block = paged.reserve(bs).expect("blocks");
    let taken = paged.take_block_set(&mut one_block).expect("the promised block");
    assert_eq!(paged.take_block_set(&mut one_block).err(), Some(BlockShortfall::Promise));
    paged.release_reservation(one_block);
    paged.release_block_set(taken);
    let mut no_copies = model.new_paged_cache(PagedLayout::new(2, capacity, bs)).expect("cache without copies");
    let whole: Vec<_> = (0..2).map(|_| no_copies.reserve(40).expect("blocks")).collect();
    let mut whole = whole.into_iter();
    let mut full = whole.next().expect("a reservation");
    assert_eq!(no_copies.take_block_set(&mut full).err(), Some(BlockShortfall::Free));
    no_copies.release_reservation(full);
    whole.for_each(|r| no_copies.release_reservation(r));

    // Given up, a set only it holds frees a block in every pool.
    paged.release_reservation(later);
    paged.release(0);
    let (held, _) = paged.blocks_in_use().expect("paged");
    assert_eq!(paged.held_only_by(&set), held, "after its sequence left only the set holds blocks");
    paged.release_block_set(set);
    assert_eq!(paged.blocks_in_use().expect("paged").0, 0);
}

/// The same requests read as async streams (no thread waits on them), polled together on one
/// thread, give what the blocking streams give, and dropping an async stream cancels its request.
#[test]
fn async_streams_match_the_blocking_ones() {
    use futures_lite::{future, StreamExt};
    let fixture = FIXTURES[0];
    let engine = Engine::new(model(fixture), common::tiny_tokenizer(), EngineConfig::default()).expect("engine");
    let requests: Vec<_> = [5, 9, 13]
        .iter()
        .map(|&n| {
            Request::new(input(fixture)[..n].to_vec(), GenerationConfig { max_new_tokens: 12, ..Default::default() })
        })
        .collect();
    let blocking: Vec<_> = requests.iter().map(|r| collect(engine.submit(r.clone()).expect("submit"))).collect();
    let streams: Vec<_> = requests.iter().map(|r| engine.submit(r.clone()).expect("submit").into_async()).collect();
    let read = |mut events: burn_gemma::engine::EventStream| async move {
        let mut ids = Vec::new();
        while let Some(event) = events.next().await {
            match event.expect("event") {
                Event::Token(t) => ids.push(t.id),
                Event::Done(finish) => return (ids, finish.reason),
            }
        }
        panic!("the stream ended without a Done event");
    };
    let mut streams = streams.into_iter();
    let (a, b, c) = (streams.next().unwrap(), streams.next().unwrap(), streams.next().unwrap());
    let ((first, second), third) = future::block_on(future::zip(future::zip(read(a), read(b)), read(c)));
    assert_eq!(vec![first, second, third], blocking);
    // A dropped async stream cancels its request: the engine counts it finished, not running.
    let long =
        Request::new(input(fixture)[..5].to_vec(), GenerationConfig { max_new_tokens: 10_000, ..Default::default() });
    let mut events = engine.submit(long).expect("submit").into_async();
    assert!(matches!(future::block_on(events.next()), Some(Ok(Event::Token(_)))));
    drop(events);
    let metrics = engine.metrics();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while metrics.running.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        assert!(std::time::Instant::now() < deadline, "the dropped request still runs");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    engine.shutdown();
}
