//! `memra inspect MODEL`: what a GGUF file holds, from its header alone.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::Result;
use memra_gguf::{GgmlType, GgufFile, Metadata, Value};

/// Hyperparameters worth a line, as `{arch}.` key suffixes with their labels.
const HYPERPARAMETERS: [(&str, &str); 16] = [
    ("context length", "context_length"),
    ("embedding", "embedding_length"),
    ("layers", "block_count"),
    ("ffn width", "feed_forward_length"),
    ("heads", "attention.head_count"),
    ("kv heads", "attention.head_count_kv"),
    ("head dim (k)", "attention.key_length"),
    ("head dim (v)", "attention.value_length"),
    ("rope dims", "rope.dimension_count"),
    ("rope base", "rope.freq_base"),
    ("rms eps", "attention.layer_norm_rms_epsilon"),
    ("sliding window", "attention.sliding_window"),
    ("experts", "expert_count"),
    ("experts used", "expert_used_count"),
    ("expert ffn", "expert_feed_forward_length"),
    ("vocab size", "vocab_size"),
];

pub fn run(path: &Path, all: bool) -> Result<()> {
    let f = GgufFile::open(path)?;
    let m = &f.metadata;
    let arch = m.get_str("general.architecture")?.unwrap_or("(not set)");
    let row = |label: &str, value: String| println!("{label:<16}{value}");
    row(
        "file",
        format!(
            "{} ({} bytes, {})",
            path.display(),
            group(f.file_size()),
            human_bytes(f.file_size())
        ),
    );
    row(
        "format",
        format!(
            "GGUF v{}, {} metadata keys, {} tensors, alignment {}",
            f.version,
            m.len(),
            f.tensors.len(),
            f.alignment
        ),
    );
    row("architecture", arch.to_string());
    if let Some(name) = m.get_str("general.name")? {
        row("name", name.to_string());
    }
    let params: u64 = f.tensors.iter().map(|t| t.n_elements()).sum();
    row(
        "parameters",
        format!("{} ({})", group(params), human_count(params)),
    );
    for (label, suffix) in HYPERPARAMETERS {
        if let Some(v) = m.get(&format!("{arch}.{suffix}")) {
            row(label, v.to_string());
        }
    }
    row("tokenizer", tokenizer_summary(m)?);
    if let Some(t) = m.get_str("tokenizer.chat_template")? {
        row("chat template", format!("{} bytes", t.len()));
    }

    println!();
    println!(
        "{:<10}{:>8}{:>16}{:>18}{:>8}",
        "type", "tensors", "elements", "bytes", "share"
    );
    let mut by_type: BTreeMap<GgmlType, (u64, u64, u64)> = BTreeMap::new();
    for t in &f.tensors {
        let e = by_type.entry(t.ty).or_default();
        *e = (e.0 + 1, e.1 + t.n_elements(), e.2 + t.size);
    }
    let total_bytes: u64 = by_type.values().map(|v| v.2).sum();
    let mut rows: Vec<_> = by_type.into_iter().collect();
    rows.sort_by_key(|(_, (_, _, bytes))| std::cmp::Reverse(*bytes));
    for (ty, (n, elems, bytes)) in rows {
        let share = 100.0 * bytes as f64 / total_bytes.max(1) as f64;
        println!(
            "{:<10}{n:>8}{:>16}{:>18}{share:>7.1}%",
            ty.name(),
            group(elems),
            group(bytes)
        );
    }
    println!(
        "{:<10}{:>8}{:>16}{:>18}",
        "total",
        f.tensors.len(),
        group(params),
        group(total_bytes)
    );

    if all {
        println!();
        println!("metadata:");
        for (k, v) in m.iter() {
            println!("  {k:<48} {:<16} {v}", v.type_description());
        }
        println!();
        println!("tensors:");
        for t in &f.tensors {
            let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
            println!(
                "  {:<40} {:<8} [{}] at {} ({} bytes)",
                t.name,
                t.ty.name(),
                dims.join(", "),
                f.data_offset + t.offset,
                group(t.size)
            );
        }
    }
    Ok(())
}

fn tokenizer_summary(m: &Metadata) -> Result<String> {
    let Some(model) = m.get_str("tokenizer.ggml.model")? else {
        return Ok("(none)".into());
    };
    let kind = match model {
        "gpt2" => "byte-level BPE",
        "llama" => "SentencePiece BPE",
        "bert" => "WordPiece",
        "t5" => "Unigram",
        _ => "unknown kind",
    };
    let mut s = format!("{model} ({kind})");
    if let Some(pre) = m.get_str("tokenizer.ggml.pre")? {
        s += &format!(", pre {pre}");
    }
    let count = |key: &str| match m.get(key) {
        Some(Value::Array(_, items)) => Some(items.len()),
        _ => None,
    };
    if let Some(n) = count("tokenizer.ggml.tokens") {
        s += &format!(", {n} tokens");
    }
    if let Some(n) = count("tokenizer.ggml.merges") {
        s += &format!(", {n} merges");
    }
    for (label, key) in [
        ("bos", "tokenizer.ggml.bos_token_id"),
        ("eos", "tokenizer.ggml.eos_token_id"),
    ] {
        if let Some(id) = m.get_u32(key)? {
            s += &format!(", {label} {id}");
        }
    }
    Ok(s)
}

/// 1234567 -> "1,234,567".
fn group(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn human_count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.1} M", n as f64 / 1e6),
        n if n >= 1_000 => format!("{:.1} K", n as f64 / 1e3),
        n => n.to_string(),
    }
}

pub fn human_bytes(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn number_formats() {
        assert_eq!(group(0), "0");
        assert_eq!(group(999), "999");
        assert_eq!(group(1000), "1,000");
        assert_eq!(group(5_052_969_856), "5,052,969,856");
        assert_eq!(human_count(494_032_768), "494.0 M");
        assert_eq!(human_count(8_030_261_248), "8.03 B");
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(5_052_969_856), "4.71 GiB");
    }
}
