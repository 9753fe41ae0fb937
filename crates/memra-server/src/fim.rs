//! Fill-in-the-middle prompts for code models: OpenAI's `suffix` on `/v1/completions` and
//! llama-server's `/infill`. The layout is prefix-suffix-middle, as llama-server builds it:
//! BOS where the model takes one; for `/infill`, the repository context (the model's
//! repository marker and a name, each extra file after a file separator and its name, then
//! the current file's separator); the prefix marker and the text before the cursor; the
//! suffix marker and the text after it; the middle marker, after which the model writes
//! what goes between. The texts' special-token spellings stay text.

use memra_engine::tokenizer::Tokenizer;

use crate::error::ApiError;

/// A file of repository context (`/infill`'s `input_extra`).
pub(crate) struct ExtraFile {
    pub name: String,
    pub text: String,
}

/// The context that `/infill` puts before the prefix; `None` for `suffix`.
pub(crate) struct Repo<'a> {
    pub files: &'a [ExtraFile],
}

/// The ids of a fill-in-the-middle prompt: `prefix` (already tokens: a prompt may come as
/// ids) and `suffix` around the hole; `field` is the request field named when the model
/// cannot do it.
pub(crate) fn prompt(
    tok: &Tokenizer,
    field: &str,
    repo: Option<Repo>,
    prefix: &[u32],
    suffix: &str,
) -> Result<Vec<u32>, ApiError> {
    let fim = tok.fim().ok_or_else(|| {
        ApiError::invalid(
            field,
            "the model has no fill-in-the-middle tokens (a code model such as Qwen2.5-Coder \
             has them)",
        )
    })?;
    let enc = |t: &str| {
        tok.encode(t, false, false)
            .map_err(|e| ApiError::invalid(field, e.to_string()))
    };
    let mut out = Vec::with_capacity(prefix.len() + suffix.len() / 3 + 8);
    if tok.add_bos {
        out.extend(tok.bos);
    }
    if let Some(repo) = repo {
        if let Some(r) = fim.repo {
            out.push(r);
            out.extend(enc("myproject\n")?);
        }
        for f in repo.files {
            match fim.file_sep {
                Some(sep) => {
                    out.push(sep);
                    out.extend(enc(&format!("{}\n", f.name))?);
                }
                // Without a file marker, a plain-text separator between snippets.
                None => out.extend(enc("\n\n--- snippet ---\n\n")?),
            }
            out.extend(enc(&f.text)?);
        }
        if let Some(sep) = fim.file_sep {
            out.push(sep);
            out.extend(enc("filename\n")?);
        }
    }
    out.push(fim.prefix);
    out.extend_from_slice(prefix);
    out.push(fim.suffix);
    out.extend(enc(suffix)?);
    out.push(fim.middle);
    Ok(out)
}
