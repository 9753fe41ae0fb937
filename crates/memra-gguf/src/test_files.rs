//! Where tests find the shared reference files and the real models.
//!
//! Not part of the format code: a small helper so every crate's tests locate
//! `../shared` (the golden outputs and tiny models) and the model cache the same way.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("workspace root exists")
}

/// The shared folder beside the checkout: `$MEMRA_SHARED`, else `<workspace>/../shared`.
pub fn shared_dir() -> PathBuf {
    match std::env::var_os("MEMRA_SHARED") {
        Some(p) => PathBuf::from(p),
        None => workspace_root().join("../shared"),
    }
}

/// A tiny model from `shared/golden/tiny`.
pub fn tiny_model(name: &str) -> PathBuf {
    shared_dir().join("golden/tiny").join(name)
}

/// The model cache: `$MEMRA_MODELS`, else `~/.cache/memra/models`.
pub fn models_dir() -> PathBuf {
    match std::env::var_os("MEMRA_MODELS") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/memra/models"),
    }
}

/// A real model from the cache, fetched with `scripts/fetch-models.sh` when missing.
/// Panics with the script's message when it cannot be had.
pub fn real_model(name: &str) -> PathBuf {
    let path = models_dir().join(name);
    if !path.is_file() {
        let script = workspace_root().join("scripts/fetch-models.sh");
        let status = Command::new("bash")
            .arg(&script)
            .arg(name)
            .status()
            .expect("run scripts/fetch-models.sh");
        assert!(status.success(), "scripts/fetch-models.sh {name} failed");
    }
    path
}
