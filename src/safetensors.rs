//! A strict, memory-mapped reader for the safetensors format.
//!
//! The header is validated in full before any tensor is read: size limits, JSON shape, known
//! dtypes, byte sizes against shapes, bounds and overlaps, duplicate names.

use memmap2::Mmap;
use serde::de::{Deserializer, MapAccess, Visitor};
use std::{collections::HashMap, fmt, fs::File, path::Path};

/// Largest header accepted (the format's reference reader uses the same bound).
const MAX_HEADER: u64 = 100 * 1024 * 1024;

/// What is wrong with a safetensors file.
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("file is {0} bytes, too small for the 8-byte header length")]
    HeaderTooSmall(u64),
    #[error("header length {0} exceeds the limit of {MAX_HEADER} bytes")]
    HeaderTooLarge(u64),
    #[error("header length {header} runs past the end of the {file}-byte file")]
    HeaderPastEnd { header: u64, file: u64 },
    #[error("header is not valid JSON: {0}")]
    HeaderNotJson(String),
    #[error("tensor `{name}`: {reason}")]
    BadEntry { name: String, reason: String },
    #[error("tensor `{0}` appears twice in the header")]
    Duplicate(String),
    #[error("tensor `{name}`: unknown dtype {dtype:?}")]
    UnknownDtype { name: String, dtype: String },
    #[error("tensor `{name}`: {bytes} bytes for shape {shape:?} of {dtype}, which needs {expected}")]
    SizeMismatch { name: String, bytes: usize, shape: Vec<usize>, dtype: String, expected: String },
    #[error("tensor `{name}`: data offsets {start}..{end} run past the {len}-byte data section (file truncated?)")]
    OutOfBounds { name: String, start: usize, end: usize, len: usize },
    #[error("tensors `{first}` and `{second}` overlap in the data section")]
    Overlap { first: String, second: String },
}

/// Element types of safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    Bool,
    F8E4M3,
    F8E5M2,
}

impl Dtype {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F64" => Self::F64,
            "F32" => Self::F32,
            "F16" => Self::F16,
            "BF16" => Self::BF16,
            "I64" => Self::I64,
            "I32" => Self::I32,
            "I16" => Self::I16,
            "I8" => Self::I8,
            "U64" => Self::U64,
            "U32" => Self::U32,
            "U16" => Self::U16,
            "U8" => Self::U8,
            "BOOL" => Self::Bool,
            "F8_E4M3" => Self::F8E4M3,
            "F8_E5M2" => Self::F8E5M2,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Self::F64 | Self::I64 | Self::U64 => 8,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::I8 | Self::U8 | Self::Bool | Self::F8E4M3 | Self::F8E5M2 => 1,
        }
    }
}

/// One tensor's entry in the header, as validated when the file was opened (read-only: the
/// file's methods take tensors by name, so no entry can point them outside the file).
#[derive(Debug, Clone)]
pub struct TensorInfo {
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range within the data section.
    start: usize,
    end: usize,
}

impl TensorInfo {
    /// The stored dtype.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Dimensions, outermost first.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

/// An open, validated safetensors file.
pub struct SafetensorsFile {
    mmap: Mmap,
    data_start: usize,
    tensors: HashMap<String, TensorInfo>,
}

/// Header entries in file order, duplicates kept (serde_json's maps would drop them).
struct Entries(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Entries {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EntriesVisitor;
        impl<'de> Visitor<'de> for EntriesVisitor {
            type Value = Entries;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries, A::Error> {
                let mut entries = Vec::new();
                while let Some(entry) = map.next_entry::<String, serde_json::Value>()? {
                    entries.push(entry);
                }
                Ok(Entries(entries))
            }
        }
        deserializer.deserialize_map(EntriesVisitor)
    }
}

impl SafetensorsFile {
    /// Maps and validates `path`.
    pub fn open(path: &Path) -> Result<Self, SafetensorsError> {
        let file = File::open(path)?;
        // SAFETY: the file is opened read-only and we never hand out references that outlive
        // `self`; as with every memory-mapped reader, concurrent truncation by another process is
        // outside what we can guard against.
        let mmap = unsafe { Mmap::map(&file)? };
        Self::parse(mmap)
    }

    fn parse(mmap: Mmap) -> Result<Self, SafetensorsError> {
        let file_len = mmap.len() as u64;
        if file_len < 8 {
            return Err(SafetensorsError::HeaderTooSmall(file_len));
        }
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(&mmap[..8]);
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > MAX_HEADER {
            return Err(SafetensorsError::HeaderTooLarge(header_len));
        }
        if header_len > file_len - 8 {
            return Err(SafetensorsError::HeaderPastEnd { header: header_len, file: file_len });
        }
        let data_start = 8 + header_len as usize;
        let entries: Entries =
            serde_json::from_slice(&mmap[8..data_start]).map_err(|e| SafetensorsError::HeaderNotJson(e.to_string()))?;
        let data_len = mmap.len() - data_start;
        let tensors = validate_entries(entries.0, data_len)?;
        Ok(Self { mmap, data_start, tensors })
    }

    /// Tensor names and entries.
    pub fn tensors(&self) -> &HashMap<String, TensorInfo> {
        &self.tensors
    }

    /// The raw little-endian bytes of tensor `name` (`None` where the file has no such tensor).
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let info = self.tensors.get(name)?;
        // The range was checked against the data section when the file was opened.
        self.mmap.get(self.data_start + info.start..self.data_start + info.end)
    }
}

fn validate_entries(
    entries: Vec<(String, serde_json::Value)>,
    data_len: usize,
) -> Result<HashMap<String, TensorInfo>, SafetensorsError> {
    let mut tensors = HashMap::with_capacity(entries.len());
    for (name, value) in entries {
        if name == "__metadata__" {
            continue;
        }
        let bad = |reason: &str| SafetensorsError::BadEntry { name: name.clone(), reason: reason.to_string() };
        let obj = value.as_object().ok_or_else(|| bad("entry is not an object"))?;
        let dtype_name = obj.get("dtype").and_then(|d| d.as_str()).ok_or_else(|| bad("missing string `dtype`"))?;
        let dtype = Dtype::parse(dtype_name)
            .ok_or_else(|| SafetensorsError::UnknownDtype { name: name.clone(), dtype: dtype_name.to_string() })?;
        let shape = obj
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| bad("missing array `shape`"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| bad("`shape` must hold non-negative integers"))?;
        let offsets = obj
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .filter(|a| a.len() == 2)
            .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
            .ok_or_else(|| bad("`data_offsets` must be two non-negative integers"))?;
        let (start, end) = (offsets.0 as usize, offsets.1 as usize);
        if end < start {
            return Err(bad("data_offsets end before they start"));
        }
        if end > data_len {
            return Err(SafetensorsError::OutOfBounds { name, start, end, len: data_len });
        }
        let expected = shape.iter().try_fold(dtype.size(), |acc, &d| acc.checked_mul(d));
        if expected != Some(end - start) {
            return Err(SafetensorsError::SizeMismatch {
                name,
                bytes: end - start,
                shape,
                dtype: dtype_name.to_string(),
                expected: expected.map_or("more bytes than fit in memory".to_string(), |e| format!("{e} bytes")),
            });
        }
        if tensors.contains_key(&name) {
            return Err(SafetensorsError::Duplicate(name));
        }
        tensors.insert(name, TensorInfo { dtype, shape, start, end });
    }
    let mut ranges: Vec<(&String, &TensorInfo)> = tensors.iter().filter(|(_, t)| t.end > t.start).collect();
    ranges.sort_by_key(|(_, t)| t.start);
    for pair in ranges.windows(2) {
        if pair[1].1.start < pair[0].1.end {
            return Err(SafetensorsError::Overlap { first: pair[0].0.clone(), second: pair[1].0.clone() });
        }
    }
    Ok(tensors)
}
