//! `memra bench serve`: load on a running OpenAI-compatible server (`memra serve`, or vLLM,
//! llama-server), reported as vLLM's serving benchmark reports it: request and token
//! throughput, time to first token, time per output token, inter-token latency and
//! end-to-end latency (mean, median, p99), and failures.
//!
//! Prompts are random token ids (the completions endpoint takes ids), so each has exactly
//! `--input-len` tokens; every request asks for exactly `--output-len` tokens (`ignore_eos`)
//! and is streamed, each server-sent event timed as it arrives. One HTTP/1.1 connection per
//! request (hyper's client on tokio), at most `--concurrency` at a time, all at once or
//! arriving as a Poisson process of `--rate` requests per second.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use bytes::Bytes;
use clap::Args;
use http_body_util::{BodyExt, Full};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};

#[derive(Args, Debug, Clone)]
pub struct ServeBenchArgs {
    /// The server's base address.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub url: String,
    /// Sent as `Authorization: Bearer KEY` (default: $MEMRA_API_KEY if set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests in all.
    #[arg(short = 'n', long, default_value_t = 200)]
    pub num_requests: usize,
    /// Requests in flight at most.
    #[arg(short = 'c', long, default_value_t = 64)]
    pub concurrency: usize,
    /// Requests per second, arriving as a Poisson process (default: all at once).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Prompt tokens of each request.
    #[arg(long, default_value_t = 128)]
    pub input_len: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 128)]
    pub output_len: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Where requests go.
struct Target {
    host: String,
    port: u16,
    auth: Option<String>,
}

/// One request's timings.
struct Timing {
    ttft: f64,
    itl: Vec<f64>,
    e2e: f64,
    tokens: usize,
}

pub fn run(a: &ServeBenchArgs) -> Result<()> {
    if a.num_requests == 0 || a.concurrency == 0 || a.input_len == 0 || a.output_len == 0 {
        bail!("-n, -c, --input-len and --output-len must be at least 1");
    }
    if a.rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
        bail!("--rate must be a positive number of requests per second");
    }
    let rest = a
        .url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("--url must start with http:// (got {:?})", a.url))?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) => (
            h,
            p.parse()
                .with_context(|| format!("the port in {:?}", a.url))?,
        ),
        None => (authority, 80),
    };
    let key = a
        .api_key
        .clone()
        .or_else(|| std::env::var("MEMRA_API_KEY").ok());
    let target = Arc::new(Target {
        host: host.to_string(),
        port,
        auth: key.filter(|k| !k.is_empty()).map(|k| format!("Bearer {k}")),
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(bench(a.clone(), target))
}

async fn bench(a: ServeBenchArgs, target: Arc<Target>) -> Result<()> {
    let models: Value = serde_json::from_slice(&get(&target, "/v1/models").await?)
        .context("the /v1/models answer is not JSON")?;
    let info = &models["data"][0];
    let model = info["id"]
        .as_str()
        .ok_or_else(|| anyhow!("/v1/models lists no model"))?
        .to_string();
    let n_vocab = info["meta"]["n_vocab"].as_u64().unwrap_or(32_000) as u32;
    // Ids from the lower middle of the vocabulary: ordinary tokens, no control ones.
    let (lo, hi) = ((n_vocab / 4).min(1000), (n_vocab / 2).max(2));
    let mut rng = XorShift::new(a.seed);
    let prompts: Vec<Vec<u32>> = (0..a.num_requests)
        .map(|_| {
            (0..a.input_len)
                .map(|_| lo + (rng.next() % u64::from(hi - lo)) as u32)
                .collect()
        })
        .collect();
    eprintln!(
        "bench serve: {} requests of {} + {} tokens to {model} at {}:{}, {} at a time",
        a.num_requests, a.input_len, a.output_len, target.host, target.port, a.concurrency
    );
    let slots = Arc::new(tokio::sync::Semaphore::new(a.concurrency));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(a.num_requests);
    for prompt in prompts {
        let permit = slots.clone().acquire_owned().await?;
        let (target, model) = (target.clone(), model.clone());
        let output_len = a.output_len;
        tasks.push(tokio::spawn(async move {
            let r = one(&target, &model, &prompt, output_len).await;
            drop(permit);
            r
        }));
        if let Some(rate) = a.rate {
            let u = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
            tokio::time::sleep(Duration::from_secs_f64(-(1.0 - u).ln() / rate)).await;
        }
    }
    let (mut done, mut failures) = (Vec::new(), Vec::new());
    for t in tasks {
        match t.await? {
            Ok(r) => done.push(r),
            Err(e) => failures.push(format!("{e:#}")),
        }
    }
    let duration = start.elapsed().as_secs_f64();
    report(&a, &done, failures.len(), duration);
    for f in failures.iter().take(5) {
        eprintln!("failure: {f}");
    }
    if !failures.is_empty() {
        bail!("{} of {} requests failed", failures.len(), a.num_requests);
    }
    Ok(())
}

/// A new connection's request sender (the connection runs on its own task).
async fn connect(t: &Target) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>> {
    let stream = tokio::net::TcpStream::connect((t.host.as_str(), t.port))
        .await
        .with_context(|| format!("connecting to {}:{}", t.host, t.port))?;
    stream.set_nodelay(true)?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    Ok(sender)
}

fn request(t: &Target, method: Method, path: &str, body: Bytes) -> Result<Request<Full<Bytes>>> {
    let mut r = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, format!("{}:{}", t.host, t.port))
        .header(CONTENT_TYPE, "application/json");
    if let Some(auth) = &t.auth {
        r = r.header(AUTHORIZATION, auth);
    }
    Ok(r.body(Full::new(body))?)
}

async fn get(t: &Target, path: &str) -> Result<Bytes> {
    let mut sender = connect(t).await?;
    let resp = sender
        .send_request(request(t, Method::GET, path, Bytes::new())?)
        .await?;
    let status = resp.status();
    let body = resp.into_body().collect().await?.to_bytes();
    if status != StatusCode::OK {
        bail!("GET {path}: {status}: {}", String::from_utf8_lossy(&body));
    }
    Ok(body)
}

/// One streamed completion of `prompt`, timed.
async fn one(t: &Target, model: &str, prompt: &[u32], output_len: usize) -> Result<Timing> {
    let body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
        "ignore_eos": true,
    });
    let start = Instant::now();
    let mut sender = connect(t).await?;
    let req = request(t, Method::POST, "/v1/completions", body.to_string().into())?;
    let resp = sender.send_request(req).await?;
    let status = resp.status();
    let mut body = resp.into_body();
    if status != StatusCode::OK {
        let text = body.collect().await?.to_bytes();
        bail!("status {status}: {}", String::from_utf8_lossy(&text));
    }
    let (mut ttft, mut last, mut itl, mut tokens) = (None, start, Vec::new(), 0);
    let mut pending: Vec<u8> = Vec::new();
    loop {
        let Some(frame) = body.frame().await else {
            bail!("the stream ended without [DONE]");
        };
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        let now = Instant::now();
        pending.extend_from_slice(&data);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Some(event) = line.strip_prefix(b"data: ") else {
                continue;
            };
            let event = event.trim_ascii();
            if event == b"[DONE]" {
                let e2e = start.elapsed().as_secs_f64();
                if tokens != output_len {
                    bail!("{tokens} tokens generated, {output_len} asked");
                }
                let ttft = ttft.ok_or_else(|| anyhow!("no text chunk before [DONE]"))?;
                return Ok(Timing {
                    ttft,
                    itl,
                    e2e,
                    tokens,
                });
            }
            let chunk: Value = serde_json::from_slice(event).context("an event is not JSON")?;
            if let Some(e) = chunk.get("error") {
                bail!("the server: {}", e["message"].as_str().unwrap_or("error"));
            }
            if let Some(n) = chunk["usage"]["completion_tokens"].as_u64() {
                tokens = n as usize;
            }
            if chunk["choices"].as_array().is_none_or(|c| c.is_empty()) {
                continue;
            }
            match ttft {
                None => ttft = Some((now - start).as_secs_f64()),
                Some(_) => itl.push((now - last).as_secs_f64()),
            }
            last = now;
        }
    }
}

/// Percentile `p` of `xs` (linear between ranks, as numpy's default).
fn percentile(xs: &[f64], p: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let k = (v.len() - 1) as f64 * p / 100.0;
    let (lo, hi) = (
        k.floor() as usize,
        (k.floor() as usize + 1).min(v.len() - 1),
    );
    v[lo] + (v[hi] - v[lo]) * (k - lo as f64)
}

fn report(a: &ServeBenchArgs, done: &[Timing], failed: usize, duration: f64) {
    let w = 45;
    let out_tokens: usize = done.iter().map(|r| r.tokens).sum();
    let in_tokens = a.input_len * done.len();
    let ms = |xs: Vec<f64>| -> Vec<f64> { xs.into_iter().map(|x| x * 1e3).collect() };
    let ttft = ms(done.iter().map(|r| r.ttft).collect());
    let tpot = ms(done
        .iter()
        .map(|r| match r.tokens {
            0 | 1 => 0.0,
            n => (r.e2e - r.ttft) / (n - 1) as f64,
        })
        .collect());
    let itl = ms(done.iter().flat_map(|r| r.itl.iter().copied()).collect());
    let e2e = ms(done.iter().map(|r| r.e2e).collect());
    let rate = a.rate.map_or("inf".to_string(), |r| r.to_string());
    println!("{:=^1$}", " Serving Benchmark Result ", w + 10);
    for (k, v) in [
        ("Successful requests:", done.len().to_string()),
        ("Failed requests:", failed.to_string()),
        ("Maximum request concurrency:", a.concurrency.to_string()),
        ("Request rate (req/s):", rate),
        ("Benchmark duration (s):", format!("{duration:.2}")),
        ("Total input tokens:", in_tokens.to_string()),
        ("Total generated tokens:", out_tokens.to_string()),
        (
            "Request throughput (req/s):",
            format!("{:.2}", done.len() as f64 / duration),
        ),
        (
            "Output token throughput (tok/s):",
            format!("{:.2}", out_tokens as f64 / duration),
        ),
        (
            "Total token throughput (tok/s):",
            format!("{:.2}", (in_tokens + out_tokens) as f64 / duration),
        ),
    ] {
        println!("{k:<w$}{v:>10}");
    }
    for (title, name, xs) in [
        ("Time to First Token", "TTFT", &ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", &tpot),
        ("Inter-token Latency", "ITL", &itl),
        ("End-to-end Latency", "E2EL", &e2e),
    ] {
        println!("{title:-^0$}", w + 10);
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        for (label, v) in [
            ("Mean", mean),
            ("Median", percentile(xs, 50.0)),
            ("P99", percentile(xs, 99.0)),
        ] {
            println!("{:<w$}{v:>10.2}", format!("{label} {name} (ms):"));
        }
    }
    println!("{}", "=".repeat(w + 10));
}

/// Prompt ids and arrival gaps: xorshift64, seeded.
struct XorShift(u64);

impl XorShift {
    fn new(seed: u64) -> XorShift {
        XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let xs = [4.0, 1.0, 3.0, 2.0];
        assert_eq!(percentile(&xs, 0.0), 1.0);
        assert_eq!(percentile(&xs, 50.0), 2.5);
        assert_eq!(percentile(&xs, 100.0), 4.0);
        assert!((percentile(&xs, 99.0) - 3.97).abs() < 1e-12);
        assert!(percentile(&[], 50.0).is_nan());
    }
}
