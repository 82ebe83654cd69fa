//! Where a bench's model comes from: a checkpoint (GGUF file or HF directory, with its
//! tokenizer) or `synthetic:<preset>`, random weights in the shapes of a published model
//! (`GemmaConfig::preset`) with a tokenizer whose tokens are the ids themselves.

use burn::tensor::DType;
use burn_gemma::{
    Checkpoint, Gemma, GemmaBackend, GemmaConfig, KvFormat, LoadOptions, ModelOptions, Tokenizer, WeightFormat,
};
use burn_gemma_model::RandomWeights;

/// The program's errors: the library's, or a message about its command line.
pub type CliError = Box<dyn std::error::Error>;

/// The model `spec` names (random weights of `seed` for a synthetic one) and its tokenizer.
pub fn load<B: GemmaBackend>(
    spec: &str,
    seed: u64,
    (weights, dtype, kv_cache): (WeightFormat, DType, KvFormat),
    device: &B::Device,
) -> Result<(Gemma<B>, Tokenizer), CliError> {
    match spec.strip_prefix("synthetic:") {
        Some(preset) => {
            let options = ModelOptions { dtype, weights, kv_cache: Some(kv_cache) };
            let config = GemmaConfig::preset(preset)?;
            let vocab = config.vocab_size;
            Ok((Gemma::<B>::load(config, &mut RandomWeights::new(seed), &options, device)?, id_tokenizer(vocab)?))
        }
        None => {
            let options =
                LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(weights).kv_cache(kv_cache);
            let checkpoint = Checkpoint::open(spec)?;
            let tokenizer = checkpoint.tokenizer()?;
            Ok((checkpoint.load(options)?.model, tokenizer))
        }
    }
}

/// A tokenizer whose tokens are the ids themselves (`w<id>`), for random-weight models.
fn id_tokenizer(vocab: usize) -> Result<Tokenizer, CliError> {
    let mut tokens: Vec<String> = ["<pad>", "<eos>", "<bos>", "<unk>"].map(String::from).to_vec();
    tokens.extend((4..vocab).map(|i| format!("w{i}")));
    let types = (0..vocab).map(|i| if i < 4 { 3 } else { 1 }).collect();
    Ok(Tokenizer::from_vocab(tokens, (0..vocab).map(|i| -(i as f32)).collect(), types, 2)?)
}
