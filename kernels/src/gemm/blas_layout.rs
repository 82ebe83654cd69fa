//! A product `lhs [.., m, k] @ rhs [.., k, n] -> out [.., m, n]` described as the vendor BLASLt
//! libraries take it (cuBLASLt on CUDA, [`super::cublas`]; hipBLASLt on ROCm, [`super::hipblas`]):
//! column-major operands, one batch stride each. Both libraries share this host logic; only the
//! calls differ.

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;

/// One operand as a BLASLt library reads it (column-major).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Operand {
    pub rows: u64,
    pub cols: u64,
    pub ld: i64,
    pub transposed: bool,
    pub batch_stride: i64,
    pub align: u32,
}

/// A product's whole description: the key of a cached algorithm. Column-major:
/// `out^T [n, m] = rhs^T [n, k] @ lhs^T [k, m]`, so the library's A is `rhs`, B is `lhs`, D is
/// `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Problem {
    pub a: Operand,
    pub b: Operand,
    pub d: Operand,
    pub batch: i32,
    pub input: DType,
    pub output: DType,
}

/// `(rows, cols, ld, row_major)` of one operand's storage ([`storage`]) and its batch stride.
type Stored = ((u64, u64, i64, bool), i64);

/// The layouts of a product's operands, read from the tensors before their device pointers are
/// known ([`Layouts::problem`] adds those).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Layouts {
    lhs: Stored,
    rhs: Stored,
    out: Stored,
    batch: i32,
    input: DType,
    output: DType,
}

impl Layouts {
    /// `Ok(None)` for an empty product; `Err` names what the libraries do not take (f32 or mixed
    /// inputs, batch dimensions that do not collapse into one stride, an operand with neither
    /// unit stride, a column-major output).
    pub(crate) fn of<R: CubeRuntime>(
        lhs: &CubeTensor<R>,
        rhs: &CubeTensor<R>,
        out: &CubeTensor<R>,
    ) -> Result<Option<Self>, String> {
        let shape = lhs.meta.shape();
        let rank = shape.len();
        let (m, k, n) = (shape[rank - 2], shape[rank - 1], rhs.meta.shape()[rank - 1]);
        let batch: usize = shape[..rank - 2].iter().product();
        if m * n * k == 0 || batch == 0 {
            return Ok(None);
        }
        if rhs.dtype != lhs.dtype || !matches!(lhs.dtype, DType::BF16 | DType::F16) {
            return Err("bf16 or f16 inputs of one dtype only".into());
        }
        if !matches!(out.dtype, DType::BF16 | DType::F16 | DType::F32) {
            return Err(format!("dtypes {:?} -> {:?}", lhs.dtype, out.dtype));
        }
        let batch_of = |t: &CubeTensor<R>| {
            let rank = t.meta.shape().len();
            batch_stride(&t.meta.shape()[..rank - 2], &t.meta.strides()[..rank - 2])
        };
        let (Some(lhs_batch), Some(rhs_batch), Some(out_batch)) = (batch_of(lhs), batch_of(rhs), batch_of(out)) else {
            return Err("batch dimensions that do not collapse into one stride".into());
        };
        let (Some(ls), Some(rs), Some(os)) = (storage(lhs), storage(rhs), storage(out)) else {
            return Err("an operand with neither unit stride".into());
        };
        if !os.3 {
            return Err("a column-major output".into());
        }
        let batch = i32::try_from(batch).map_err(|_| "too many batches")?;
        Ok(Some(Self {
            lhs: (ls, lhs_batch),
            rhs: (rs, rhs_batch),
            out: (os, out_batch),
            batch,
            input: lhs.dtype,
            output: out.dtype,
        }))
    }

    /// The problem on these device pointers (their alignment is part of it).
    pub(crate) fn problem(&self, [lhs_ptr, rhs_ptr, out_ptr]: [u64; 3]) -> Problem {
        // Row-major `rhs` is already `rhs^T` column-major; a transposed view needs one.
        let operand = |((rows, cols, ld, row_major), stride): Stored, ptr: u64| Operand {
            rows,
            cols,
            ld,
            transposed: !row_major,
            batch_stride: stride,
            align: alignment(ptr),
        };
        Problem {
            a: operand(self.rhs, rhs_ptr),
            b: operand(self.lhs, lhs_ptr),
            d: operand(self.out, out_ptr),
            batch: self.batch,
            input: self.input,
            output: self.output,
        }
    }
}

/// The largest power of two (up to 256) dividing `ptr`: the alignment the library may assume.
pub(crate) fn alignment(ptr: u64) -> u32 {
    if ptr == 0 {
        return 256;
    }
    (1u64 << ptr.trailing_zeros().min(8)) as u32
}

/// The single stride of the batch dimensions (`0` for one batch), `None` where they do not
/// collapse into one.
fn batch_stride(shape: &[usize], strides: &[usize]) -> Option<i64> {
    let dims: Vec<(usize, usize)> = shape.iter().zip(strides).map(|(&n, &s)| (n, s)).filter(|&(n, _)| n > 1).collect();
    for pair in dims.windows(2) {
        if pair[0].1 != pair[1].1 * pair[1].0 {
            return None;
        }
    }
    Some(dims.last().map_or(0, |&(_, s)| s as i64))
}

/// `t` (`[.., r, c]`) as column-major storage: `(rows, cols, ld, transposed)` where
/// `transposed` means the stored column-major matrix is `t`'s transpose.
fn storage<R: CubeRuntime>(t: &CubeTensor<R>) -> Option<(u64, u64, i64, bool)> {
    let shape = t.meta.shape();
    let strides = t.meta.strides();
    let rank = shape.len();
    let (r, c) = (shape[rank - 2], shape[rank - 1]);
    let (sr, sc) = (strides[rank - 2], strides[rank - 1]);
    if sc == 1 && (sr >= c || r == 1) {
        // Row-major: its transpose is column-major `c x r` with leading dimension `sr`.
        Some((c as u64, r as u64, sr.max(c) as i64, true))
    } else if sr == 1 && (sc >= r || c == 1) {
        Some((r as u64, c as u64, sc.max(r) as i64, false))
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{alignment, batch_stride};

    #[test]
    fn batch_dims_and_alignment() {
        // [2, 3] heads over contiguous [m, k] blocks of 40: one stride; a gap between them: none.
        assert_eq!(batch_stride(&[2, 3], &[120, 40]), Some(40));
        assert_eq!(batch_stride(&[2, 3], &[150, 40]), None);
        assert_eq!(batch_stride(&[1, 1], &[40, 40]), Some(0));
        assert_eq!(alignment(0x1000), 256);
        assert_eq!(alignment(0x1002), 2);
    }
}
