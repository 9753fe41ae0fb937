"""Speculative decoding through `memra serve` (Qwen2.5-Coder 0.5B on the CPU): a server
with prompt lookup, and one with a draft model (the same model drafting for itself: every
draft is accepted), answer greedy requests, streamed or not, with exactly the text of the
plain server; sampled requests still answer in the requested shape. The servers draft by
the length rule (`--draft-policy length`): the default cost rule may stop drafting that
does not pay, as on the CPU, which would leave nothing to verify."""

import concurrent.futures

import pytest

from conftest import QWEN

PROMPTS = [
    "def compute_total(item_list, tax_rate):\n    sub_total = sum(item_list)\n"
    "    return sub_total * (1 + tax_rate)\n\n# The same function again:\n"
    "def compute_total(item_list, tax_rate):\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. "
    "The quick brown fox",
    "1, 2, 3, 4, 5, 6,",
]


def complete(server, prompt, stream=False, **kw):
    client = server.client()
    r = client.completions.create(model="m", prompt=prompt, max_tokens=40, stream=stream, **kw)
    if stream:
        return "".join(p.choices[0].text for p in r)
    return r.choices[0].text


@pytest.mark.parametrize("flags", [["--spec-ngram", "3"], ["--model-draft", str(QWEN)]],
                         ids=["prompt-lookup", "draft-model"])
def test_speculative_server_gives_the_plain_servers_text(qwen, spawn, flags):
    spec = spawn(QWEN, "-c", "1024", "-np", "4", "--draft-policy", "length", *flags)
    plain = [complete(qwen, p, temperature=0) for p in PROMPTS]
    # Concurrent requests: several speculating sequences in one step.
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(lambda p: complete(spec, p, temperature=0), PROMPTS))
    assert got == plain
    assert [complete(spec, p, stream=True, temperature=0) for p in PROMPTS] == plain
    sampled = spec.client().completions.create(model="m", prompt=PROMPTS[1], max_tokens=12,
                                               temperature=0.8, seed=3)
    assert sampled.usage.completion_tokens <= 12 and sampled.choices[0].finish_reason


def test_a_request_sets_its_own_draft_bounds(qwen, spawn):
    spec = spawn(QWEN, "-c", "1024", "-np", "2", "--spec-ngram", "3", "--draft-policy", "length")
    plain = complete(qwen, PROMPTS[0], temperature=0)
    for bounds in [{"speculative.n_max": 0}, {"speculative.n_max": 2, "speculative.n_min": 1}]:
        assert complete(spec, PROMPTS[0], temperature=0, extra_body=bounds) == plain
    r = spec.post("/v1/completions", {"prompt": "hi", "speculative.n_max": -1})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "speculative.n_max"
