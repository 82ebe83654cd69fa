//! Accuracy of quantized weights and KV caches on the real model, against an f32 reference.
//!
//! ```text
//! cargo run --release --features cuda,tools --example accuracy -- --backend cuda \
//!     --fixture tests/fixtures/gemma3-270m-reference.json
//! ```
//!
//! Every fixture prompt plus its reference greedy continuation is fed token by token (`--mode
//! decode`, the decode kernels and the KV cache at every step) or in one pass (`--mode
//! prefill`) through the reference (f32 weights dequantized from the file, f32 KV cache,
//! f32 compute) and through each variant `weights:kv` in lockstep. Per variant: top-1
//! agreement with the reference, top-1 agreement with the HF transformers fixture, and the mean
//! and largest KL divergence `KL(reference || variant)` of the next-token distributions.

use burn::tensor::{DType, Tensor};
use burn_gemma::{
    backends::{cpu_threads, dispatch, parse_kv_cache, resolve_weights, set_cpu_threads, BackendKind, BackendTask},
    generation::token_tensor,
    Checkpoint, Error, Gemma, GemmaBackend, KvCache, LoadOptions, WeightFormat,
};
use clap::Parser;
use std::path::PathBuf;

/// The program's errors: the library's, or a message about its command line.
type CliError = Box<dyn std::error::Error>;

#[derive(Parser, Clone)]
struct Args {
    /// GGUF file or HF directory; default: the default model (fetched once).
    #[arg(long)]
    model: Option<PathBuf>,
    /// The HF transformers reference (`gemma3-270m-reference.json`).
    #[arg(long)]
    fixture: PathBuf,
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Comma-separated `weights:kv` pairs (`--weights` and `--kv-cache` values).
    #[arg(long, default_value = "f32:f32,bf16:bf16,bf16:int8,q8:bf16,q8:int8,q4:bf16,q4:int8,native:bf16,native:int8")]
    variants: String,
    /// decode (token by token) or prefill (one pass per prompt).
    #[arg(long, default_value = "decode")]
    mode: String,
    /// CPU threads of the CPU backends (candle, ndarray); default: the machine's physical cores.
    #[arg(long)]
    threads: Option<std::num::NonZeroUsize>,
    /// Only the first N fixture cases (all by default).
    #[arg(long)]
    cases: Option<usize>,
}

struct Case {
    name: String,
    sequence: Vec<u32>,
    /// HF's top-1 at every position.
    hf_top1: Vec<u32>,
}

fn read_cases(path: &PathBuf) -> Result<Vec<Case>, CliError> {
    let bad = |why: &str| CliError::from(format!("{}: {why}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io { path: path.clone(), source })?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(&e.to_string()))?;
    let ids = |v: &serde_json::Value| -> Option<Vec<u32>> {
        v.as_array()?.iter().map(|x| x.as_u64().map(|x| x as u32)).collect()
    };
    json["cases"]
        .as_array()
        .ok_or_else(|| bad("no `cases` array"))?
        .iter()
        .map(|c| {
            let prompt = ids(&c["prompt_ids"]).ok_or_else(|| bad("case without prompt_ids"))?;
            let greedy = ids(&c["greedy_ids"]).ok_or_else(|| bad("case without greedy_ids"))?;
            let top: Vec<u32> = c["top_ids"]
                .as_array()
                .ok_or_else(|| bad("case without top_ids"))?
                .iter()
                .map(|r| ids(r).and_then(|r| r.first().copied()).ok_or_else(|| bad("empty top_ids row")))
                .collect::<Result<_, _>>()?;
            let sequence: Vec<u32> = prompt.iter().chain(&greedy[..greedy.len().saturating_sub(1)]).copied().collect();
            if top.len() != sequence.len() {
                return Err(bad("top_ids and the teacher-forced sequence differ in length"));
            }
            Ok(Case { name: c["name"].as_str().unwrap_or("?").to_string(), sequence, hf_top1: top })
        })
        .collect()
}

#[derive(Default, Clone)]
struct Stats {
    positions: usize,
    top1_ref: usize,
    top1_hf: usize,
    kl_sum: f64,
    kl_max: f64,
}

fn log_softmax(logits: &[f32]) -> Vec<f64> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let sum: f64 = logits.iter().map(|&v| (v as f64 - max).exp()).sum();
    let log_z = max + sum.ln();
    logits.iter().map(|&v| v as f64 - log_z).collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter().enumerate().fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &x)| if x > bv { (i, x) } else { (bi, bv) }).0
        as u32
}

struct Variant<B: GemmaBackend> {
    spec: String,
    label: String,
    model: Gemma<B>,
}

/// One model's logits over a case: position by position through its KV cache (decode) or all
/// at once (prefill).
struct Stepper<'a, B: GemmaBackend> {
    model: &'a Gemma<B>,
    cache: KvCache<B>,
    /// Prefill mode: every position's logits, computed up front.
    rows: Option<Vec<Vec<f32>>>,
}

impl<'a, B: GemmaBackend> Stepper<'a, B> {
    fn new(model: &'a Gemma<B>, ids: &[u32], decode: bool, device: &B::Device) -> Result<Self, CliError> {
        let mut cache = model.new_cache(1, ids.len())?;
        let rows =
            if decode { None } else { Some(rows(model, model.forward(token_tensor::<B>(ids, device), &mut cache)?)?) };
        Ok(Self { model, cache, rows })
    }

    fn logits(&mut self, pos: usize, id: u32, device: &B::Device) -> Result<Vec<f32>, CliError> {
        match &mut self.rows {
            Some(rows) => Ok(std::mem::take(&mut rows[pos])),
            None => {
                Ok(rows(self.model, self.model.forward(token_tensor::<B>(&[id], device), &mut self.cache)?)?.remove(0))
            }
        }
    }
}

fn rows<B: GemmaBackend>(model: &Gemma<B>, t: Tensor<B, 3>) -> Result<Vec<Vec<f32>>, CliError> {
    let data = t.cast(DType::F32).into_data().to_vec::<f32>().map_err(|e| CliError::from(format!("{e:?}")))?;
    Ok(data.chunks_exact(model.config().vocab_size).map(<[f32]>::to_vec).collect())
}

/// Adds one position's comparison of `logits` against `reference` (log-probabilities and top-1).
fn compare(s: &mut Stats, reference: &[f64], reference_top: u32, logits: &[f32], hf_top: u32) {
    let top = argmax(logits);
    let logq = log_softmax(logits);
    let kl: f64 = reference.iter().zip(&logq).map(|(&p, &q)| p.exp() * (p - q)).sum();
    s.positions += 1;
    s.top1_ref += usize::from(top == reference_top);
    s.top1_hf += usize::from(top == hf_top);
    s.kl_sum += kl;
    s.kl_max = s.kl_max.max(kl);
}

struct Accuracy(Args);

impl BackendTask for Accuracy {
    type Output = Result<(), CliError>;

    fn run<B: GemmaBackend>(self, device: B::Device, name: &str) -> Result<(), CliError> {
        let a = self.0;
        let decode = match a.mode.as_str() {
            "decode" => true,
            "prefill" => false,
            other => return Err(CliError::from(format!("unknown --mode {other:?}; expected decode or prefill"))),
        };
        let mut cases = read_cases(&a.fixture)?;
        if let Some(n) = a.cases {
            cases.truncate(n);
        }
        let path = match a.model {
            Some(p) => p,
            None => burn_gemma::fetch::default_model(|_, _| {})?,
        };
        let checkpoint = Checkpoint::open(&path)?;
        let options = LoadOptions::<B>::new().device(device.clone()).dtype(DType::F32).weights(WeightFormat::Dense);
        let reference = checkpoint.load(options)?.model;
        let specs: Vec<(&str, &str)> = a
            .variants
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|spec| {
                spec.split_once(':').ok_or_else(|| CliError::from(format!("variant {spec:?} is not weights:kv")))
            })
            .collect::<Result<_, _>>()?;
        let mut variants = Vec::new();
        for &(weights, kv) in &specs {
            let spec = format!("{weights}:{kv}");
            let (format, dtype) = resolve_weights(weights, None, name)?;
            let kv_cache = parse_kv_cache(kv, dtype)?;
            let options =
                LoadOptions::<B>::new().device(device.clone()).dtype(dtype).weights(format).kv_cache(kv_cache);
            let model = checkpoint.load(options)?.model;
            let label =
                format!("{weights} ({format}, {:.0} MB) | {kv_cache} | {dtype:?}", model.weight_bytes() as f64 / 1e6);
            variants.push(Variant { spec, label, model });
        }
        eprintln!("{} | backend {name} | mode {} | {} cases", path.display(), a.mode, cases.len());
        // int8-KV variants are also compared with the variant of the same weights and a dense
        // KV cache (the issue's "relative to the same run with bf16 KV").
        let siblings: Vec<(usize, usize)> = specs
            .iter()
            .enumerate()
            .filter(|(_, (_, kv))| *kv == "int8")
            .filter_map(|(i, (weights, _))| Some((i, specs.iter().position(|(w, k)| w == weights && *k != "int8")?)))
            .collect();
        let mut sibling_stats = vec![Stats::default(); siblings.len()];
        let mut stats = vec![Stats::default(); variants.len()];
        let mut ref_hf = Stats::default();
        for case in &cases {
            let mut reference_steps = Stepper::new(&reference, &case.sequence, decode, &device)?;
            let mut steppers = variants
                .iter()
                .map(|v| Stepper::new(&v.model, &case.sequence, decode, &device))
                .collect::<Result<Vec<_>, _>>()?;
            for (pos, &id) in case.sequence.iter().enumerate() {
                let r = reference_steps.logits(pos, id, &device)?;
                let (ref_logp, ref_top) = (log_softmax(&r), argmax(&r));
                ref_hf.positions += 1;
                ref_hf.top1_hf += usize::from(ref_top == case.hf_top1[pos]);
                let logits = steppers.iter_mut().map(|s| s.logits(pos, id, &device)).collect::<Result<Vec<_>, _>>()?;
                for ((v, s), l) in variants.iter().zip(&mut stats).zip(&logits) {
                    if l.iter().any(|x| !x.is_finite()) {
                        return Err(CliError::from(format!(
                            "{}: non-finite logits in case {} at position {pos}",
                            v.label, case.name
                        )));
                    }
                    compare(s, &ref_logp, ref_top, l, case.hf_top1[pos]);
                }
                for (s, &(int8, dense)) in sibling_stats.iter_mut().zip(&siblings) {
                    let d = &logits[dense];
                    compare(s, &log_softmax(d), argmax(d), &logits[int8], case.hf_top1[pos]);
                }
            }
            eprintln!("case {} ({} positions) done", case.name, case.sequence.len());
        }
        println!(
            "reference (f32 weights dequantized from the file, f32 KV, f32 compute): top-1 agreement with HF {:.2}% over {} positions",
            100.0 * ref_hf.top1_hf as f64 / ref_hf.positions.max(1) as f64,
            ref_hf.positions
        );
        println!("| weights | KV cache | compute | top-1 vs f32 reference | top-1 vs HF | mean KL | max KL |");
        println!("| --- | --- | --- | ---: | ---: | ---: | ---: |");
        for (v, s) in variants.iter().zip(&stats) {
            let n = s.positions.max(1) as f64;
            println!(
                "| {} | {:.2}% | {:.2}% | {:.2e} | {:.2e} |",
                v.label,
                100.0 * s.top1_ref as f64 / n,
                100.0 * s.top1_hf as f64 / n,
                s.kl_sum / n,
                s.kl_max
            );
        }
        if !siblings.is_empty() {
            println!("\nint8 KV against the same weights with a dense KV cache:\n");
            println!("| int8 variant (weights:kv) | compared with | top-1 agreement | mean KL | max KL |");
            println!("| --- | --- | ---: | ---: | ---: |");
            for (s, &(int8, dense)) in sibling_stats.iter().zip(&siblings) {
                let n = s.positions.max(1) as f64;
                let (a, b) = (&variants[int8].spec, &variants[dense].spec);
                println!(
                    "| {a} | {b} | {:.2}% | {:.2e} | {:.2e} |",
                    100.0 * s.top1_ref as f64 / n,
                    s.kl_sum / n,
                    s.kl_max
                );
            }
        }
        Ok(())
    }
}

fn main() -> Result<(), CliError> {
    let args = Args::parse();
    let kind: BackendKind = args.backend.parse()?;
    // Candle splits its dense products into RAYON_NUM_THREADS tasks: set while the program has
    // no other thread, before the CPU thread pool starts.
    let threads = cpu_threads(args.threads);
    std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
    set_cpu_threads(std::num::NonZeroUsize::new(threads))?;
    dispatch(kind, Accuracy(args), &mut |note| eprintln!("{note}"))?
}
