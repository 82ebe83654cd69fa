//! Soak: 1,000 generations in one process (200 on wgpu, whose software driver in CI is slow;
//! 1,000 with `BURN_GEMMA_LONG_TESTS=1`) with random sampling parameters, a fifth of them
//! invalid: every invalid one is rejected with a sampling error before any work, no valid one
//! fails, and the device memory reserved at the end is within a few percent of what it was after
//! the first generation (backends that report it). Device faults: a KV cache past the device's
//! memory, and a request past the model's context.

use crate::common;

use burn_gemma::{Checkpoint, Error, GemmaBackend, GenerationConfig, Generator, SamplingConfig};

const GENERATIONS: usize = 1_000;
/// The wgpu soak's generations without `BURN_GEMMA_LONG_TESTS=1`.
#[cfg(feature = "wgpu")]
const SHORT_GENERATIONS: usize = 200;

use common::Rng;

/// Floats in [0, 1) from [`Rng`].
trait Unit {
    fn unit(&mut self) -> f32;
}

impl Unit for Rng {
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// Random sampling parameters; `invalid` breaks one of them.
fn sampling(rng: &mut Rng, invalid: bool) -> SamplingConfig {
    let mut s = SamplingConfig {
        temperature: if rng.unit() < 0.3 { 0.0 } else { 2.0 * rng.unit() },
        top_k: (rng.unit() < 0.5).then(|| 1 + (rng.next() % 64) as usize),
        top_p: (rng.unit() < 0.5).then(|| 0.05 + 0.95 * rng.unit()),
        min_p: (rng.unit() < 0.3).then(|| 0.5 * rng.unit()),
        repeat_penalty: if rng.unit() < 0.5 { 1.0 } else { 1.0 + rng.unit() },
        repeat_last_n: (rng.next() % 128) as usize,
        seed: rng.next(),
    };
    if invalid {
        match rng.next() % 8 {
            0 => s.temperature = -1.0,
            1 => s.temperature = f32::NAN,
            2 => s.top_k = Some(0),
            3 => s.top_p = Some(0.0),
            4 => s.top_p = Some(1.5),
            5 => s.min_p = Some(-0.25),
            6 => s.repeat_penalty = 0.0,
            _ => s.repeat_penalty = f32::INFINITY,
        }
    }
    s
}

fn soak<B: GemmaBackend>(device: B::Device, generations: usize) {
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let (model, _) = Checkpoint::open(&dir)
        .unwrap()
        .load(common::dense_f32::<B>(&device))
        .map(burn_gemma::Loaded::into_parts)
        .unwrap();
    let mut generator = Generator::new(model, common::tiny_tokenizer()).unwrap();
    let seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(3, |d| d.as_nanos() as u64);
    println!("soak seed {seed}");
    let mut rng = Rng(seed);
    let (mut ok, mut rejected) = (0, 0);
    let mut first_reserved = None;
    let start = std::time::Instant::now();
    for i in 0..generations {
        let invalid = rng.next().is_multiple_of(5);
        let config = GenerationConfig {
            max_new_tokens: 1 + (rng.next() % 6) as usize,
            sampling: sampling(&mut rng, invalid),
            ..GenerationConfig::default()
        };
        let prompt = ["hello", "<start_of_turn>user\nab", "w300 w301", "é😀"][(rng.next() % 4) as usize];
        match (generator.generate(prompt, &config, |_| {}), invalid) {
            (Ok(out), false) => {
                assert!(!out.tokens.is_empty(), "generation {i} produced nothing");
                ok += 1;
            }
            (Err(Error::Sampling(_)), true) => rejected += 1,
            (Ok(_), true) => panic!("generation {i}: invalid sampling {:?} accepted", config.sampling),
            (Err(e), _) => panic!("generation {i} ({:?}): {e}", config.sampling),
        }
        if ok == 1 && first_reserved.is_none() {
            // After the first generation that ran: its buffers are the steady state's.
            first_reserved = Some(B::memory_reserved(&device));
        }
    }
    let last = B::memory_reserved(&device);
    println!(
        "soak: {generations} generations in {:.1} s: {ok} valid ran, {rejected} invalid rejected; device memory reserved after the first {}, at the end {}",
        start.elapsed().as_secs_f64(),
        first_reserved.flatten().map_or("not reported".to_string(), |b| format!("{b} bytes")),
        last.map_or("not reported".to_string(), |b| format!("{b} bytes")),
    );
    assert_eq!(ok + rejected, generations);
    if let (Some(Some(first)), Some(last)) = (first_reserved, last) {
        assert!(
            last as f64 <= first as f64 * 1.05 + (1 << 20) as f64,
            "reserved memory grew from {first} to {last} bytes"
        );
    }
}

#[test]
fn thousand_generations_on_ndarray() {
    let _shared = crate::shared();
    soak::<burn_gemma::backends::NdArray>(Default::default(), GENERATIONS);
}

#[cfg(feature = "wgpu")]
#[test]
fn thousand_generations_on_wgpu() {
    let _shared = crate::shared();
    let generations = if common::long_tests() { GENERATIONS } else { SHORT_GENERATIONS };
    soak::<burn_gemma::backends::Wgpu>(Default::default(), generations);
}

/// A KV cache the device cannot hold is refused before any of it is allocated, naming the
/// bytes asked and available, and the same process then generates with a smaller one; a prompt
/// and new tokens past the model's context are refused before any work.
fn device_faults<B: GemmaBackend>(device: B::Device) {
    use burn_gemma::ModelError;
    let dir = common::fixtures().join("tiny-gemma/gemma3");
    let (model, _) = Checkpoint::open(&dir)
        .unwrap()
        .load(common::dense_f32::<B>(&device))
        .map(burn_gemma::Loaded::into_parts)
        .unwrap();
    let reserved = B::memory_reserved(&device);
    // 2^40 positions: 128 TiB of keys for the tiny model's one full-attention layer.
    match model.new_cache(1, 1 << 40) {
        Err(ModelError::DeviceMemory { what, asked, available, limit }) => {
            println!("huge cache refused: {what}: {asked} bytes asked, {available} available ({limit})");
            assert!(asked > available, "{asked} <= {available}");
        }
        other => panic!("a 2^40-position cache gave {:?}", other.map(|c| c.capacity())),
    }
    assert_eq!(B::memory_reserved(&device), reserved, "the refused cache allocated");
    let mut generator = Generator::new(model, common::tiny_tokenizer()).unwrap();
    let out = generator.generate("hello", &GenerationConfig { max_new_tokens: 4, ..Default::default() }, |_| {});
    assert!(out.is_ok_and(|o| !o.tokens.is_empty()), "generation after the refused cache");
    let too_long = GenerationConfig { max_new_tokens: generator.max_context(), ..Default::default() };
    let err = generator.generate("hello", &too_long, |_| {}).unwrap_err();
    assert!(matches!(&err, Error::Request(burn_gemma::RequestError::ContextOverflow { .. })), "{err}");
}

#[test]
fn device_faults_on_ndarray() {
    let _shared = crate::shared();
    device_faults::<burn_gemma::backends::NdArray>(Default::default());
}

#[cfg(feature = "wgpu")]
#[test]
fn device_faults_on_wgpu() {
    let _shared = crate::shared();
    device_faults::<burn_gemma::backends::Wgpu>(Default::default());
}

#[cfg(feature = "cuda")]
#[test]
fn thousand_generations_on_cuda() {
    let _shared = crate::shared();
    soak::<burn_gemma::backends::Cuda>(Default::default(), GENERATIONS);
}

#[cfg(feature = "cuda")]
#[test]
fn device_faults_on_cuda() {
    let _shared = crate::shared();
    device_faults::<burn_gemma::backends::Cuda>(Default::default());
}
