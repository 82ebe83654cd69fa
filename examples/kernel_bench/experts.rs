//! `--section experts`: one mixture-of-experts layer of Gemma 4 26B-A4B (128 experts, top 8,
//! hidden 2816, expert width 704) through both products, by each path of
//! [`ExpertPath`] and by what `project_experts` chooses, for several token counts and
//! dense / Q8 / Q4 experts. Routes come from a random router (softmax top 8 of normal scores).

use super::{random, time, CliError};
use burn::tensor::{DType, Distribution, Tensor, TensorData};
use burn_gemma::GemmaBackend;
use burn_gemma_kernels::{
    experts::{gemm::GROUP_BYTES, route_reference, ExpertPath, Experts, Routes},
    ExpertProduct, HostMatrix, HostQuantized, QuantFormat, ReadBackError,
};

/// `(experts, top_k, hidden, expert width)` of 26B-A4B.
const SHAPE: (usize, usize, usize, usize) = (128, 8, 2816, 704);

/// `project_on` of the backend.
pub type Project<B> =
    fn(Tensor<B, 2>, &Experts<B>, &Routes<B>, ExpertProduct, DType, ExpertPath) -> Result<Tensor<B, 2>, ReadBackError>;

/// One table row per (weights, tokens, path): both products' milliseconds, and tokens per
/// second of the layer's experts.
pub fn section<B: GemmaBackend>(
    d: &B::Device,
    dtype: DType,
    reps: usize,
    rows: &[usize],
    project: Project<B>,
) -> Result<(), CliError> {
    let (count, top_k, hidden, width) = SHAPE;
    println!("26B-A4B experts layer: {count} experts, top {top_k}, hidden {hidden}, expert width {width}\n");
    println!("| experts | tokens | path | gate/up ms | down ms | layer tokens/s |");
    println!("|---|---:|---|---:|---:|---:|");
    for format in [None, Some(QuantFormat::Q8), Some(QuantFormat::Q4)] {
        let stack = |rows: usize, cols: usize| {
            // Drawn one expert at a time on the device (no single buffer of the whole stack in
            // f32, which some Vulkan drivers cannot allocate), gathered on the host.
            let mut values = Vec::with_capacity(count * rows * cols);
            for _ in 0..count {
                let expert = random::<B>(vec![rows * cols], DType::F32, d).mul_scalar(0.05).into_data();
                values.extend(expert.to_vec::<f32>().map_err(|e| format!("random weights: {e:?}"))?);
            }
            let host = match format {
                None => HostMatrix::Dense(
                    Tensor::<B, 1>::from_data(TensorData::new(values, [count * rows * cols]), d)
                        .reshape([count * rows, cols])
                        .cast(dtype),
                ),
                Some(q) => HostMatrix::Quantized(HostQuantized::quantize(&values, count * rows, cols, q)?),
            };
            Ok::<_, CliError>(B::upload_experts(host, count, d)?)
        };
        let gate_up = stack(2 * width, hidden)?;
        let down = stack(hidden, width)?;
        let name = format.map_or(format!("dense {dtype:?}"), |q| format!("{q:?}"));
        for &tokens in rows {
            let scores = Tensor::<B, 2>::random([tokens, count], Distribution::Normal(0.0, 1.0), d);
            let scale = Tensor::<B, 1>::ones([count], d);
            let routes = route_reference(scores, scale, top_k)?;
            let x = random::<B>(vec![tokens * hidden], dtype, d).reshape([tokens, hidden]);
            let h = random::<B>(vec![tokens * top_k * width], dtype, d).reshape([tokens * top_k, width]);
            let paths = [
                (Some(ExpertPath::Gemv), "gemv"),
                (Some(ExpertPath::Gemm { group_bytes: GROUP_BYTES }), "gemm"),
                (None, "project_experts (the backend's choice)"),
            ];
            for (path, label) in paths {
                let run = |x: &Tensor<B, 2>, w: &Experts<B>, product| match path {
                    Some(path) => project(x.clone(), w, &routes, product, dtype, path),
                    None => B::project_experts(x.clone(), w, &routes, product, dtype),
                };
                // A failed read-back ends the section here; the timed calls repeat these.
                run(&x, &gate_up, ExpertProduct::GeluHalves)?;
                run(&h, &down, ExpertProduct::WeightedSum)?;
                let up = time::<B, _>(d, reps, || run(&x, &gate_up, ExpertProduct::GeluHalves));
                let dn = time::<B, _>(d, reps, || run(&h, &down, ExpertProduct::WeightedSum));
                println!(
                    "| {name} | {tokens} | {label} | {:.3} | {:.3} | {:.0} |",
                    up * 1e3,
                    dn * 1e3,
                    tokens as f64 / (up + dn)
                );
            }
        }
    }
    Ok(())
}
