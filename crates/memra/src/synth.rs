//! `memra synth`: write a random-weight model of a benchmark shape.

use std::path::Path;
use std::time::Instant;

use anyhow::{bail, Result};
use indicatif::{ProgressBar, ProgressStyle};
use memra_engine::synth::{self, QuantMix, SHAPES};

use crate::inspect::human_bytes;

pub fn run(shape_name: &str, quant: &str, out: &Path, seed: u64) -> Result<()> {
    let Some(shape) = synth::shape(shape_name) else {
        let names: Vec<&str> = SHAPES.iter().map(|s| s.name).collect();
        bail!("unknown shape {shape_name:?} (known: {})", names.join(", "));
    };
    let Some(mix) = QuantMix::from_name(quant) else {
        bail!(
            "unknown quant mix {quant:?} (known: {})",
            QuantMix::NAMES.join(", ")
        );
    };
    let start = Instant::now();
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template(
            "{msg} [{bar:40}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("synth {} {}", shape.name, mix.name()));
    let layout = synth::write_model(out, shape, mix, seed, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })?;
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} ({} bytes, {}) in {secs:.1} s, {}/s",
        out.display(),
        layout.file_size,
        human_bytes(layout.file_size),
        human_bytes((layout.file_size as f64 / secs) as u64),
    );
    Ok(())
}
