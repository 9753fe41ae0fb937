//! Helpers shared by the engine's integration tests.

use std::path::PathBuf;

use memra_gguf::test_files::{real_model, shared_dir, tiny_model};
use serde_json::Value as Json;

/// A model of the golden records by name: tiny ones from `shared/golden/tiny`, real ones
/// from the model cache (fetched when missing).
pub fn model_path(name: &str) -> PathBuf {
    if name.starts_with("tiny-") {
        tiny_model(&format!("{name}.gguf"))
    } else {
        real_model(&format!("{name}.gguf"))
    }
}

/// A JSON array of `shared/golden`.
#[allow(dead_code)] // not every test binary reads golden records
pub fn golden(file: &str) -> Vec<Json> {
    let text = std::fs::read_to_string(shared_dir().join("golden").join(file)).unwrap();
    serde_json::from_str::<Json>(&text)
        .unwrap()
        .as_array()
        .unwrap()
        .clone()
}
