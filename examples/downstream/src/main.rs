//! Generates with burn-gemma from a crate that turns on Burn's default features.
//!
//! ```text
//! cargo run --release --manifest-path examples/downstream/Cargo.toml -- [MODEL] [PROMPT]
//! ```
//!
//! MODEL defaults to Gemma 3 270M (fetched once); the backend is wgpu.

use burn::tensor::Tensor;
use burn_gemma::{backends::Wgpu, GenerationConfig, Generator, LoadOptions, WeightFormat};

fn main() -> Result<(), burn_gemma::Error> {
    let mut args = std::env::args().skip(1);
    let model = match args.next() {
        Some(path) => path.into(),
        None => burn_gemma::fetch::default_model(|_, _| {})?,
    };
    let prompt = args.next().unwrap_or_else(|| "The capital of France is".to_string());

    // Burn's own wgpu backend, fused because Burn's default features are on, still works beside
    // burn-gemma's: both share the device.
    let fused = Tensor::<burn::backend::Wgpu, 1>::from_floats([1.0, 2.0, 3.0], &Default::default());
    eprintln!("burn::backend::Wgpu is {}", std::any::type_name::<burn::backend::Wgpu>());
    eprintln!("sum on the fused backend: {}", fused.sum().into_scalar());

    let checkpoint = burn_gemma::Checkpoint::open(&model)?;
    let loaded = checkpoint.load(LoadOptions::<Wgpu>::new().weights(WeightFormat::Dense))?;
    let mut generator = Generator::new(loaded.model, checkpoint.tokenizer()?)?;
    let config = GenerationConfig { max_new_tokens: 8, ..Default::default() };
    let out = generator.generate(&prompt, &config, |text| print!("{text}"))?;
    println!();
    eprintln!("{}", out.stats);
    Ok(())
}
