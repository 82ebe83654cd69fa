//! Complete characters out of a stream of token bytes.

/// Emits only complete UTF-8 characters from a stream of token bytes.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes and returns the text that is now complete.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_some() => {
                // Invalid bytes (not merely incomplete): emit them replaced.
                let text = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return text;
            }
            Err(e) => e.valid_up_to(),
        };
        let rest = self.pending.split_off(valid);
        String::from_utf8(std::mem::replace(&mut self.pending, rest)).unwrap_or_default()
    }

    /// Whatever is left, with incomplete characters replaced.
    pub fn finish(&mut self) -> String {
        let text = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        text
    }
}

#[cfg(test)]
mod tests {
    use super::Utf8Stream;

    #[test]
    fn utf8_stream_never_splits_characters() {
        let text = "日本の首都は東京です 👍";
        let bytes = text.as_bytes();
        for chunk in 1..5 {
            let mut s = Utf8Stream::default();
            let mut out = String::new();
            for piece in bytes.chunks(chunk) {
                let emitted = s.push(piece);
                assert!(std::str::from_utf8(emitted.as_bytes()).is_ok());
                out.push_str(&emitted);
            }
            out.push_str(&s.finish());
            assert_eq!(out, text);
        }
        let mut s = Utf8Stream::default();
        assert_eq!(s.push(&[0xE6]), "");
        assert_eq!(s.push(&[0x97]), "");
        assert_eq!(s.push(&[0xA5]), "日");
    }
}
