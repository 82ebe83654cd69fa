//! Stop strings over streamed text: what can be sent now, and where generation ends.

/// Text held back while it could still begin a stop string.
#[derive(Debug, Clone, Default)]
pub struct StopText {
    stops: Vec<String>,
    held: String,
}

/// What [`StopText::push`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// Text to send now.
    pub text: String,
    /// The index of the stop string reached, if one was (it and everything after it are
    /// dropped); the earliest in the text where several are.
    pub stopped: Option<usize>,
}

impl StopText {
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops, held: String::new() }
    }

    /// Takes the next piece of generated text.
    pub fn push(&mut self, text: &str) -> Pushed {
        self.held.push_str(text);
        let first = self.stops.iter().enumerate().filter_map(|(i, s)| Some((self.held.find(s.as_str())?, i))).min();
        if let Some((at, index)) = first {
            let text = self.held[..at].to_string();
            self.held.clear();
            return Pushed { text, stopped: Some(index) };
        }
        // Keep the longest tail that is the start of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(i, _)| &s[..i]))
            .filter(|prefix| self.held.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let text = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        Pushed { text, stopped: None }
    }

    /// What is still held when generation ends without a stop string.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pushes `pieces` and returns everything sent and whether it stopped.
    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopText::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            let pushed = s.push(p);
            out.push_str(&pushed.text);
            if pushed.stopped.is_some() {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stops_across_pieces_and_holds_only_what_could_start_one() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run(&["END"], &["abc E", "x"]), ("abc Ex".into(), false));
        assert_eq!(run(&["\n\n", "Q:"], &["one\n", "two Q", ":"]), ("one\ntwo ".into(), true));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        // The earliest stop wins.
        assert_eq!(run(&["c", "ab"], &["xabc"]), ("x".into(), true));
        // Held text is sent as soon as it cannot start a stop string.
        let mut s = StopText::new(vec!["STOP".into()]);
        assert_eq!(s.push("aST").text, "a");
        assert_eq!(s.push("x").text, "STx");
    }
}
