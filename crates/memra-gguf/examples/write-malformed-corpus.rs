//! Writes the reader tests' malformed-file corpus (and the valid base file) to a folder,
//! as fuzzing seeds: `cargo run -p memra-gguf --example write-malformed-corpus -- DIR`.

use memra_gguf::test_files::{malformed_corpus, valid_small_file};

fn main() -> std::io::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .expect("usage: write-malformed-corpus DIR");
    std::fs::create_dir_all(&dir)?;
    std::fs::write(format!("{dir}/valid-small"), valid_small_file())?;
    for (i, case) in malformed_corpus(16).iter().enumerate() {
        std::fs::write(format!("{dir}/malformed-{i:03}"), &case.bytes)?;
    }
    Ok(())
}
