//! Prometheus metrics under vLLM's names with the `memra:` prefix (vLLM writes
//! `vllm:num_requests_running`, ...), encoded by `prometheus-client`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

use memra_engine::engine::EngineStats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabels {
    /// `stop`, `length`, or `abort` (the client went away).
    pub finished_reason: String,
}

pub struct Metrics {
    registry: Registry,
    running: Gauge,
    waiting: Gauge,
    kv_usage: Gauge<f64, AtomicU64>,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub success: Family<FinishLabels, Counter>,
    pub prefix_queries: Counter,
    pub prefix_hits: Counter,
    pub ttft: Histogram,
    pub itl: Histogram,
    pub e2e: Histogram,
}

/// vLLM's buckets (seconds).
const TTFT_BUCKETS: [f64; 18] = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0,
];
const ITL_BUCKETS: [f64; 16] = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
const E2E_BUCKETS: [f64; 16] = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
];

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::default();
        let m = Metrics {
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            success: Family::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            registry: Registry::default(),
        };
        // Counters get their `_total` suffix from the encoder.
        let r = &mut registry;
        r.register(
            "memra:num_requests_running",
            "Sequences in the running batch",
            m.running.clone(),
        );
        r.register(
            "memra:num_requests_waiting",
            "Sequences waiting to run",
            m.waiting.clone(),
        );
        r.register(
            "memra:kv_cache_usage_perc",
            "Fraction of KV cache blocks held by sequences (1 = all)",
            m.kv_usage.clone(),
        );
        r.register(
            "memra:prompt_tokens",
            "Prompt tokens of finished requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "memra:generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        r.register(
            "memra:request_success",
            "Finished requests by finish reason",
            m.success.clone(),
        );
        r.register(
            "memra:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        r.register(
            "memra:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_hits.clone(),
        );
        r.register(
            "memra:time_to_first_token_seconds",
            "Time from arrival to the first token",
            m.ttft.clone(),
        );
        r.register(
            "memra:inter_token_latency_seconds",
            "Time between tokens of a sequence",
            m.itl.clone(),
        );
        r.register(
            "memra:e2e_request_latency_seconds",
            "Time from arrival to the finish",
            m.e2e.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The text exposition, with the gauges set from the engine's last snapshot.
    pub fn encode(&self, stats: Option<EngineStats>) -> String {
        let s = stats.unwrap_or_default();
        self.running.set(s.running as i64);
        self.waiting.set(s.waiting as i64);
        self.kv_usage
            .set(s.blocks_used as f64 / s.num_blocks.max(1) as f64);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }

    pub fn finished(&self, reason: &str) {
        self.success
            .get_or_create(&FinishLabels {
                finished_reason: reason.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exposition_has_vllm_s_names_under_memra() {
        let m = Metrics::new();
        m.finished("stop");
        m.ttft.observe(0.2);
        let text = m.encode(Some(EngineStats {
            running: 2,
            waiting: 1,
            blocks_used: 4,
            num_blocks: 16,
        }));
        for line in [
            "memra:num_requests_running 2",
            "memra:num_requests_waiting 1",
            "memra:kv_cache_usage_perc 0.25",
            "memra:prompt_tokens_total 0",
            "memra:generation_tokens_total 0",
            "memra:request_success_total{finished_reason=\"stop\"} 1",
            "memra:prefix_cache_queries_total 0",
            "memra:prefix_cache_hits_total 0",
            "memra:time_to_first_token_seconds_count 1",
            "memra:inter_token_latency_seconds_count 0",
            "memra:e2e_request_latency_seconds_count 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
    }
}
