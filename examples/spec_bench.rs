//! Speculative decoding's speed on one backend: greedy generation with and without drafts from
//! the same prompt, alternating, medians of decode tokens per second, and whether every drafted
//! run gave the tokens of the run without drafts.
//!
//! ```text
//! cargo run --release --features cuda,tools --example spec_bench -- \
//!     --model synthetic:gemma3-1b --backend cuda --drafts ngram,self,model:synthetic:gemma3-270m \
//!     --draft-tokens 4 --prompt-len 512 --gen 128 --reps 3
//! ```
//!
//! `--model` is a GGUF file, an HF directory, or `synthetic:<preset>` (random weights in the
//! published shapes; the token ids then stand for themselves). `--drafts` lists the drafters
//! compared with plain decoding: `ngram` (prompt lookup), `self` (the target drafting for
//! itself: every draft kept, the upper bound of a draft model), `model:SPEC` (a draft model,
//! SPEC a path or `synthetic:<preset>`, loaded as the target is). The prompt is `--prompt-file`
//! (tokenized with the model's tokenizer, in its chat template with `--chat`) or `--prompt-len`
//! ids: a 40-id phrase repeated (`--prompt copy`, what prompt lookup finds) or random ids.
//! Drafting pauses after rounds that kept nothing (the library's default) unless
//! `--keep-drafting`, which measures what rejected drafts cost at every step. Every run starts
//! from an empty context; a round runs each configuration once, the first round is a warm-up.

#[path = "cli/backend_args.rs"]
mod backend_args;
#[path = "cli/model_source.rs"]
mod model_source;

use backend_args::BackendArgs;
use burn_gemma::{
    backends::{dispatch, BackendTask},
    chat::ChatTemplate,
    speculative::{DraftLength, DraftModel, Drafter, Misses, Speculation},
    GemmaBackend, GemmaConfig, GenerationConfig, Generator, Tokenizer,
};
use clap::Parser;
use std::{num::NonZeroUsize, time::Instant};

type CliError = Box<dyn std::error::Error>;

/// `--prompt`.
#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum PromptKind {
    /// A 40-id phrase repeated to the length.
    Copy,
    /// Random ids.
    Random,
}

#[derive(Parser, Clone)]
struct Args {
    /// GGUF file, HF directory, or synthetic:<preset>.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    backend: BackendArgs,
    /// Drafters compared with decoding without drafts, comma-separated: ngram, self,
    /// model:PATH, model:synthetic:<preset>.
    #[arg(long, value_delimiter = ',', default_value = "ngram")]
    drafts: Vec<String>,
    /// Tokens drafted per round at most.
    #[arg(long, default_value_t = NonZeroUsize::new(4).unwrap_or(NonZeroUsize::MIN))]
    draft_tokens: NonZeroUsize,
    /// Draft at every step, also after rounds that kept nothing.
    #[arg(long)]
    keep_drafting: bool,
    /// A text prompt (tokenized with the model's tokenizer) instead of generated ids.
    #[arg(long)]
    prompt_file: Option<std::path::PathBuf>,
    /// With --prompt-file: the text as a user turn of the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Generated prompt: copy | random.
    #[arg(long, value_enum, default_value_t = PromptKind::Copy)]
    prompt: PromptKind,
    #[arg(long, default_value_t = 512)]
    prompt_len: usize,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128)]
    gen: usize,
    /// Timed runs of each configuration, after one warm-up run each.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seed of synthetic weights (a synthetic draft model takes seed + 1) and of the ids.
    #[arg(long, default_value_t = 7)]
    seed: u64,
}

/// One configuration: its drafter (none: plain decoding) and what its timed runs gave.
struct Runs<B: GemmaBackend> {
    name: String,
    drafter: Option<Speculation<B>>,
    decode: Vec<f64>,
    same: bool,
    kept: usize,
    drafted: usize,
    per_step: f64,
}

struct SpecBench(Args);

fn prompt_ids(a: &Args, config: &GemmaConfig, tokenizer: &Tokenizer) -> Result<Vec<u32>, CliError> {
    let vocab = config.vocab_size;
    if let Some(path) = &a.prompt_file {
        let text = std::fs::read_to_string(path).map_err(|e| format!("--prompt-file {}: {e}", path.display()))?;
        let text = match a.chat {
            true => ChatTemplate::for_architecture(config.model_type).user_turn(&text),
            false => text,
        };
        return Ok(tokenizer.encode(&text, burn_gemma::Bos::Prepend)?);
    }
    let mut state = a.seed;
    let mut next = move || {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        4 + ((state >> 33) as usize % (vocab - 4)) as u32
    };
    let body: Vec<u32> = match a.prompt {
        PromptKind::Copy => {
            let phrase: Vec<u32> = (0..40).map(|_| next()).collect();
            phrase.iter().copied().cycle().take(a.prompt_len.saturating_sub(1)).collect()
        }
        PromptKind::Random => (1..a.prompt_len).map(|_| next()).collect(),
    };
    Ok(std::iter::once(2).chain(body).collect())
}

/// The median (the mean of the middle two of an even count).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

impl BackendTask for SpecBench {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let a = self.0.clone();
        if a.gen < 2 || a.reps == 0 || (a.prompt_file.is_none() && a.prompt_len < 2) {
            return Err("--gen and --prompt-len must be at least 2, --reps at least 1".into());
        }
        let formats = a.backend.formats(name)?;
        let dtype = formats.1;
        burn_gemma::backends::check_dtype::<B>(&device, dtype)?;
        let (target, tokenizer) = model_source::load::<B>(&a.model, a.seed, formats, &device)?;
        let prompt = prompt_ids(&a, target.config(), &tokenizer)?;
        eprintln!("model {} on {name} ({dtype:?}), prompt of {} tokens, {} new", a.model, prompt.len(), a.gen);
        let config = GenerationConfig {
            max_new_tokens: a.gen,
            // Every run makes `gen` tokens: the stop tokens of a random model mean nothing.
            stop_tokens: Vec::new(),
            ..Default::default()
        };
        let mut generator = Generator::new(target, tokenizer)?;
        let misses = if a.keep_drafting { Misses::KeepDrafting } else { Misses::Backoff };
        let length = DraftLength::Fixed(a.draft_tokens);
        let runs_of = |name: String, drafter: Option<Speculation<B>>| Runs {
            name,
            drafter,
            decode: Vec::new(),
            same: true,
            kept: 0,
            drafted: 0,
            per_step: 0.0,
        };
        // The drafters, built once (a draft model is loaded once and lent to each run).
        let mut runs = vec![runs_of("none".into(), None)];
        for spec in &a.drafts {
            let drafter = match spec.as_str() {
                "ngram" => Drafter::PromptLookup(Default::default()),
                "self" => Drafter::Model(Box::new(DraftModel::new(
                    model_source::load::<B>(&a.model, a.seed, formats, &device)?.0,
                ))),
                other => match other.strip_prefix("model:") {
                    Some(path) => Drafter::Model(Box::new(DraftModel::new(
                        model_source::load::<B>(path, a.seed + 1, formats, &device)?.0,
                    ))),
                    None => return Err(format!("--drafts: unknown drafter `{other}` (ngram, self, model:SPEC)").into()),
                },
            };
            runs.push(runs_of(spec.clone(), Some(Speculation::new(drafter, length).with_misses(misses))));
        }
        // Rounds: a warm-up, then `reps` timed; within a round the configurations alternate,
        // plain decoding first, whose tokens the others' are compared with.
        for round in 0..=a.reps {
            let mut plain: Option<Vec<u32>> = None;
            for run in runs.iter_mut() {
                generator.set_speculation(run.drafter.take())?;
                // Each run starts from an empty context (the recorded graphs stay).
                generator.reset();
                let started = Instant::now();
                let out = generator.continue_ids(&prompt, &config, |_| {})?;
                let wall = started.elapsed();
                run.drafter = generator.take_speculation();
                let stats = &out.stats;
                eprintln!("{} round {round}: {stats} ({:.2} s)", run.name, wall.as_secs_f64());
                if round == 0 {
                    continue;
                }
                run.decode.push(stats.decode_tokens_per_second());
                if let Some(spec) = stats.speculation {
                    run.kept = spec.accepted;
                    run.drafted = spec.drafted;
                    run.per_step = stats.generated_tokens.saturating_sub(1) as f64 / spec.target_steps.max(1) as f64;
                }
                match &plain {
                    None => plain = Some(out.tokens),
                    Some(tokens) => {
                        if let Some(at) = out.tokens.iter().zip(tokens).position(|(a, b)| a != b) {
                            eprintln!(
                                "{} round {round}: token {at} is {} where decoding without drafts made {}",
                                run.name, out.tokens[at], tokens[at]
                            );
                        }
                        run.same &= out.tokens == *tokens;
                    }
                }
            }
        }
        let plain = median(runs[0].decode.clone());
        println!("| drafter | decode tok/s | speed-up | drafts kept | tokens per model step | same tokens |");
        println!("| --- | ---: | ---: | ---: | ---: | --- |");
        for run in &runs {
            let tg = median(run.decode.clone());
            let same = if run.same { "yes" } else { "NO" };
            println!(
                "| {} | {tg:.2} | {:.2}x | {}/{} | {:.2} | {same} |",
                run.name,
                tg / plain,
                run.kept,
                run.drafted,
                if run.drafted > 0 { run.per_step } else { 1.0 }
            );
            println!(
                "JSON {{\"model\":\"{}\",\"backend\":\"{name}\",\"drafter\":\"{}\",\"draft_tokens\":{},\"prompt_tokens\":{},\"gen\":{},\"reps\":{},\"tg\":{tg:.3},\"plain_tg\":{plain:.3},\"kept\":{},\"drafted\":{},\"same\":{}}}",
                a.model, run.name, a.draft_tokens, prompt.len(), a.gen, a.reps, run.kept, run.drafted, run.same
            );
        }
        Ok(())
    }
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind = args.backend.check()?;
    args.backend.start_threads()?;
    dispatch(kind, SpecBench(args.clone()), &mut |note| eprintln!("{note}"))?
}
