//! A strict, memory-mapped GGUF reader (versions 2 and 3).
//!
//! Every count, string, array, dimension and offset is checked against the file before it is
//! used, so a damaged or hostile file yields a [`GgufError`] instead of a huge allocation or a
//! panic. Tensor data is dequantized through candle-core's GGML block decoders, on every core.

use crate::floats::{self, Float};
use burn::tensor::{DType, TensorData};
use burn_gemma_kernels::{
    quant::{ggml::product, QuantError},
    GgmlBlocks, HostQuantized, QuantFormat,
};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use memmap2::Mmap;
use std::{collections::HashMap, fs::File, path::Path};

/// What is wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("no tensor `{0}` in the file")]
    NoTensor(String),
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("bad magic {0:?}: not a GGUF file")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("file ends at byte {len} while reading {what} at byte {at}")]
    Truncated { what: &'static str, at: usize, len: usize },
    #[error("absurd {what} count {count} for a {len}-byte file")]
    AbsurdCount { what: &'static str, count: u64, len: usize },
    #[error("string of {len} bytes at byte {at} runs past the end of the file")]
    StringPastEnd { at: usize, len: u64 },
    #[error("array of {count} elements at byte {at} runs past the end of the file")]
    ArrayPastEnd { at: usize, count: u64 },
    #[error("string at byte {0} is not UTF-8")]
    BadUtf8(usize),
    #[error("unknown metadata value type {0}")]
    UnknownValueType(u32),
    #[error("metadata arrays nested deeper than {0} levels")]
    NestedTooDeep(usize),
    #[error("tensor `{name}` has {dims} dimensions (at most 4)")]
    TooManyDims { name: String, dims: u32 },
    #[error("tensor `{name}`: element count of shape {shape:?} overflows")]
    ElementOverflow { name: String, shape: Vec<u64> },
    #[error("tensor `{name}`: unknown tensor type {ty}")]
    UnknownType { name: String, ty: u32 },
    #[error("tensor `{name}`: tensor type {ty} is not supported (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K are)")]
    UnsupportedType { name: String, ty: String },
    #[error("tensor `{name}`: {elements} elements is not a whole number of {block}-element blocks")]
    PartialBlock { name: String, elements: u64, block: usize },
    #[error("general.alignment is {0}: must be a non-zero power of two")]
    BadAlignment(u64),
    #[error("tensor `{name}`: data {start}..{end} lies past the end of the file ({len} bytes)")]
    DataPastEnd { name: String, start: u64, end: u64, len: usize },
    #[error("tensor `{0}` appears twice")]
    DuplicateTensor(String),
    #[error("tensor `{name}`: offset {offset} is not a multiple of the alignment {alignment}")]
    Misaligned { name: String, offset: u64, alignment: u64 },
    #[error("tensor `{name}`: dequantization failed: {reason}")]
    Dequantize { name: String, reason: String },
    #[error("tensor `{name}`: {source}")]
    Quantize { name: String, source: QuantError },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            _ => self.as_u64().map(|v| v as f64),
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry, as validated when the file was opened (read-only: the file's methods
/// take tensors by name, so no entry can point them outside the file).
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// Dimensions in PyTorch order (outermost first), i.e. GGML's `ne` reversed.
    shape: Vec<usize>,
    dtype: GgmlDType,
    /// Absolute byte range in the file.
    start: usize,
    end: usize,
}

impl TensorInfo {
    /// Dimensions in PyTorch order (outermost first), i.e. GGML's `ne` reversed.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The stored type.
    pub fn dtype(&self) -> GgmlDType {
        self.dtype
    }

    /// Bytes of the stored data.
    pub fn byte_len(&self) -> usize {
        self.end - self.start
    }
}

/// An open, validated GGUF file.
pub struct GgufFile {
    mmap: Mmap,
    metadata: HashMap<String, Value>,
    tensors: HashMap<String, TensorInfo>,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

const MAX_NESTING: usize = 4;

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let bytes = &self.buf[self.pos..end];
                self.pos = end;
                Ok(bytes)
            }
            None => Err(GgufError::Truncated { what, at: self.pos, len: self.buf.len() }),
        }
    }
    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }
    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    fn string(&mut self) -> Result<String, GgufError> {
        let at = self.pos;
        let len = self.u64("string length")?;
        if len > self.remaining() as u64 {
            return Err(GgufError::StringPastEnd { at, len });
        }
        let bytes = self.take(len as usize, "string")?;
        String::from_utf8(bytes.to_vec()).map_err(|_| GgufError::BadUtf8(at))
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>("u8")?[0]),
            1 => Value::I8(self.array::<1>("i8")?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => Value::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => Value::U32(self.u32("u32")?),
            5 => Value::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => Value::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => Value::Bool(self.array::<1>("bool")?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(GgufError::NestedTooDeep(MAX_NESTING));
                }
                let at = self.pos;
                let item_ty = self.u32("array type")?;
                let count = self.u64("array length")?;
                let min_size = match item_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10..=12 => 8,
                    9 => 12,
                    other => return Err(GgufError::UnknownValueType(other)),
                };
                if count.checked_mul(min_size).is_none_or(|n| n > self.remaining() as u64) {
                    return Err(GgufError::ArrayPastEnd { at, count });
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(item_ty, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64("u64")?),
            11 => Value::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => Value::F64(f64::from_le_bytes(self.array("f64")?)),
            other => return Err(GgufError::UnknownValueType(other)),
        })
    }
}

/// GGML tensor type ids to candle's decoders; `Err` holds the name of a known type we cannot
/// decode.
fn ggml_type(ty: u32) -> Option<Result<GgmlDType, &'static str>> {
    Some(Ok(match ty {
        0 => GgmlDType::F32,
        1 => GgmlDType::F16,
        2 => GgmlDType::Q4_0,
        3 => GgmlDType::Q4_1,
        6 => GgmlDType::Q5_0,
        7 => GgmlDType::Q5_1,
        8 => GgmlDType::Q8_0,
        10 => GgmlDType::Q2K,
        11 => GgmlDType::Q3K,
        12 => GgmlDType::Q4K,
        13 => GgmlDType::Q5K,
        14 => GgmlDType::Q6K,
        30 => GgmlDType::BF16,
        9 => return Some(Err("Q8_1")),
        15 => return Some(Err("Q8_K")),
        16..=23 | 29 => return Some(Err("IQ (importance-matrix) types")),
        24..=28 => return Some(Err("integer types")),
        34..=36 => return Some(Err("TQ/MXFP4 types")),
        _ => return None,
    }))
}

impl GgufFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = File::open(path)?;
        // SAFETY: read-only mapping owned by the returned value; see `SafetensorsFile::open`.
        let mmap = unsafe { Mmap::map(&file)? };
        let (metadata, tensors) = parse(&mmap)?;
        Ok(Self { mmap, metadata, tensors })
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// Every metadata key and value.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.metadata
    }

    /// Every tensor's entry, by name.
    pub fn tensors(&self) -> &HashMap<String, TensorInfo> {
        &self.tensors
    }

    /// The entry of tensor `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensors.get(name).ok_or_else(|| GgufError::NoTensor(name.to_string()))
    }

    /// The stored bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> Result<&[u8], GgufError> {
        let info = self.tensor(name)?;
        // The range was checked against the file when it was opened.
        self.mmap.get(info.start..info.end).ok_or_else(|| GgufError::NoTensor(name.to_string()))
    }

    /// Dequantizes tensor `name` to f32, row-major in [`TensorInfo::shape`] order: float
    /// tensors converted on every core, block types rows in parallel (candle's block decoders,
    /// [`product::dequantize`]).
    pub fn dequantize(&self, name: &str) -> Result<Vec<f32>, GgufError> {
        let fail = |reason: String| GgufError::Dequantize { name: name.to_string(), reason };
        let info = self.tensor(name)?;
        let raw = self.bytes(name)?;
        if let Some(from) = float_type(info.dtype) {
            return Ok(floats::to_f32(raw, from));
        }
        // Rows of the innermost dimension; candle wants outermost-first dims like our shape.
        let cols = info.shape.last().copied().unwrap_or(1);
        let rows = info.shape.iter().product::<usize>() / cols.max(1);
        let q = qtensor_from_ggml(info.dtype, raw, vec![rows, cols], &candle_core::Device::Cpu)
            .map_err(|e| fail(e.to_string()))?;
        product::dequantize(&q).map_err(|e| fail(e.to_string()))
    }

    /// Tensor `name` in `dtype` (F32, F16 or BF16), row-major in [`TensorInfo::shape`] order:
    /// float tensors converted from the file's bytes in one pass on every core (a copy where the
    /// types agree), block types dequantized and converted.
    pub fn tensor_data(&self, name: &str, dtype: DType) -> Result<TensorData, GgufError> {
        let info = self.tensor(name)?;
        let shape = info.shape.clone();
        let to = Float::of(dtype).ok_or_else(|| GgufError::Dequantize {
            name: name.to_string(),
            reason: format!("{dtype:?} is not a float type (F32, F16 and BF16 are)"),
        })?;
        let bytes = match float_type(info.dtype) {
            Some(from) => floats::convert(self.bytes(name)?, from, to),
            None if to == Float::F32 => return Ok(TensorData::new(self.dequantize(name)?, shape)),
            None => floats::from_f32(&self.dequantize(name)?, to),
        };
        Ok(TensorData::from_bytes_vec(bytes, shape, dtype))
    }
}

/// The float types among GGUF's tensor types.
fn float_type(dtype: GgmlDType) -> Option<Float> {
    match dtype {
        GgmlDType::F32 => Some(Float::F32),
        GgmlDType::F16 => Some(Float::F16),
        GgmlDType::BF16 => Some(Float::Bf16),
        _ => None,
    }
}

impl GgufFile {
    /// A `[rows, cols]` tensor (or `[experts, rows, cols]`, as `experts * rows` rows) in the
    /// file's own block type, as stored (`Ok(None)` for float tensors).
    pub fn blocks(&self, name: &str) -> Result<Option<GgmlBlocks>, GgufError> {
        let info = self.tensor(name)?;
        if matches!(info.dtype, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16) {
            return Ok(None);
        }
        let (rows, cols) = matrix_shape(name, info)?;
        let raw = self.bytes(name)?.to_vec();
        GgmlBlocks::new(info.dtype, rows, cols, raw)
            .map(Some)
            .map_err(|source| GgufError::Quantize { name: name.to_string(), source })
    }

    /// A `[rows, cols]` tensor block-quantized to `format`: converted block by block where the
    /// file's type maps onto it (see [`GgmlBlocks::to_format`]), else dequantized and quantized.
    pub fn quantized(&self, name: &str, format: QuantFormat) -> Result<HostQuantized, GgufError> {
        let fail = |source| GgufError::Quantize { name: name.to_string(), source };
        match self.blocks(name)? {
            Some(blocks) => blocks.to_format(format).map_err(fail),
            None => {
                let (rows, cols) = matrix_shape(name, self.tensor(name)?)?;
                HostQuantized::quantize(&self.dequantize(name)?, rows, cols, format).map_err(fail)
            }
        }
    }
}

/// `(rows, cols)` of a matrix: a two-dimensional tensor, or a layer's experts (`[experts,
/// rows, cols]`) as one matrix of `experts * rows` rows.
fn matrix_shape(name: &str, info: &TensorInfo) -> Result<(usize, usize), GgufError> {
    match info.shape[..] {
        [rows, cols] => Ok((rows, cols)),
        [experts, rows, cols] => Ok((experts * rows, cols)),
        _ => Err(GgufError::Quantize {
            name: name.to_string(),
            source: QuantError::Length { rows: 0, cols: 0, len: info.shape.iter().product() },
        }),
    }
}

type Parsed = (HashMap<String, Value>, HashMap<String, TensorInfo>);

fn parse(buf: &[u8]) -> Result<Parsed, GgufError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = c.array("magic").map_err(|_| {
        let mut m = [0u8; 4];
        m[..buf.len().min(4)].copy_from_slice(&buf[..buf.len().min(4)]);
        GgufError::BadMagic(m)
    })?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic(magic));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let tensor_count = c.u64("tensor count")?;
    let kv_count = c.u64("metadata count")?;
    // A metadata entry needs at least 12 bytes (key length + type), a tensor entry at least 28.
    if kv_count > (buf.len() / 12) as u64 {
        return Err(GgufError::AbsurdCount { what: "metadata", count: kv_count, len: buf.len() });
    }
    if tensor_count > (buf.len() / 28) as u64 {
        return Err(GgufError::AbsurdCount { what: "tensor", count: tensor_count, len: buf.len() });
    }
    let mut metadata = HashMap::with_capacity(kv_count as usize);
    for _ in 0..kv_count {
        let key = c.string()?;
        let ty = c.u32("value type")?;
        let value = c.value(ty, 0)?;
        metadata.insert(key, value);
    }
    let alignment = match metadata.get("general.alignment") {
        Some(v) => v.as_u64().unwrap_or(0),
        None => 32,
    };
    if alignment == 0 || !alignment.is_power_of_two() {
        return Err(GgufError::BadAlignment(alignment));
    }
    let mut entries = Vec::with_capacity(tensor_count as usize);
    for _ in 0..tensor_count {
        let name = c.string()?;
        let dims = c.u32("dimension count")?;
        if dims > 4 {
            return Err(GgufError::TooManyDims { name, dims });
        }
        let mut ne = Vec::with_capacity(dims as usize);
        for _ in 0..dims {
            ne.push(c.u64("dimension")?);
        }
        let ty = c.u32("tensor type")?;
        let offset = c.u64("tensor offset")?;
        entries.push((name, ne, ty, offset));
    }
    let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
    let mut tensors = HashMap::with_capacity(entries.len());
    for (name, ne, ty, offset) in entries {
        let dtype = match ggml_type(ty) {
            None => return Err(GgufError::UnknownType { name, ty }),
            Some(Err(known)) => return Err(GgufError::UnsupportedType { name, ty: known.to_string() }),
            Some(Ok(d)) => d,
        };
        let elements = ne.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
        let Some(elements) = elements.filter(|&e| e <= usize::MAX as u64 / 4) else {
            return Err(GgufError::ElementOverflow { name, shape: ne });
        };
        let block = dtype.block_size();
        if ne.first().is_some_and(|&inner| inner % block as u64 != 0) || elements % block as u64 != 0 {
            return Err(GgufError::PartialBlock { name, elements, block });
        }
        if offset % alignment != 0 {
            return Err(GgufError::Misaligned { name, offset, alignment });
        }
        let bytes = elements / block as u64 * dtype.type_size() as u64;
        let start = data_start.checked_add(offset);
        let end = start.and_then(|s| s.checked_add(bytes));
        let (Some(start), Some(end)) = (start, end.filter(|&e| e <= buf.len() as u64)) else {
            return Err(GgufError::DataPastEnd {
                name,
                start: data_start.saturating_add(offset),
                end: end.unwrap_or(u64::MAX),
                len: buf.len(),
            });
        };
        let shape = ne.iter().rev().map(|&d| d as usize).collect();
        if tensors.contains_key(&name) {
            return Err(GgufError::DuplicateTensor(name));
        }
        tensors.insert(name, TensorInfo { shape, dtype, start: start as usize, end: end as usize });
    }
    Ok((metadata, tensors))
}
