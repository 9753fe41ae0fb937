#!/usr/bin/env python3
"""Load generator for `memra serve` (or any OpenAI-compatible server), reporting what
vLLM's serving benchmark reports: request and token throughput, TTFT, TPOT and ITL
(mean, median, p99), and failures.

    scripts/bench-serve.py --url http://127.0.0.1:8080 -n 1000 -c 64 --input-len 128 \
        --output-len 128 [--rate 20] [--api-key KEY]

Prompts are random token ids (the completions endpoint takes ids), so each has exactly
--input-len tokens; every request generates exactly --output-len tokens (ignore_eos).
Needs the `openai` package (scripts/setup-test-venv.sh makes an environment with it).
"""

import argparse
import asyncio
import random
import statistics
import sys
import time

import httpx
import openai


def pct(xs, p):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def one(client, model, prompt, output_len, result):
    start = time.perf_counter()
    ttft = None
    last = None
    itl = []
    tokens = 0
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        if ttft is None:
            ttft = now - start
        else:
            itl.append(now - last)
        last = now
    e2e = time.perf_counter() - start
    if tokens != output_len:
        raise RuntimeError(f"{tokens} tokens generated, {output_len} asked")
    result.update(ttft=ttft, itl=itl, e2e=e2e, tokens=tokens,
                  tpot=(e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0)


async def main(a):
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    info = httpx.get(a.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]
    model = info["id"]
    n_vocab = info.get("meta", {}).get("n_vocab", 32000)
    rng = random.Random(a.seed)
    # Ids from the middle of the vocabulary: ordinary tokens, no control ones.
    lo, hi = min(1000, n_vocab // 4), max(n_vocab // 2, 2)
    prompts = [[rng.randrange(lo, hi) for _ in range(a.input_len)] for _ in range(a.num_requests)]
    client = openai.AsyncOpenAI(base_url=a.url + "/v1", api_key=a.api_key or "none",
                                max_retries=0, timeout=3600,
                                http_client=openai.DefaultAsyncHttpxClient(
                                    limits=httpx.Limits(max_connections=a.concurrency + 8)))
    sem = asyncio.Semaphore(a.concurrency)
    results = [dict() for _ in prompts]
    failures = []

    async def bounded(i):
        async with sem:
            try:
                await one(client, model, prompts[i], a.output_len, results[i])
            except Exception as e:  # counted, reported
                failures.append(repr(e))

    start = time.perf_counter()
    tasks = []
    for i in range(a.num_requests):
        tasks.append(asyncio.create_task(bounded(i)))
        if a.rate:
            await asyncio.sleep(rng.expovariate(a.rate))
    await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()

    ok = [r for r in results if r]
    out_tokens = sum(r["tokens"] for r in ok)
    in_tokens = a.input_len * len(ok)
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    ttft = ms([r["ttft"] for r in ok])
    tpot = ms([r["tpot"] for r in ok])
    itl = ms([x for r in ok for x in r["itl"]])
    e2e = ms([r["e2e"] for r in ok])
    w = 45
    print(f"{' Serving Benchmark Result ':=^{w + 10}}")
    rows = [
        ("Successful requests:", len(ok)),
        ("Failed requests:", len(failures)),
        ("Maximum request concurrency:", a.concurrency),
        ("Request rate (req/s):", a.rate or "inf"),
        ("Benchmark duration (s):", f"{duration:.2f}"),
        ("Total input tokens:", in_tokens),
        ("Total generated tokens:", out_tokens),
        ("Request throughput (req/s):", f"{len(ok) / duration:.2f}"),
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
    sys.exit(asyncio.run(main(p.parse_args())))
