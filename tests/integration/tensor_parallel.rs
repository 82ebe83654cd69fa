//! Tensor parallelism on the CPU: a model split over N shards, each on its own thread with the
//! host all-reduce, gives the unsplit model's logits (issue 37's check without several GPUs).

use crate::common;

use burn_gemma::{
    backends::{Candle, NdArray},
    generation::token_tensor,
    tensor_parallel::{host_all_reduce, ShardedModel},
    Checkpoint, Error, GemmaBackend, LoadOptions, ModelError, WeightFormat,
};

/// Largest absolute difference.
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The prompt's last logits and `steps` greedy steps after it, on `model`: every step's logits
/// and the tokens chosen.
fn run(model: &mut ShardedModel<impl GemmaBackend>, prompt: &[u32], steps: usize) -> (Vec<Vec<f32>>, Vec<u32>) {
    model.new_cache(prompt.len() + steps + 1).expect("cache");
    let mut logits = vec![model.logits(prompt).expect("prompt")];
    let mut tokens = Vec::new();
    for _ in 0..steps {
        let last = logits.last().expect("logits");
        let next = (0..last.len()).max_by(|&a, &b| last[a].total_cmp(&last[b])).expect("vocab") as u32;
        tokens.push(next);
        logits.push(model.logits(&[next]).expect("step"));
    }
    (logits, tokens)
}

/// The unsplit model's largest distance from HF's f32 logits over the fixture's prompt: how far
/// two f32 evaluations of the model that add in different orders drift apart on this
/// checkpoint (Gemma 4's fixtures amplify rounding more than the others, 1e-5 and over).
fn f32_noise(checkpoint: &Checkpoint, reference: &serde_json::Value) -> f32 {
    let device = Default::default();
    let model = checkpoint.load(common::dense_f32::<NdArray>(&device)).expect("load").model;
    let input = common::ids(&reference["input_ids"]);
    let mut cache = model.new_cache(1, input.len()).expect("cache");
    let logits = model.forward(token_tensor::<NdArray>(&input, &device), &mut cache).expect("forward");
    let got = logits.into_data().to_vec::<f32>().expect("f32");
    let expected: Vec<f32> = reference["logits"]
        .as_array()
        .expect("rows")
        .iter()
        .flat_map(|row| row.as_array().expect("row").iter().map(|v| v.as_f64().expect("number") as f32))
        .collect();
    max_diff(&got, &expected)
}

/// Every generation's tiny checkpoint split over 2 and 4 shards (heads, KV heads shared by two
/// shards, MLP columns; Gemma 4's KV-sharing layers, per-layer inputs and experts replicated)
/// gives the unsplit model's greedy tokens and its f32 logits over the prompt and four decode
/// steps, within 1e-5 or, on checkpoints whose f32 rounding drifts further, three times the
/// unsplit model's own distance from HF's f32 logits (the split adds the o and down products'
/// partial sums in another order, as HF's products add in another order than ours).
#[test]
fn shards_give_the_unsplit_models_logits() {
    let device = Default::default();
    for name in ["gemma1", "gemma2", "gemma3", "gemma4-e", "gemma4-dense", "gemma4-moe", "gemma4-unified"] {
        let dir = common::fixtures().join("tiny-gemma").join(name);
        let reference = common::read_json(dir.join("reference.json"));
        let prompt = common::ids(&reference["input_ids"]);
        let checkpoint = Checkpoint::open(&dir).expect("open");
        let bound = 1e-5f32.max(3.0 * f32_noise(&checkpoint, &reference));
        let options = |d: &_| common::dense_f32::<NdArray>(d);
        let mut whole = ShardedModel::load(&checkpoint, &[device], options, Vec::new()).expect("whole model");
        let (expected, expected_tokens) = run(&mut whole, &prompt, 4);
        for world in [2, 4] {
            let devices = vec![device; world];
            let mut split = ShardedModel::load(&checkpoint, &devices, options, host_all_reduce(world)).expect("shards");
            assert_eq!(split.world(), world);
            let (got, tokens) = run(&mut split, &prompt, 4);
            for (step, (g, e)) in got.iter().zip(&expected).enumerate() {
                assert!(g.iter().all(|v| v.is_finite()), "{name} over {world}: non-finite logits at step {step}");
                let diff = max_diff(g, e);
                assert!(diff <= bound, "{name} over {world} shards, step {step}: logits {diff} apart (bound {bound})");
            }
            assert_eq!(tokens, expected_tokens, "{name} over {world} shards");
        }
    }
}

/// The real Gemma 3 270M Q4_K_M with the file's own blocks on Candle, its `o_proj` and
/// `down_proj` Q4_K/Q6_K blocks cut at 256-column super-block boundaries. Candle's block
/// products quantize their activations to 8 bits, so the split's partial sums (added in
/// another order) move some activations across a rounding boundary, and those differences grow
/// layer by layer into a draw of the activation quantization's own noise (measured on this
/// model: the unsplit model's logits and the split's differ by as much as either differs from
/// the dense f32 model). So the check is against the dense f32 model: the split is no farther
/// from it than 1.5 times the unsplit quantized model, and picks the unsplit model's tokens.
#[test]
#[allow(deprecated)] // burn-candle is deprecated upstream but a supported CPU backend here.
fn real_model_blocks_split_over_two_shards_on_candle() {
    let device = burn::backend::candle::CandleDevice::default();
    let checkpoint = Checkpoint::open(common::real_model()).expect("open");
    let with = |weights| move |d: &_| LoadOptions::<Candle>::new().device(Clone::clone(d)).weights(weights);
    let prompt = [2, 818, 5279, 529, 7001, 563];
    let one = std::slice::from_ref(&device);
    let mut dense = ShardedModel::load(&checkpoint, one, with(WeightFormat::Dense), Vec::new()).expect("dense");
    let (reference, _) = run(&mut dense, &prompt, 3);
    drop(dense);
    let mut whole = ShardedModel::load(&checkpoint, one, with(WeightFormat::Native), Vec::new()).expect("whole");
    let (expected, expected_tokens) = run(&mut whole, &prompt, 3);
    drop(whole);
    let devices = [device.clone(), device];
    let native = with(WeightFormat::Native);
    let mut split = ShardedModel::load(&checkpoint, &devices, native, host_all_reduce(2)).expect("shards");
    let (got, tokens) = run(&mut split, &prompt, 3);
    for step in 0..got.len() {
        let (noise, diff) = (max_diff(&expected[step], &reference[step]), max_diff(&got[step], &reference[step]));
        assert!(got[step].iter().all(|v| v.is_finite()));
        assert!(diff <= 1.5 * noise, "step {step}: split {diff} from the dense model, unsplit {noise}");
    }
    assert_eq!(tokens, expected_tokens);
}

/// A split the heads do not allow is refused before any weight is read, naming the heads; a
/// step past the cache or the vocabulary is refused before it reaches the shards, which go on.
#[test]
fn bad_splits_and_requests_are_refused() {
    let device = Default::default();
    let checkpoint = Checkpoint::open(common::fixtures().join("tiny-gemma/gemma3")).expect("open");
    let options = |d: &_| common::dense_f32::<NdArray>(d);
    match ShardedModel::load(&checkpoint, &[device; 3], options, host_all_reduce(3)) {
        Err(Error::Model(e)) => {
            assert!(matches!(*e, ModelError::TensorParallel(_)), "{e}");
            assert!(e.to_string().contains("attention heads (4)"), "{e}");
        }
        Err(e) => panic!("another error: {e}"),
        Ok(_) => panic!("4 heads split over 3 shards"),
    }
    assert!(ShardedModel::load(&checkpoint, &[device; 2], options, host_all_reduce(3)).is_err());

    let mut split = ShardedModel::load(&checkpoint, &[device; 2], options, host_all_reduce(2)).expect("shards");
    assert!(matches!(split.logits(&[2, 3]), Err(Error::Model(e)) if matches!(*e, ModelError::InvalidInput(_))));
    split.new_cache(4).expect("cache");
    let overflow = split.logits(&[2, 3, 4, 5, 6]);
    assert!(matches!(overflow, Err(Error::Model(e)) if matches!(*e, ModelError::ContextOverflow { .. })));
    let past = split.logits(&[2, 100_000]);
    assert!(matches!(past, Err(Error::Model(e)) if matches!(*e, ModelError::InvalidInput(_))));
    assert_eq!(split.position(), 0);
    assert_eq!(split.greedy(&[2, 3]).map(|_| split.position()).expect("still runs"), 2);
}
