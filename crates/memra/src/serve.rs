//! `memra serve`: the OpenAI-compatible server (memra-server) over the engine, loaded as
//! `run` and `bench --batched` load it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::Args;

use memra_engine::engine::Pooling;

use crate::generate::{self, DefaultPool, Device, ModelArgs};

/// Server options, named as llama-server's where it has them.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default: put a proxy in front to expose it).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences that run at once (`-np` as in llama-server).
    #[arg(long = "parallel", default_value_t = 4)]
    pub parallel: usize,
    /// Clients must send `Authorization: Bearer KEY` (default: $MEMRA_API_KEY if set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model's id in /v1/models and responses (default: the file's name).
    #[arg(long)]
    pub alias: Option<String>,
    /// Sequences that may wait beyond the running ones; more get 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    pub max_queue: usize,
    /// A built-in chat template (chatml, llama3, gemma) or a template file, instead of the
    /// model's own.
    #[arg(long)]
    pub chat_template: Option<String>,
    /// Seconds running requests get to finish after SIGINT / SIGTERM.
    #[arg(long, default_value_t = 10.0)]
    pub grace: f64,
    /// Largest request body in bytes (413 beyond).
    #[arg(long, default_value_t = 8 << 20)]
    pub max_body: usize,
    /// How the model writes tool calls: hermes (`<tool_call>` blocks: Qwen2.5, Hermes),
    /// llama3 (JSON `{"name", "parameters"}`), json (a JSON object `{"name", "arguments"}`).
    /// Default: what the chat template writes.
    #[arg(long, value_parser = ["hermes", "llama3", "json"])]
    pub tool_call_format: Option<String>,
    /// Serve /v1/embeddings (the CPU only for now).
    #[arg(long)]
    pub embeddings: bool,
    /// How embeddings pool the prompt's last hidden states: mean, cls or last (default:
    /// what the file says, else last).
    #[arg(long, value_parser = ["mean", "cls", "last"])]
    pub pooling: Option<String>,
}

pub fn run(model: ModelArgs, args: ServeArgs) -> Result<()> {
    if args.parallel == 0 {
        bail!("--parallel must be at least 1");
    }
    if !(args.grace.is_finite() && args.grace >= 0.0) {
        bail!("--grace must be a number of seconds");
    }
    if args.embeddings && model.device() == Device::Cuda {
        // The GPU's prompt path does not return hidden states yet (docs/server.md).
        bail!("--embeddings runs on the CPU only for now: add --device cpu");
    }
    let api_key = args
        .api_key
        .or_else(|| std::env::var("MEMRA_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let model_id = args.alias.unwrap_or_else(|| {
        model
            .model
            .file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let config = memra_server::ServerConfig {
        host: args.host,
        port: args.port,
        model_id,
        api_key,
        max_queue: args.max_queue,
        chat_template: args.chat_template,
        grace: Duration::from_secs_f64(args.grace),
        body_limit: args.max_body,
        tool_format: args
            .tool_call_format
            .as_deref()
            .and_then(memra_server::tools::ToolFormat::from_name),
        embeddings: args.embeddings,
        pooling: args.pooling.as_deref().and_then(Pooling::parse),
    };
    let parallel = args.parallel;
    memra_server::run(
        config,
        Box::new(move || {
            let (m, n_ctx) = generate::load(&model)?;
            // As vLLM: on a GPU the pool takes most of the memory left; on the CPU, every
            // sequence's whole context.
            generate::start_engine(
                &model,
                Arc::new(m),
                n_ctx,
                parallel,
                DefaultPool::GpuFraction(0.9),
            )
        }),
    )
}
