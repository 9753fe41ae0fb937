//! Streaming detokenization: tokens arrive one at a time, text leaves as soon as it is
//! whole. A token can end inside a UTF-8 character (byte-fallback tokens, byte-level BPE
//! pieces of an emoji), so bytes wait until they complete a character; bytes that can
//! never become one are written as U+FFFD, one per bad sequence, like `from_utf8_lossy`.

use super::{Tokenizer, TokenizerError};

pub struct IncrementalDecoder<'t> {
    tokenizer: &'t Tokenizer,
    special: bool,
    pending: Vec<u8>,
    /// Whether a token with text has been seen (the first one may lose its space prefix).
    seen_text: bool,
}

impl<'t> IncrementalDecoder<'t> {
    pub fn new(tokenizer: &'t Tokenizer, special: bool) -> IncrementalDecoder<'t> {
        IncrementalDecoder {
            tokenizer,
            special,
            pending: Vec::new(),
            seen_text: false,
        }
    }

    /// Adds a token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let piece = self.tokenizer.token_bytes(id, self.special)?;
        if piece.is_empty() {
            return Ok(String::new());
        }
        let skip =
            usize::from(!self.seen_text && self.tokenizer.strips_first_space() && piece[0] == b' ');
        self.seen_text = true;
        self.pending.extend_from_slice(&piece[skip..]);
        Ok(self.take_complete())
    }

    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[..good]).expect("valid prefix"));
                    match e.error_len() {
                        // Incomplete character at the end: wait for more bytes.
                        None => {
                            self.pending.drain(..good);
                            break;
                        }
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..good + bad);
                        }
                    }
                }
            }
        }
        out
    }

    /// Ends the stream: whatever is still pending is written, incomplete bytes as U+FFFD.
    pub fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}
