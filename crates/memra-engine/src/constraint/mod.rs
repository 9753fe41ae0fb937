//! Constrained decoding (structured outputs): a sequence may carry a [`Constraint`], a
//! grammar (a JSON schema, any JSON object, a Lark or GBNF grammar) compiled by
//! llguidance over the model's vocabulary. Each step, the engine asks every constrained
//! sequence for the mask of tokens the grammar allows next (in parallel, on the CPU), the
//! runner picks the token among those only (on the host, or on the GPU from an uploaded
//! bitmask), and the constraint takes the token. End-of-generation tokens are allowed only
//! where the grammar may end; the sequence ends when the grammar can take nothing more.

mod gbnf;
mod vocab;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use toktrie::TokEnv;

use crate::tokenizer::Tokenizer;

/// Largest grammar or schema text we compile: a bound on what one request costs to
/// compile besides llguidance's own fuel limits (a schema of this size compiles in well
/// under a second).
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// What a sequence's output must match.
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON matching a JSON schema (an object).
    JsonSchema(Value),
    /// llguidance's Lark dialect (which can embed `%json {schema}`).
    Lark(String),
    /// llama.cpp's GBNF, translated to Lark.
    Gbnf(String),
}

/// Why a grammar cannot be used; the message names the problem for the client.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GrammarError {
    #[error("the grammar is {0} bytes; at most {MAX_GRAMMAR_BYTES} are accepted")]
    TooLarge(usize),
    #[error("the JSON schema must be an object (got {0})")]
    NotAnObject(&'static str),
    #[error("{0}")]
    Invalid(String),
    #[error("the grammar allows no output at all")]
    Empty,
}

/// JSON as `json.dumps` writes it, one space after `:` and `,` and nowhere else: what
/// models write when they write JSON, and no unbounded runs of whitespace for a model to
/// get lost in.
fn json_options() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// The schema with our JSON formatting options, unless it sets llguidance's own.
pub fn with_json_options(mut schema: Value) -> Result<Value, GrammarError> {
    let kind = match &schema {
        Value::Object(_) => None,
        Value::Bool(_) => Some("a boolean"),
        Value::Array(_) => Some("an array"),
        Value::String(_) => Some("a string"),
        Value::Number(_) => Some("a number"),
        Value::Null => Some("null"),
    };
    if let Some(k) = kind {
        return Err(GrammarError::NotAnObject(k));
    }
    let map = schema.as_object_mut().expect("checked above");
    map.entry("x-guidance").or_insert_with(json_options);
    Ok(schema)
}

impl Grammar {
    fn to_llguidance(&self) -> Result<TopLevelGrammar, GrammarError> {
        let size = match self {
            Grammar::JsonObject => 0,
            Grammar::JsonSchema(v) => v.to_string().len(),
            Grammar::Lark(s) | Grammar::Gbnf(s) => s.len(),
        };
        if size > MAX_GRAMMAR_BYTES {
            return Err(GrammarError::TooLarge(size));
        }
        Ok(match self {
            Grammar::JsonObject => {
                TopLevelGrammar::from_json_schema(with_json_options(json!({"type": "object"}))?)
            }
            Grammar::JsonSchema(v) => {
                TopLevelGrammar::from_json_schema(with_json_options(v.clone())?)
            }
            Grammar::Lark(s) => TopLevelGrammar::from_lark(s.clone()),
            Grammar::Gbnf(s) => {
                TopLevelGrammar::from_lark(gbnf::to_lark(s).map_err(GrammarError::Invalid)?)
            }
        })
    }
}

/// The grammar compiler of one model: the vocabulary's trie and llguidance's factory,
/// built once (a few hundred milliseconds for a vocabulary of 150,000 tokens) and shared
/// by every request.
pub struct Grammars {
    factory: ParserFactory,
    n_vocab: usize,
}

impl Grammars {
    pub fn new(tok: &Tokenizer) -> Result<Grammars, GrammarError> {
        let env: TokEnv = vocab::token_env(tok);
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        factory.quiet();
        // Errors name the grammar's problem, not the parser's state and the whole grammar.
        *factory.limits_mut() = ParserLimits {
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Grammars {
            factory,
            n_vocab: tok.n_vocab(),
        })
    }

    /// Compiles `g` for one sequence, within llguidance's fuel limits (which bound the
    /// time a hostile grammar can take), and checks that it allows some output.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, GrammarError> {
        let top = g.to_llguidance()?;
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let mut c = Constraint {
            matcher: Matcher::new(Ok(parser)),
            n_vocab: self.n_vocab,
        };
        let mask = c.mask().map_err(GrammarError::Invalid)?;
        if mask.iter().all(|&w| w == 0) {
            return Err(GrammarError::Empty);
        }
        Ok(c)
    }
}

/// One sequence's grammar state. Cloning gives an independent copy (each choice of a
/// request gets its own).
pub struct Constraint {
    matcher: Matcher,
    n_vocab: usize,
}

impl Clone for Constraint {
    fn clone(&self) -> Constraint {
        Constraint {
            // Its own lexer caches too: clones run on different threads.
            matcher: self.matcher.deep_clone(),
            n_vocab: self.n_vocab,
        }
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

impl Constraint {
    /// The tokens allowed next, as a bitmask over the vocabulary: bit `t % 32` of word
    /// `t / 32` is set when token `t` is allowed. Only end-of-generation tokens once the
    /// grammar is complete.
    pub fn mask(&mut self) -> Result<Vec<u32>, String> {
        let v = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| e.to_string())?;
        let mut words = v.as_slice().to_vec();
        words.resize(self.n_vocab.div_ceil(32), 0);
        Ok(words)
    }

    /// Advances the grammar by the token picked.
    pub fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }

    /// Whether the grammar can take nothing more (the sequence is complete).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// A constrained row's mask, computed on another thread while the step runs: the runner
/// waits for it when it picks the row's token.
#[derive(Debug, Default)]
pub struct MaskSlot(std::sync::OnceLock<Result<Vec<u32>, String>>);

impl MaskSlot {
    /// Fills the slot (once; later calls are ignored).
    pub fn set(&self, mask: Result<Vec<u32>, String>) {
        let _ = self.0.set(mask);
    }

    /// Waits for the mask; `None` when it could not be computed (the runner then returns
    /// the row's logits and the engine ends the sequence with the error).
    pub fn wait(&self) -> Option<&[u32]> {
        self.0.wait().as_ref().ok().map(Vec::as_slice)
    }

    /// The mask or the error, once set (an unset slot reads as an error).
    pub fn result(&self) -> Result<&[u32], &str> {
        match self.0.get() {
            Some(Ok(m)) => Ok(m),
            Some(Err(e)) => Err(e),
            None => Err("the mask was not computed"),
        }
    }
}

/// Whether `mask` allows token `t` (tokens past its end are not allowed).
pub fn allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// Sets every logit the mask does not allow to minus infinity.
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (i, v) in logits.iter_mut().enumerate() {
        if !allows(mask, i) {
            *v = f32::NEG_INFINITY;
        }
    }
}

#[cfg(test)]
mod tests;
