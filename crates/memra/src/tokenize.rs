//! `memra tokenize` and `memra template`: the model's tokenizer and chat template, for
//! checking prompts by hand.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memra_engine::tokenizer::template::{ChatInput, ChatTemplate};
use memra_engine::tokenizer::Tokenizer;
use memra_gguf::GgufFile;

pub struct TokenizeArgs<'a> {
    pub model: &'a Path,
    pub prompt: Option<&'a str>,
    pub file: Option<&'a Path>,
    pub stdin: bool,
    pub no_bos: bool,
    pub no_parse_special: bool,
    pub ids: bool,
    pub bench: bool,
}

/// Reads bytes that must be UTF-8, naming the first bad byte otherwise.
fn utf8(bytes: Vec<u8>, what: &str) -> Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{what} is not valid UTF-8 (bad byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

fn load(model: &Path) -> Result<(GgufFile, Tokenizer)> {
    let f = GgufFile::open(model)?;
    let t = Tokenizer::from_metadata(&f.metadata)
        .with_context(|| format!("tokenizer of {}", model.display()))?;
    Ok((f, t))
}

pub fn tokenize(a: TokenizeArgs) -> Result<()> {
    let text = match (a.prompt, a.file, a.stdin) {
        (Some(p), None, false) => p.to_string(),
        (None, Some(f), false) => {
            let bytes = std::fs::read(f).with_context(|| format!("cannot read {}", f.display()))?;
            utf8(bytes, &f.display().to_string())?
        }
        (None, None, true) => {
            let mut bytes = Vec::new();
            std::io::stdin()
                .read_to_end(&mut bytes)
                .context("cannot read standard input")?;
            utf8(bytes, "standard input")?
        }
        _ => bail!("give exactly one of -p TEXT, -f FILE, --stdin"),
    };
    let (_, t) = load(a.model)?;
    let (add_special, parse_special) = (!a.no_bos, !a.no_parse_special);
    let ids = t.encode(&text, add_special, parse_special)?;
    if a.bench {
        return bench(&t, &text, add_special, parse_special, ids.len());
    }
    if a.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        println!("[{}]", list.join(", "));
    } else {
        for &id in &ids {
            let piece = String::from_utf8_lossy(&t.token_bytes(id, true)?).into_owned();
            println!("{id:>6} -> '{piece}'");
        }
    }
    Ok(())
}

/// Encodes the text repeatedly for about two seconds and reports the throughput.
fn bench(
    t: &Tokenizer,
    text: &str,
    add_special: bool,
    parse_special: bool,
    n_tokens: usize,
) -> Result<()> {
    const MIN_TIME: Duration = Duration::from_secs(2);
    // One warm-up pass (the Unicode tables are built on first use).
    t.encode(text, add_special, parse_special)?;
    let start = Instant::now();
    let mut runs = 0u32;
    while start.elapsed() < MIN_TIME || runs < 3 {
        t.encode(text, add_special, parse_special)?;
        runs += 1;
    }
    let secs = start.elapsed().as_secs_f64() / f64::from(runs);
    eprintln!(
        "encoded {} bytes into {n_tokens} tokens: {:.2} ms per pass over {runs} passes, {:.2} MB/s, {:.0} tokens/s",
        text.len(),
        secs * 1e3,
        text.len() as f64 / secs / 1e6,
        n_tokens as f64 / secs
    );
    Ok(())
}

pub fn template(
    model: &Path,
    messages: &Path,
    tools: Option<&Path>,
    no_generation_prompt: bool,
    choice: Option<&str>,
) -> Result<()> {
    let read_json = |p: &Path| -> Result<serde_json::Value> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", p.display()))
    };
    let messages = read_json(messages)?;
    if !messages.is_array() {
        bail!("the messages file must hold a JSON array of {{\"role\", \"content\"}} objects");
    }
    let tools = tools.map(read_json).transpose()?;
    let (f, t) = load(model)?;
    let template = ChatTemplate::select(&f.metadata, choice)?;
    let token = |id: Option<u32>| id.and_then(|i| t.token_text(i)).unwrap_or("");
    let out = template.render(&ChatInput {
        messages: &messages,
        tools: tools.as_ref(),
        add_generation_prompt: !no_generation_prompt,
        bos_token: token(t.bos),
        eos_token: token(t.eos),
    })?;
    print!("{out}");
    Ok(())
}
