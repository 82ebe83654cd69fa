//! The decode table: every kernel a decode step launches, on the shapes of the Gemma 3 models,
//! with its share of the measured copy bandwidth.

use super::{copy_bandwidth, random, time};
use burn::tensor::{DType, Tensor, TensorData};
use burn_gemma::{Error, GemmaBackend, GemmaConfig};
use burn_gemma_kernels::{
    graph::{self, Replay, StepBuffer, StepGraph},
    rope, AddNorm, AttentionMask, AttentionOptions, Draws, Epilogue, HeadNorms, HostMatrix, HostQuantized,
    KernelTuning, KvFormat, KvRows, KvView, Matrix, QkvLayout, QuantFormat, RopeTables, SamplingParams, StepPosition,
    ValueNorm,
};

/// Calls recorded into one graph per timing.
const GRAPH_CALLS: usize = 16;

/// Bytes that the calls of one timing cycle through, at least: several times the largest L2
/// (50 MB on the H100), so that weights and caches come from device memory as in a decode step.
const COLD_BYTES: usize = 256 << 20;

/// Copies of an operand of `bytes` to cycle through (at most [`GRAPH_CALLS`]).
pub(super) fn copies_for(bytes: usize) -> usize {
    COLD_BYTES.div_ceil(bytes.max(1)).clamp(1, GRAPH_CALLS)
}

/// How a kernel was timed.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Clock {
    /// CUDA events around a replayed graph of [`GRAPH_CALLS`] calls.
    Graph,
    /// The host around synchronized batches (launch cost included).
    Host,
}

/// Times decode kernels on one device, by graph replay where the backend records.
pub(super) struct Timer<'a, B: GemmaBackend> {
    device: &'a B::Device,
    reps: usize,
    copy_gbs: f64,
    /// Why graphs are not used (printed once), if they are not.
    no_graph: Option<String>,
    /// (weight format, or `None` for every format; kernel seconds; floor seconds) of the
    /// decode kernels of the current model, per token.
    totals: Vec<(Option<String>, f64, f64)>,
}

impl<'a, B: GemmaBackend> Timer<'a, B> {
    /// A timer of `reps` samples (no copy bandwidth: for [`Timer::time`] alone).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(super) fn new(device: &'a B::Device, reps: usize) -> Self {
        Self { device, reps, copy_gbs: 0.0, no_graph: None, totals: Vec::new() }
    }

    /// Median seconds per call of `f` (given the call's index), and whether the GPU timed it.
    /// A backend that cannot record (not CUDA) is timed by the host from then on; a call that
    /// cannot be recorded (a prefill product) only this once.
    pub(super) fn time<T>(&mut self, mut f: impl FnMut(usize) -> T) -> (f64, Clock) {
        if self.no_graph.is_none() {
            match self.graph_time(&mut f) {
                Ok(s) => return (s, Clock::Graph),
                Err(e @ graph::GraphError::NotCuda(_)) => {
                    println!("\n(graph timing unavailable: {e}; host timing from here)\n");
                    self.no_graph = Some(e.to_string());
                }
                Err(e) => println!("\n(graph timing unavailable for this call: {e}; host timing)\n"),
            }
        }
        let mut call = 0;
        let g = || {
            call += 1;
            f(call)
        };
        (time::<B, _>(self.device, self.reps, g), Clock::Host)
    }

    fn graph_time<T>(&self, f: &mut impl FnMut(usize) -> T) -> Result<f64, graph::GraphError> {
        let probe = Tensor::<B, 1>::zeros([1], (self.device, DType::F32));
        let buffer = StepBuffer::float(&probe)?;
        let ((), recording) = graph::record::<B, _>(self.device, || {
            let outs: Vec<T> = (0..GRAPH_CALLS).map(&mut *f).collect();
            drop(outs);
        })?;
        let mut graph = StepGraph::new(recording, KernelTuning::DEFAULT.dependent_launch)?;
        let mut byte = [0u8; 4];
        let mut replay = |graph: &mut StepGraph| {
            graph.replay(Replay { writes: &[], read: Some((&buffer, &mut byte)) }).map(|_| graph.last_replay().gpu)
        };
        for _ in 0..3 {
            replay(&mut graph)?;
        }
        let mut times = (0..self.reps)
            .map(|_| replay(&mut graph).map(|t| t.as_secs_f64() / GRAPH_CALLS as f64))
            .collect::<Result<Vec<f64>, _>>()?;
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    }

    /// Times `f`, prints its row; `per_token`: the weight format whose decode step launches it
    /// (`None`: every format's), and how many times.
    fn row<T>(
        &mut self,
        what: &str,
        shape: &str,
        bytes: f64,
        per_token: Option<(Option<&str>, usize)>,
        f: impl FnMut(usize) -> T,
    ) {
        let (s, clock) = self.time(f);
        let floor = bytes / (self.copy_gbs * 1e9);
        let clock = if clock == Clock::Graph { "" } else { " (host)" };
        println!(
            "| {what} | {shape} | {:.2}{clock} | {:.1} MB | {:.0} | {:.0}% |",
            s * 1e6,
            bytes / 1e6,
            bytes / s / 1e9,
            100.0 * floor / s
        );
        if let Some((weights, count)) = per_token {
            let tag = weights.map(str::to_string);
            self.totals.push((tag, s * count as f64, floor * count as f64));
        }
    }
}

/// Weight formats of the GEMV rows.
#[derive(Clone, Copy)]
enum Weights {
    Dense,
    Quantized(QuantFormat),
}

impl Weights {
    fn name(self, dt: DType) -> String {
        match self {
            Self::Dense => format!("{dt:?}").to_lowercase(),
            Self::Quantized(f) => f.to_string(),
        }
    }
}

const WEIGHTS: [Weights; 3] =
    [Weights::Dense, Weights::Quantized(QuantFormat::Q8), Weights::Quantized(QuantFormat::Q4)];

/// A random `[out, in]` matrix in `weights`' format, uploaded as the model uploads it: in row
/// blocks of at most the backend's largest buffer (one product over all of them).
fn matrix<B: GemmaBackend>(out: usize, inp: usize, weights: Weights, dt: DType, d: &B::Device) -> Matrix<B> {
    let bytes_per_row = match weights {
        Weights::Dense => inp * dt.size(),
        Weights::Quantized(_) => inp,
    };
    let rows_per_block = (B::max_buffer_bytes(d) / bytes_per_row).max(1);
    let parts = (0..out)
        .step_by(rows_per_block)
        .map(|first| {
            let rows = rows_per_block.min(out - first);
            crate::upload(host_matrix::<B>(rows, inp, weights, dt, first as u64, d), d)
        })
        .collect();
    Matrix::stacked(parts)
}

fn host_matrix<B: GemmaBackend>(
    out: usize,
    inp: usize,
    weights: Weights,
    dt: DType,
    seed: u64,
    d: &B::Device,
) -> HostMatrix<B> {
    match weights {
        Weights::Dense => HostMatrix::Dense(random::<B>(vec![out * inp], dt, d).mul_scalar(0.02).reshape([out, inp])),
        Weights::Quantized(format) => {
            // Random codes and scales directly (quantizing random floats on the host would take
            // minutes for the largest tables).
            let mut s = 0x9E37_79B9_7F4A_7C15u64 ^ (out * inp) as u64 ^ seed;
            let mut next = move || {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                s
            };
            let mask = if format == QuantFormat::Q4 { 15 } else { 255 };
            let codes = (0..out * inp).map(|_| (next() >> 40) as u8 & mask).collect();
            let blocks = out * inp / burn_gemma_kernels::quant::BLOCK;
            let scales = (0..blocks).map(|_| 1e-3 * (1 + (next() >> 60)) as f32).collect();
            let offsets = if format == QuantFormat::Q4 { vec![-0.01; blocks] } else { Vec::new() };
            match HostQuantized::from_parts(format, out, inp, codes, scales, offsets) {
                Ok(host) => HostMatrix::Quantized(host),
                Err(e) => panic!("random {format} matrix [{out}, {inp}]: {e}"),
            }
        }
    }
}

/// The decode table for each of `models` (`270m`, `1b`, `4b`, `12b`, `27b`).
pub fn run<B: GemmaBackend>(d: &B::Device, dt: DType, reps: usize, models: &[String]) -> Result<(), Error> {
    let copy_gbs = copy_bandwidth::<B>(d, reps);
    println!("\n## Decode kernels (copy bandwidth {copy_gbs:.0} GB/s; floor = bytes / copy bandwidth)\n");
    let mut timer = Timer::<B> { device: d, reps, copy_gbs, no_graph: None, totals: Vec::new() };
    for model in models {
        let config = GemmaConfig::preset(&format!("gemma3-{model}"))?;
        println!("\n### Gemma 3 {model}\n");
        println!("| kernel | shape | us per call | bytes | GB/s | % of floor |");
        println!("|---|---|---:|---:|---:|---:|");
        timer.totals.clear();
        model_rows(&mut timer, &config, dt);
        println!("\nPer decode token (kernels only, from the rows above, 1 row, depth 1024 bf16 KV):\n");
        println!("| weights | kernel us | floor us | floor / kernel |");
        println!("|---|---:|---:|---:|");
        for weights in WEIGHTS.map(|w| w.name(dt)) {
            let (k, f) = timer
                .totals
                .iter()
                .filter(|(w, _, _)| w.as_ref().is_none_or(|w| *w == weights))
                .fold((0.0, 0.0), |(k, f), (_, a, b)| (k + a, f + b));
            if k > 0.0 {
                println!("| {weights} | {:.0} | {:.0} | {:.0}% |", k * 1e6, f * 1e6, 100.0 * f / k);
            }
        }
    }
    Ok(())
}

fn model_rows<B: GemmaBackend>(t: &mut Timer<'_, B>, c: &GemmaConfig, dt: DType) {
    let d = t.device;
    let e = dt.size() as f64;
    let (hidden, inter, hd) = (c.hidden_size, c.intermediate_size, c.head_dim);
    let (heads, kv) = (c.num_attention_heads, c.num_key_value_heads);
    let layers = c.num_hidden_layers;
    let width = (heads + 2 * kv) * hd;
    // (name, in, out, epilogue, launches per token)
    let shapes = [
        ("q|k|v", hidden, width, Epilogue::Identity, layers),
        ("o", heads * hd, hidden, Epilogue::Identity, layers),
        ("gate|up + GELU", hidden, 2 * inter, Epilogue::GeluPairs, layers),
        ("down", inter, hidden, Epilogue::Identity, layers),
        ("lm_head", hidden, c.vocab_size, Epilogue::Identity, 1),
    ];
    for weights in WEIGHTS {
        let name = weights.name(dt);
        for (what, inp, out, epilogue, per_token) in shapes {
            // Enough copies that the calls of one timing do not find the weights in L2 (a
            // decode step reads each weight once).
            let one = matrix::<B>(out, inp, weights, dt, d);
            let copies = copies_for(one.device_bytes());
            let ws: Vec<Matrix<B>> =
                std::iter::once(one).chain((1..copies).map(|_| matrix::<B>(out, inp, weights, dt, d))).collect();
            let w = &ws[0];
            for n in [1usize, 8] {
                let x = random::<B>(vec![n * inp], dt, d).reshape([n, inp]);
                let out_cols = if epilogue == Epilogue::GeluPairs { out / 2 } else { out };
                let bytes = w.device_bytes() as f64 + (n * inp + n * out_cols) as f64 * e;
                let per_token = (n == 1).then_some((Some(name.as_str()), per_token));
                t.row(&format!("{name} {what}"), &format!("{n} x {inp} -> {out}"), bytes, per_token, |i| {
                    B::project(x.clone(), &ws[i % copies], epilogue)
                });
            }
        }
    }

    // Row norms of one decode position: the sandwich add + RMSNorm (twice per layer) and the
    // final norm; QK-norm + RoPE + KV append.
    let residual = random::<B>(vec![hidden], DType::F32, d).reshape([1, 1, hidden]);
    let x = random::<B>(vec![hidden], dt, d).reshape([1, 1, hidden]);
    let norms = AddNorm {
        post: Some(random::<B>(vec![hidden], DType::F32, d)),
        weight: random::<B>(vec![hidden], DType::F32, d),
        eps: 1e-6,
        scale: 1.0,
        out_dtype: dt,
    };
    let h = hidden as f64;
    t.row("add + RMSNorm", &format!("1 x {hidden}"), h * (4.0 + e + 4.0 + e + 8.0), Some((None, 2 * layers)), |_| {
        B::add_rms_norm(residual.clone(), x.clone(), &norms)
    });
    let slots = 1024;
    let (cos, sin) = rope::tables(slots, &rope::Frequencies::plain(hd, 10_000.0));
    let tables = RopeTables {
        cos: Tensor::from_data(TensorData::new(cos, [slots, hd / 2]), d),
        sin: Tensor::from_data(TensorData::new(sin, [slots, hd / 2]), d),
    };
    let norm = Some(HeadNorms {
        query: random::<B>(vec![hd], DType::F32, d),
        key: random::<B>(vec![hd], DType::F32, d),
        eps: 1e-6,
        value: ValueNorm::None,
    });
    let qkv = random::<B>(vec![width], dt, d).reshape([1, width]);
    for format in [KvFormat::Dense(dt), KvFormat::Int8] {
        let layout = QkvLayout {
            heads,
            kv_heads: kv,
            head_dim: hd,
            kv: KvRows::Projected,
            rope: tables.clone(),
            position: StepPosition::Host(700),
            norm: norm.clone(),
            blocks: None,
        };
        let store = B::kv_zeros([1, kv, slots, hd], format, d);
        let kv_bytes = if format == KvFormat::Int8 { (2 * kv * (hd + 4)) as f64 } else { (2 * kv * hd) as f64 * e };
        let bytes = width as f64 * e + (heads * hd) as f64 * e + kv_bytes + (2 * hd) as f64 * 4.0;
        let name = if format == KvFormat::Int8 { "int8 KV" } else { "bf16 KV" };
        let per_token = (format != KvFormat::Int8).then_some((None, layers));
        t.row(
            &format!("QK-norm + RoPE + append ({name})"),
            &format!("{heads}q/{kv}kv x {hd}"),
            bytes,
            per_token,
            |_| {
                // The kernel writes the store's buffers in place: the clone shares them.
                B::qkv_rope_append(qkv.clone(), &layout, store.clone()).expect("a host position reads nothing back").0
            },
        );
    }

    // Decode attention at depth: the group's queries over `depth` keys and values.
    let q = random::<B>(vec![heads * hd], dt, d).reshape([1, heads, 1, hd]);
    let options = AttentionOptions {
        mask: AttentionMask { q_offset: 0, k_offset: 0, window: None },
        scale: 1.0 / (hd as f64).sqrt(),
        softcap: None,
    };
    for depth in [1024usize, 4096, 8192] {
        let keys = random::<B>(vec![kv * depth * hd], dt, d).reshape([1, kv, depth, hd]);
        let values = random::<B>(vec![kv * depth * hd], dt, d).reshape([1, kv, depth, hd]);
        for format in [KvFormat::Dense(dt), KvFormat::Int8] {
            let store = || B::kv_write(B::kv_zeros([1, kv, depth, hd], format, d), keys.clone(), values.clone(), 0);
            let first = store();
            let copies = copies_for(first.device_bytes());
            let stores: Vec<_> = std::iter::once(first).chain((1..copies).map(|_| store())).collect();
            let (name, bytes) = match format {
                KvFormat::Int8 => ("int8 KV", (2 * kv * depth * (hd + 4)) as f64),
                KvFormat::Dense(_) => ("bf16 KV", (2 * kv * depth * hd) as f64 * e),
            };
            // Every layer at depth 1024 (sliding layers see at most their window; the figure
            // per token is an upper bound).
            let per_token = (depth == 1024 && format != KvFormat::Int8).then_some((None, layers));
            t.row(
                &format!("decode attention ({name})"),
                &format!("{heads}q/{kv}kv x {hd}, depth {depth}"),
                bytes + 2.0 * (heads * hd) as f64 * e,
                per_token,
                |i| {
                    let view: KvView<'_, B> = KvView::Decode {
                        store: &stores[i % copies],
                        position: StepPosition::Host(depth - 1),
                        blocks: None,
                    };
                    B::grouped_attention(q.clone(), view, &options).expect("a host position reads nothing back")
                },
            );
        }
    }

    // Sampling over the vocabulary (greedy, the id stays on the device).
    let logits = random::<B>(vec![c.vocab_size], DType::F32, d).reshape([1, c.vocab_size]);
    t.row("sample (greedy)", &format!("1 x {}", c.vocab_size), c.vocab_size as f64 * 4.0, Some((None, 1)), |_| {
        B::sample(logits.clone(), &SamplingParams::GREEDY, Draws::Host(&[0.5])).expect("sampled")
    });
}
