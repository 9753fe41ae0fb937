#!/usr/bin/env python3
"""Load generator for `memra serve` (or any OpenAI-compatible server), reporting what
vLLM's serving benchmark reports: request and token throughput, TTFT, TPOT and ITL
(mean, median, p99), end-to-end latency, and failures.

    scripts/bench-serve.py --url http://127.0.0.1:8080 -n 1000 -c 64 --input-len 128 \
        --output-len 128 [--rate 20] [--api-key KEY]

Prompts are random token ids (the completions endpoint takes ids), so each has exactly
--input-len tokens; every request generates exactly --output-len tokens (ignore_eos) and
is streamed (SSE), timed per chunk. Python's standard library only (one thread per
concurrent request, raw HTTP/1.1), so it runs on a GPU machine with nothing installed;
the server tests use the official `openai` client.
"""

import argparse
import concurrent.futures
import http.client
import json
import random
import statistics
import sys
import threading
import time
import urllib.parse


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


class Client:
    def __init__(self, url, api_key):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path):
        c = http.client.HTTPConnection(self.host, self.port, timeout=60)
        c.request("GET", path, headers=self.headers)
        r = c.getresponse()
        body = r.read()
        c.close()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: {r.status} {body[:200]!r}")
        return json.loads(body)

    def stream(self, body):
        """Yields (arrival time, chunk) for each SSE data event but [DONE]."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=3600)
        try:
            c.request("POST", "/v1/completions", json.dumps(body), headers=self.headers)
            r = c.getresponse()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}: {r.read()[:200]!r}")
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return
                yield time.perf_counter(), json.loads(data)
            raise RuntimeError("the stream ended without [DONE]")
        finally:
            c.close()


def one(client, model, prompt, output_len):
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    ttft, last, itl, tokens = None, None, [], 0
    for now, chunk in client.stream(body):
        if "error" in chunk:
            raise RuntimeError(chunk["error"].get("message"))
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        if not chunk.get("choices"):
            continue
        if ttft is None:
            ttft = now - start
        else:
            itl.append(now - last)
        last = now
    e2e = time.perf_counter() - start
    if tokens != output_len:
        raise RuntimeError(f"{tokens} tokens generated, {output_len} asked")
    return dict(ttft=ttft, itl=itl, e2e=e2e, tokens=tokens,
                tpot=(e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0)


def main(a):
    client = Client(a.url, a.api_key)
    info = client.get("/v1/models")["data"][0]
    model = info["id"]
    n_vocab = info.get("meta", {}).get("n_vocab", 32000)
    rng = random.Random(a.seed)
    # Ids from the lower middle of the vocabulary: ordinary tokens, no control ones.
    lo, hi = min(1000, n_vocab // 4), max(n_vocab // 2, 2)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.input_len)]
               for _ in range(a.num_requests)]
    results, failures = [], []
    lock = threading.Lock()

    def run(i):
        try:
            r = one(client, model, prompts[i], a.output_len)
            with lock:
                results.append(r)
        except Exception as e:  # counted and reported
            with lock:
                failures.append(repr(e))

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(a.concurrency) as pool:
        for i in range(a.num_requests):
            pool.submit(run, i)
            if a.rate:
                time.sleep(rng.expovariate(a.rate))
    duration = time.perf_counter() - start

    out_tokens = sum(r["tokens"] for r in results)
    in_tokens = a.input_len * len(results)
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft = ms([r["ttft"] for r in results])
    tpot = ms([r["tpot"] for r in results])
    itl = ms([x for r in results for x in r["itl"]])
    e2e = ms([r["e2e"] for r in results])
    w = 45
    print(f"{' Serving Benchmark Result ':=^{w + 10}}")
    rows = [
        ("Successful requests:", len(results)),
        ("Failed requests:", len(failures)),
        ("Maximum request concurrency:", a.concurrency),
        ("Request rate (req/s):", a.rate or "inf"),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", in_tokens),
        ("Total generated tokens:", out_tokens),
        ("Request throughput (req/s):", f"{len(results) / duration:.2f}"),
        ("Output token throughput (tok/s):", f"{out_tokens / duration:.2f}"),
        ("Total token throughput (tok/s):", f"{(in_tokens + out_tokens) / duration:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<{w}}{v:>10}")
    for title, name, xs in [("Time to First Token", "TTFT", ttft),
                            ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
                            ("Inter-token Latency", "ITL", itl),
                            ("End-to-end Latency", "E2EL", e2e)]:
        print(f"{title:-^{w + 10}}")
        mean = statistics.fmean(xs) if xs else float("nan")
        for label, v in [("Mean", mean), ("Median", pct(xs, 50)), ("P99", pct(xs, 99))]:
            print(f"{f'{label} {name} (ms):':<{w}}{v:>10.2f}")
    print("=" * (w + 10))
    for f in failures[:5]:
        print("failure:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--api-key", default=None)
    p.add_argument("-n", "--num-requests", type=int, default=200)
    p.add_argument("-c", "--concurrency", type=int, default=64)
    p.add_argument("--rate", type=float, default=None,
                   help="requests per second (Poisson arrivals); default: all at once")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    sys.exit(main(p.parse_args()))
