//! `memra bench --spec-prompts FILE`: speculative decoding's speedup. Each prompt of the
//! file is generated greedily twice through the engine, without speculation and with the
//! drafting that `--spec-ngram` / `--model-draft` ask for, and the table gives both rates,
//! the speedup and the drafts' acceptance. Greedy speculation must give plain decoding's
//! tokens: a prompt whose tokens differ is reported and makes the command fail.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use memra_engine::generate::GenerateConfig;
use memra_engine::sampler::SamplerConfig;

use crate::bench::Format;
use crate::generate::{engine_generate, load, start_engine, DefaultPool, ModelArgs};

/// The prompts of a JSON-lines file: each line a JSON string, or an object with a
/// `"prompt"` string (blank lines skipped).
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut prompts = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON line", path.display(), i + 1))?;
        let p = match &v {
            serde_json::Value::String(s) => s.clone(),
            serde_json::Value::Object(o) => match o.get("prompt") {
                Some(serde_json::Value::String(s)) => s.clone(),
                _ => bail!(
                    "{}:{}: an object without a \"prompt\" string",
                    path.display(),
                    i + 1
                ),
            },
            _ => bail!(
                "{}:{}: neither a string nor an object",
                path.display(),
                i + 1
            ),
        };
        if p.is_empty() {
            bail!("{}:{}: an empty prompt", path.display(), i + 1);
        }
        prompts.push(p);
    }
    if prompts.is_empty() {
        bail!("{} holds no prompts", path.display());
    }
    Ok(prompts)
}

/// One prompt's runs.
struct Row {
    prompt_tokens: usize,
    generated: usize,
    plain_s: f64,
    spec_s: f64,
    drafted: usize,
    accepted: usize,
    same: bool,
}

pub fn run(args: &ModelArgs, prompts_file: &Path, n_gen: usize, format: Format) -> Result<()> {
    if args.spec.spec_ngram.is_none() && args.spec.model_draft.is_none() {
        bail!("--spec-prompts measures speculative decoding: give --spec-ngram N or --model-draft FILE");
    }
    if n_gen == 0 {
        bail!("-n must be at least 1");
    }
    let prompts = read_prompts(prompts_file)?;
    let (model, n_ctx) = load(args)?;
    let model = Arc::new(model);
    let ids: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| model.tokenizer.encode(p, true, true))
        .collect::<Result<_, _>>()?;
    if let Some(long) = ids.iter().position(|p| p.len() + n_gen > n_ctx) {
        bail!(
            "prompt {} has {} tokens; with -n {n_gen} the context needs {} (raise -c)",
            long + 1,
            ids[long].len(),
            ids[long].len() + n_gen
        );
    }
    let config = GenerateConfig {
        n_predict: n_gen,
        stop: Vec::new(),
        sampler: SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        },
    };
    // Plain decoding first, then speculation, one engine at a time (a GPU holds one copy
    // of the weights), each prompt once untimed so that both runs find warm kernels.
    let mut plain_args = args.clone();
    plain_args.spec.spec_ngram = None;
    plain_args.spec.model_draft = None;
    let mut runs = Vec::new();
    for a in [&plain_args, args] {
        let engine = start_engine(a, model.clone(), n_ctx, 1, DefaultPool::Contexts)?;
        engine_generate(&engine, ids[0].clone(), &config, None, |_| {})?;
        let mut out = Vec::new();
        for p in &ids {
            out.push(engine_generate(&engine, p.clone(), &config, None, |_| {})?);
        }
        runs.push(out);
    }
    let rows: Vec<Row> = runs[0]
        .iter()
        .zip(&runs[1])
        .zip(&ids)
        .map(|(((plain, _), (spec, usage)), p)| Row {
            prompt_tokens: p.len(),
            generated: spec.generated.len(),
            plain_s: plain.generate_time.as_secs_f64(),
            spec_s: spec.generate_time.as_secs_f64(),
            drafted: usage.draft_tokens,
            accepted: usage.accepted_tokens,
            same: plain.generated == spec.generated,
        })
        .collect();
    print_rows(&rows, format);
    let differ: Vec<String> = rows
        .iter()
        .enumerate()
        .filter(|(_, r)| !r.same)
        .map(|(i, _)| (i + 1).to_string())
        .collect();
    if !differ.is_empty() {
        bail!(
            "greedy speculation gave other tokens than plain decoding for prompt(s) {}",
            differ.join(", ")
        );
    }
    Ok(())
}

fn print_rows(rows: &[Row], format: Format) {
    // Tokens after the first (which the prompt's forward gives) over the decode time.
    let rate = |n: usize, s: f64| n.saturating_sub(1) as f64 / s.max(1e-9);
    let (n, plain, spec): (usize, f64, f64) = rows.iter().fold((0, 0.0, 0.0), |a, r| {
        (
            a.0 + r.generated.saturating_sub(1),
            a.1 + r.plain_s,
            a.2 + r.spec_s,
        )
    });
    let (drafted, accepted) = rows
        .iter()
        .fold((0, 0), |a, r| (a.0 + r.drafted, a.1 + r.accepted));
    let acceptance = |a: usize, d: usize| if d == 0 { 0.0 } else { a as f64 / d as f64 };
    match format {
        Format::Md => {
            println!(
                "| prompt | tokens in | out | plain t/s | spec t/s | speedup | accepted | same |"
            );
            println!("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |");
            for (i, r) in rows.iter().enumerate() {
                let (p, s) = (rate(r.generated, r.plain_s), rate(r.generated, r.spec_s));
                println!(
                    "| {} | {} | {} | {p:.2} | {s:.2} | {:.2}x | {} of {} ({:.0}%) | {} |",
                    i + 1,
                    r.prompt_tokens,
                    r.generated,
                    s / p,
                    r.accepted,
                    r.drafted,
                    100.0 * acceptance(r.accepted, r.drafted),
                    if r.same { "yes" } else { "NO" }
                );
            }
            println!(
                "| all | | {n} | {:.2} | {:.2} | {:.2}x | {accepted} of {drafted} ({:.0}%) | |",
                n as f64 / plain,
                n as f64 / spec,
                plain / spec,
                100.0 * acceptance(accepted, drafted)
            );
        }
        Format::Json => {
            let per: Vec<serde_json::Value> = rows
                .iter()
                .map(|r| {
                    serde_json::json!({
                        "prompt_tokens": r.prompt_tokens,
                        "generated": r.generated,
                        "plain_tps": rate(r.generated, r.plain_s),
                        "spec_tps": rate(r.generated, r.spec_s),
                        "draft_tokens": r.drafted,
                        "accepted_tokens": r.accepted,
                        "same": r.same,
                    })
                })
                .collect();
            let all = serde_json::json!({
                "prompts": per,
                "plain_tps": n as f64 / plain,
                "spec_tps": n as f64 / spec,
                "speedup": plain / spec,
                "acceptance": acceptance(accepted, drafted),
            });
            println!("{all}");
        }
    }
}
