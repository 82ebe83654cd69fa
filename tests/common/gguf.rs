//! A GGUF (version 3) writer for tests: metadata and f32 tensors.

/// GGUF metadata values the tests write.
pub enum Meta {
    U32(u32),
    F32(f32),
    Str(String),
    U32s(Vec<u32>),
    Bools(Vec<bool>),
    I32s(Vec<i32>),
    Strs(Vec<String>),
}

/// A GGUF version 3 file of f32 tensors.
#[derive(Default)]
pub struct GgufWriter {
    meta: Vec<(String, Meta)>,
    tensors: Vec<(String, Vec<usize>, Vec<f32>)>,
}

impl GgufWriter {
    pub fn meta(&mut self, key: &str, value: Meta) {
        self.meta.push((key.to_string(), value));
    }

    /// `shape` outermost first (PyTorch order), as the loader reports it.
    pub fn tensor(&mut self, name: &str, shape: Vec<usize>, values: Vec<f32>) {
        assert_eq!(shape.iter().product::<usize>(), values.len(), "{name}");
        self.tensors.push((name.to_string(), shape, values));
    }

    pub fn bytes(&self) -> Vec<u8> {
        const ALIGNMENT: usize = 32;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.meta.len() as u64).to_le_bytes());
        let string = |out: &mut Vec<u8>, s: &str| {
            out.extend((s.len() as u64).to_le_bytes());
            out.extend(s.as_bytes());
        };
        // An array's value type (GGUF 9), then its elements' type and count.
        let array_header = |out: &mut Vec<u8>, element: u32, len: usize| {
            out.extend(9u32.to_le_bytes());
            out.extend(element.to_le_bytes());
            out.extend((len as u64).to_le_bytes());
        };
        for (key, value) in &self.meta {
            string(&mut out, key);
            match value {
                Meta::U32(v) => {
                    out.extend(4u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::F32(v) => {
                    out.extend(6u32.to_le_bytes());
                    out.extend(v.to_le_bytes());
                }
                Meta::Str(s) => {
                    out.extend(8u32.to_le_bytes());
                    string(&mut out, s);
                }
                Meta::U32s(items) => {
                    array_header(&mut out, 4, items.len());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
                Meta::Bools(items) => {
                    array_header(&mut out, 7, items.len());
                    items.iter().for_each(|&b| out.push(u8::from(b)));
                }
                Meta::I32s(items) => {
                    array_header(&mut out, 5, items.len());
                    items.iter().for_each(|v| out.extend(v.to_le_bytes()));
                }
                Meta::Strs(items) => {
                    array_header(&mut out, 8, items.len());
                    items.iter().for_each(|s| string(&mut out, s));
                }
            }
        }
        let mut offset = 0usize;
        let mut data = Vec::new();
        for (name, shape, values) in &self.tensors {
            string(&mut out, name);
            out.extend((shape.len() as u32).to_le_bytes());
            // GGML lists dims innermost first.
            shape.iter().rev().for_each(|&d| out.extend((d as u64).to_le_bytes()));
            out.extend(0u32.to_le_bytes()); // F32
            out.extend((offset as u64).to_le_bytes());
            values.iter().for_each(|v| data.extend(v.to_le_bytes()));
            data.resize(data.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
            offset = data.len();
        }
        out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
        out.extend(data);
        out
    }
}
