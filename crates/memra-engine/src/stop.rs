//! Stop strings over streamed text: generation ends before the first stop string, which
//! is never shown, and text that may be the start of one is held back until it is not.

pub struct StopFilter {
    stops: Vec<String>,
    held: String,
    /// The stop string reached, once one is.
    matched: Option<usize>,
}

impl StopFilter {
    pub fn new(stops: Vec<String>) -> StopFilter {
        StopFilter {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// Adds text; returns what can be shown and whether a stop string was reached.
    pub fn push(&mut self, text: &str) -> (String, bool) {
        self.held.push_str(text);
        if let Some((at, i)) = self
            .stops
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((self.held.find(s.as_str())?, i)))
            .min()
        {
            let out = self.held[..at].to_string();
            self.held.clear();
            self.matched = Some(i);
            return (out, true);
        }
        // Keep the longest suffix that is a prefix of a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| {
                (1..s.len().min(self.held.len() + 1))
                    .rev()
                    .map(move |n| (s, n))
            })
            .filter(|(s, n)| s.is_char_boundary(*n) && self.held.ends_with(&s[..*n]))
            .map(|(_, n)| n)
            .max()
            .unwrap_or(0);
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        (out, false)
    }

    /// The stop string that ended the text, if one did (the first in the text; of two
    /// starting at the same place, the first given).
    pub fn matched(&self) -> Option<&str> {
        self.matched.map(|i| self.stops[i].as_str())
    }

    /// The text held back (generation ended without a stop string).
    pub fn take_held(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_filter_holds_back_possible_stop_prefixes() {
        let stops = vec!["</s>".to_string(), "\n\n".to_string()];
        let mut f = StopFilter::new(stops.clone());
        assert_eq!(f.push("Hello <"), ("Hello ".to_string(), false));
        assert_eq!(f.push("/"), (String::new(), false));
        assert_eq!(f.push("x>"), ("</x>".to_string(), false));
        assert_eq!(f.push("a\n"), ("a".to_string(), false));
        assert_eq!(f.push("\nmore"), (String::new(), true));
        assert_eq!(f.matched(), Some("\n\n"));
        let mut f = StopFilter::new(stops);
        assert_eq!(f.push("ab\n\nc</s>cd"), ("ab".to_string(), true));
        assert_eq!(f.matched(), Some("\n\n"), "the first in the text");
        let mut f = StopFilter::new(vec!["XYZ".into()]);
        assert_eq!(f.push("aXY"), ("a".to_string(), false));
        assert_eq!((f.take_held().as_str(), f.matched()), ("XY", None));
    }
}
