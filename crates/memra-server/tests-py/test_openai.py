"""`memra serve` through the official `openai` client and raw HTTP (httpx), against
Qwen2.5-Coder 0.5B on the CPU: shapes, greedy equality with `memra run`, streaming,
stop strings, seeds, logprobs, n, usage, errors, API keys, disconnects, metrics."""

import concurrent.futures
import json
import subprocess
import time

import httpx
import openai
import pytest

from conftest import API_KEY, QWEN, QWEN_CTX, memra_bin

CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
PROMPT = "def fibonacci(n):\n"


def greedy_chat(client, **kw):
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(model="m", messages=CHAT, temperature=0, **kw)


def test_health_models_and_loopback_default(qwen):
    assert qwen.saw_loading, "no 503 from /health while loading"
    r = httpx.get(qwen.url + "/health")
    assert (r.status_code, r.json()) == (200, {"status": "ok"})
    models = qwen.client().models.list()
    assert [m.id for m in models.data] == [QWEN.name]
    assert models.data[0].object == "model"
    # No --host given: the server listens on loopback only.
    assert f"listening on http://127.0.0.1:{qwen.port}" in qwen.log
    assert "KV pool" in qwen.log


def test_chat_shapes_and_usage(qwen):
    r = greedy_chat(qwen.client())
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == "m"
    assert isinstance(r.created, int)
    (c,) = r.choices
    assert c.index == 0 and c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length")
    assert len(c.message.content) > 0
    u = r.usage
    assert u.prompt_tokens > 10 and 0 < u.completion_tokens <= 24
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    if c.finish_reason == "length":
        assert u.completion_tokens == 24


def test_chat_stream_equals_non_stream(qwen):
    client = qwen.client()
    want = greedy_chat(client, max_tokens=32)
    chunks = list(greedy_chat(client, max_tokens=32, stream=True,
                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == want.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    # The usage chunk comes last, with no choices; the others carry usage null.
    assert chunks[-1].choices == [] and chunks[-1].usage == want.usage
    assert all(c.usage is None for c in chunks[:-1])


def test_raw_sse_ends_with_done(qwen):
    body = {"messages": CHAT, "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", qwen.url + "/v1/chat/completions", json=body,
                      headers=qwen.headers(), timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        json.loads(line[len("data: "):])


def test_completions_greedy_equals_memra_run(qwen):
    n = 16
    run = subprocess.run(
        [memra_bin(), "run", "-m", str(QWEN), "--device", "cpu", "--temp", "0",
         "-n", str(n), "-p", PROMPT],
        capture_output=True, text=True, timeout=300, check=True)
    client = qwen.client()
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=n, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == run.stdout
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == n
    stream = client.completions.create(model="m", prompt=PROMPT, max_tokens=n,
                                       temperature=0, stream=True)
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts) == run.stdout
    assert parts[-1].choices[0].finish_reason == "length"


def test_completion_forms_echo_and_default_length(qwen):
    client = qwen.client()
    ids = httpx.post(qwen.url + "/tokenize", json={"content": PROMPT},
                     headers=qwen.headers()).json()["tokens"]
    by_text = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    two = client.completions.create(model="m", prompt=[PROMPT, "import os\n"], max_tokens=6,
                                    temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == by_text.choices[0].text
    echo = client.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0,
                                     echo=True)
    assert echo.choices[0].text == PROMPT + by_text.choices[0].text
    # OpenAI's completions default: 16 tokens.
    d = client.completions.create(model="m", prompt=PROMPT, temperature=0)
    assert d.usage.completion_tokens == 16 and d.choices[0].finish_reason == "length"


def test_max_tokens_gives_finish_reason_length(qwen):
    r = greedy_chat(qwen.client(), max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    r = greedy_chat(qwen.client(), max_completion_tokens=2)
    assert r.usage.completion_tokens == 2


def test_stop_strings_are_never_emitted(qwen):
    client = qwen.client()
    full = client.completions.create(model="m", prompt=PROMPT, max_tokens=24,
                                     temperature=0).choices[0].text
    stop = full[8:11]
    assert len(stop.strip()) > 0, full
    want = full[: full.index(stop)]
    r = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0,
                                  stop=[stop, "never-there"])
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "stop"
    parts = [p.choices[0].text for p in client.completions.create(
        model="m", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)]
    assert "".join(parts) == want
    c = client.chat.completions.create(model="m", messages=CHAT, temperature=0,
                                       max_tokens=24, stop="def")
    assert "def" not in c.choices[0].message.content


def test_seeds_repeat_and_differ(qwen):
    client = qwen.client()

    def sample(seed):
        return client.completions.create(model="m", prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, top_p=1.0, seed=seed).choices[0].text

    a = sample(1234)
    assert sample(1234) == a
    assert len({a, sample(1235), sample(99)}) > 1


def test_chat_logprobs(qwen):
    r = greedy_chat(qwen.client(), max_tokens=6, logprobs=True, top_logprobs=3)
    c = r.choices[0]
    content = c.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == c.message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.bytes == list(t.token.encode())
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy: the token taken is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    stream = list(greedy_chat(qwen.client(), max_tokens=6, logprobs=True, top_logprobs=1,
                              stream=True))
    got = [t.token for ch in stream if ch.choices and ch.choices[0].logprobs
           for t in ch.choices[0].logprobs.content]
    assert got == [t.token for t in content]
    assert greedy_chat(qwen.client(), max_tokens=2).choices[0].logprobs is None


def test_completion_logprobs(qwen):
    r = qwen.client().completions.create(model="m", prompt=PROMPT, max_tokens=5,
                                         temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0 and abs(max(top.values()) - l) < 1e-5 and tok in top


def test_echo_logprobs_score_the_prompt(qwen):
    """lm-eval-harness's loglikelihood request (token ids, echo, logprobs, one token):
    every prompt token but the first gets its log-probability given those before it."""
    client = qwen.client()
    text = PROMPT + "    if n < 2:\n        return n\n"
    ids = qwen.post("/tokenize", {"content": text}).json()["tokens"]
    ctx = len(qwen.post("/tokenize", {"content": PROMPT}).json()["tokens"])
    assert 0 < ctx < len(ids) - 3
    r = client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0,
                                  logprobs=1, echo=True)
    (c,) = r.choices
    lp = c.logprobs
    n = len(ids) + 1
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens[:-1]) == text and c.text == "".join(lp.tokens)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    for l, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert l <= 0 and len(top) == 1 and max(top.values()) >= l - 1e-5
    # The independent value: each continuation token forced as the next token (a bias the
    # reported log-probability does not see) after the prompt cut before it.
    for k in range(ctx, ctx + 3):
        forced = client.completions.create(model="m", prompt=ids[:k], max_tokens=1,
                                           temperature=0, logprobs=1,
                                           logit_bias={str(ids[k]): 100})
        f = forced.choices[0].logprobs
        assert f.tokens[0] == lp.tokens[k]
        assert abs(f.token_logprobs[0] - lp.token_logprobs[k]) < 2e-3, k
        assert abs(max(f.top_logprobs[0].values()) - max(lp.top_logprobs[k].values())) < 2e-3
    # Streamed: the echo first, with the prompt's log-probabilities, then the token's.
    parts = list(client.completions.create(model="m", prompt=ids, max_tokens=1, temperature=0,
                                           logprobs=1, echo=True, stream=True))
    streamed = [x for p in parts if p.choices and p.choices[0].logprobs
                for x in p.choices[0].logprobs.token_logprobs]
    assert parts[0].choices[0].text == text
    assert streamed == lp.token_logprobs
    # Nothing to generate: the prompt alone (with echo only).
    z = client.completions.create(model="m", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    assert z.choices[0].text == text and z.usage.completion_tokens == 0
    assert z.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]
    assert z.choices[0].finish_reason == "length"
    z = client.completions.create(model="m", prompt=PROMPT, max_tokens=0, echo=True)
    assert z.choices[0].text == PROMPT and z.choices[0].logprobs is None
    e = qwen.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert e.status_code == 400 and e.json()["error"]["param"] == "max_tokens"


def test_llama_server_completion(qwen):
    """llama-server's own `/completion`: its field names, its answer, its stream."""
    want = qwen.client().completions.create(model="m", prompt=PROMPT, max_tokens=8,
                                            temperature=0)
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "n_probs": 2,
            "return_tokens": True, "cache_prompt": True}
    r = qwen.post("/completion", body)
    assert r.status_code == 200, r.text
    j = r.json()
    assert j["content"] == want.choices[0].text and j["stop"] is True
    assert (j["tokens_predicted"], j["tokens_evaluated"]) == (8, want.usage.prompt_tokens)
    assert j["stop_type"] == "limit" and j["stopping_word"] == ""
    assert j["generation_settings"]["n_predict"] == 8 and j["prompt"] == PROMPT
    t = j["timings"]
    assert t["predicted_n"] == 8 and t["prompt_n"] + j["tokens_cached"] == j["tokens_evaluated"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0
    assert qwen.post("/detokenize", {"tokens": j["tokens"]}).json()["content"] == j["content"]
    probs = j["completion_probabilities"]
    assert [p["id"] for p in probs] == j["tokens"]
    for p in probs:  # greedy: each token its position's best
        assert len(p["top_logprobs"]) == 2 and p["top_logprobs"][0]["id"] == p["id"]
        assert abs(p["top_logprobs"][0]["logprob"] - p["logprob"]) < 1e-5
    # Streamed: the same text in pieces, then the last object, and no [DONE].
    with httpx.stream("POST", qwen.url + "/completion", headers=qwen.headers(), timeout=60,
                      json={**body, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    chunks = [json.loads(ln[6:]) for ln in lines]
    assert "".join(c["content"] for c in chunks) == j["content"]
    assert all(c["stop"] is False for c in chunks[:-1]) and chunks[-1]["stop"] is True
    assert chunks[-1]["stop_type"] == "limit" and chunks[-1]["tokens_predicted"] == 8
    assert [x["id"] for c in chunks[:-1] for x in c.get("completion_probabilities", [])] \
        == j["tokens"]
    # A stop word: the text before it, and which it was.
    stop = j["content"][3:6]
    w = qwen.post("/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                  "stop": ["never-there", stop]}).json()
    assert w["content"] == j["content"][: j["content"].index(stop)]
    assert (w["stop_type"], w["stopping_word"]) == ("word", stop)
    # Its fields, checked under their names; the key guards it.
    for bad, field in [({"n_predict": 0}, "n_predict"), ({"n_predict": "8"}, "n_predict"),
                       ({"n_probs": 50}, "n_probs"), ({"return_tokens": 1}, "return_tokens"),
                       ({"temperature": -1}, "temperature"), ({}, "prompt")]:
        e = qwen.post("/completion", {"prompt": PROMPT, **bad} if field != "prompt" else bad)
        assert e.status_code == 400 and e.json()["error"]["param"] == field, (bad, e.text)
    assert httpx.post(qwen.url + "/completion", json=body).status_code == 401


def test_fill_in_the_middle(qwen, tiny):
    """OpenAI's `suffix` and llama-server's `/infill` build the model's fill-in-the-middle
    prompt: the same tokens as its markers written out by hand."""
    client = qwen.client()
    pre, suf = "def add(a, b):\n    return ", "\n\n\nprint(add(1, 2))\n"

    def by_hand(text):
        r = client.completions.create(model="m", prompt=text, max_tokens=8, temperature=0)
        return r.choices[0].text, r.usage.prompt_tokens

    fim = "<|fim_prefix|>" + pre + "<|fim_suffix|>" + suf + "<|fim_middle|>"
    want, n = by_hand(fim)
    assert "a + b" in want, want  # the hole filled
    r = client.completions.create(model="m", prompt=pre, suffix=suf, max_tokens=8,
                                  temperature=0)
    assert (r.choices[0].text, r.usage.prompt_tokens) == (want, n)
    ids = qwen.post("/tokenize", {"content": pre}).json()["tokens"]
    r = client.completions.create(model="m", prompt=ids, suffix=suf, max_tokens=8,
                                  temperature=0)
    assert r.choices[0].text == want
    # /infill: llama-server's repository context, then the same hole.
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    j = qwen.post("/infill", {"input_prefix": pre, "input_suffix": suf, "input_extra": extra,
                              "n_predict": 8, "temperature": 0}).json()
    want, n = by_hand("<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n"
                      "<|file_sep|>filename\n" + fim)
    assert (j["content"], j["tokens_evaluated"]) == (want, n), j
    for body, field in [({"input_prefix": 3}, "input_prefix"),
                        ({"input_extra": [{"filename": 1, "text": "x"}]},
                         "input_extra[0].filename"),
                        ({"input_extra": [{"filename": "a"}]}, "input_extra[0].text"),
                        ({"input_extra": "x"}, "input_extra")]:
        e = qwen.post("/infill", body)
        assert e.status_code == 400 and e.json()["error"]["param"] == field, (body, e.text)
    # A model without the markers refuses, naming the field.
    e = httpx.post(tiny.url + "/v1/completions", json={"prompt": "x", "suffix": "y"})
    assert e.status_code == 400 and e.json()["error"]["param"] == "suffix"
    e = httpx.post(tiny.url + "/infill", json={"input_prefix": "x"})
    assert e.status_code == 400 and e.json()["error"]["param"] == "input_prefix"


def test_model_retrieve(qwen):
    client = qwen.client()
    m = client.models.retrieve(QWEN.name)
    assert (m.id, m.object, m.owned_by) == (QWEN.name, "model", "memra")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(qwen.url + "/v1/models/" + QWEN.name)
    assert r.status_code == 401  # the key guards it as it guards the list


def test_n_choices_share_the_prompt(qwen):
    client = qwen.client()
    messages = [{"role": "system", "content": "You are a poet. " * 12}] + CHAT
    r = client.chat.completions.create(model="m", messages=messages, n=3, max_tokens=8,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    alone = client.chat.completions.create(model="m", messages=messages, max_tokens=1)
    # The prompt counted once; every choice's tokens.
    assert r.usage.prompt_tokens == alone.usage.prompt_tokens
    assert r.usage.completion_tokens <= 3 * 8
    if all(c.finish_reason == "length" for c in r.choices):
        assert r.usage.completion_tokens == 3 * 8
    texts = [c.message.content for c in r.choices]
    # Choice i is seeded seed + i: the same as asking alone with that seed.
    for i in range(3):
        one = client.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                             temperature=1.0, seed=7 + i)
        assert one.choices[0].message.content == texts[i]
    # The prompt's full blocks came from the prefix cache at least once.
    assert r.usage.prompt_tokens_details.cached_tokens >= 16
    streamed = list(client.chat.completions.create(model="m", messages=messages, n=2,
                                                   max_tokens=4, temperature=0, stream=True))
    by_index = {0: "", 1: ""}
    for ch in streamed:
        for c in ch.choices:
            by_index[c.index] += c.delta.content or ""
    assert by_index[0] == by_index[1] != ""


def test_tokenize_round_trip(qwen):
    text = "Hello world, 世界!"
    r = qwen.post("/tokenize", {"content": text})
    assert r.status_code == 200
    ids = r.json()["tokens"]
    assert all(isinstance(i, int) for i in ids)
    back = qwen.post("/detokenize", {"tokens": ids}).json()
    assert back == {"content": text, "prompt": text}
    pieces = qwen.post("/tokenize", {"content": "Hello world", "with_pieces": True}).json()
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"


def test_vllm_tokenizer_endpoints_as_lm_eval_calls_them(qwen):
    """lm-evaluation-harness's remote tokenizer: `/tokenizer_info`, then `/tokenize` with
    vLLM's fields and `/detokenize`'s `prompt`."""
    info = httpx.get(qwen.url + "/tokenizer_info", headers=qwen.headers()).json()
    assert info["eos_token"] == "<|im_end|>" and info["model_max_length"] == QWEN_CTX
    assert "im_start" in info["chat_template"]
    text = "Hello world, 世界!"
    want = qwen.post("/tokenize", {"content": text}).json()["tokens"]
    r = qwen.post("/tokenize", {"prompt": text, "add_special_tokens": False}).json()
    assert (r["tokens"], r["count"], r["max_model_len"]) == (want, len(want), QWEN_CTX)
    eos = qwen.post("/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [151645]  # the special token, parsed as vLLM parses it
    assert qwen.post("/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == text
    assert httpx.get(qwen.url + "/tokenizer_info").status_code == 401


def error_of(r: httpx.Response, status: int, param=None):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"]
    if param is not None:
        assert e["param"] == param, e
    return e


def test_bad_requests_are_400_naming_the_field(qwen):
    url = qwen.url + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=qwen.headers())
    assert error_of(r, 400)["type"] == "invalid_request_error"
    error_of(qwen.post("/v1/chat/completions", {"model": "m"}), 400, "messages")
    error_of(qwen.post("/v1/chat/completions", {"messages": "hi"}), 400, "messages")
    for field, value in [("temperature", "hot"), ("temperature", 5), ("max_tokens", 0),
                         ("max_tokens", "10"), ("n", 0), ("top_p", 2), ("stream", "yes"),
                         ("stop", 3), ("logit_bias", {"abc": 1}), ("seed", "x"),
                         ("top_logprobs", 99)]:
        error_of(qwen.post("/v1/chat/completions", {"messages": CHAT, field: value}), 400,
                 field)
    error_of(qwen.post("/v1/chat/completions",
                       {"messages": [{"role": "wizard", "content": "x"}]}), 400,
             "messages[0].role")
    error_of(qwen.post("/v1/completions", {"prompt": 42}), 400, "prompt")
    error_of(qwen.post("/v1/completions", {}), 400, "prompt")
    error_of(qwen.post("/v1/completions", {"prompt": PROMPT, "logprobs": True}), 400,
             "logprobs")
    # Through the client: a BadRequestError carrying the same body.
    with pytest.raises(openai.BadRequestError) as e:
        qwen.client().chat.completions.create(model="m", messages=CHAT, temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


def test_prompts_over_the_context_are_400_with_the_counts(qwen):
    long = "word " * (QWEN_CTX + 50)
    e = error_of(qwen.post("/v1/completions", {"prompt": long}), 400, "prompt")
    assert e["code"] == "context_length_exceeded" and str(QWEN_CTX) in e["message"]
    e = error_of(qwen.post("/v1/chat/completions",
                           {"messages": [{"role": "user", "content": long}]}), 400, "messages")
    assert e["code"] == "context_length_exceeded"
    # Fits alone, but not with the tokens asked for.
    e = error_of(qwen.post("/v1/completions", {"prompt": PROMPT, "max_tokens": QWEN_CTX}),
                 400, "prompt")
    assert str(QWEN_CTX) in e["message"]
    with pytest.raises(openai.BadRequestError):
        qwen.client().completions.create(model="m", prompt=long)


def test_api_key_and_routes(qwen):
    body = {"messages": CHAT, "max_tokens": 1}
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                    {"Authorization": f"Bearer {API_KEY}x"}]:
        for path, method in [("/v1/chat/completions", "POST"), ("/v1/models", "GET"),
                             ("/v1/completions", "POST"), ("/tokenize", "POST")]:
            r = httpx.request(method, qwen.url + path, json=body, headers=headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=qwen.url + "/v1", api_key="wrong",
                      max_retries=0).models.list()
    # Public for load balancers and scrapers.
    assert httpx.get(qwen.url + "/health").status_code == 200
    assert httpx.get(qwen.url + "/metrics").status_code == 200
    error_of(httpx.get(qwen.url + "/v1/nothing", headers=qwen.headers()), 404)
    error_of(httpx.get(qwen.url + "/nothing"), 404)
    assert error_of(httpx.delete(qwen.url + "/v1/completions", headers=qwen.headers()),
                    405)["code"] == "method_not_allowed"
    # A body over the limit (8 MiB by default).
    big = b'{"messages": "' + b"x" * (9 << 20) + b'"}'
    r = httpx.post(qwen.url + "/v1/chat/completions", content=big,
                   headers={**qwen.headers(), "content-type": "application/json"}, timeout=60)
    error_of(r, 413)


def test_unknown_fields_are_ignored(qwen):
    r = qwen.post("/v1/chat/completions", {
        "messages": CHAT + [{"role": "assistant", "content": [{"type": "text", "text": "Sure"}],
                             "refusal": None}],
        "max_tokens": 2, "temperature": 0, "frobnicate": {"deep": [1, 2]},
        "parallel_tool_calls": True, "response_format": {"type": "text"}, "user": "u1",
        "store": False, "metadata": {"a": "b"}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def wait_idle(server, timeout=10.0):
    """Waits until no sequence runs and no block is held; returns the metrics."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if (m["memra:num_requests_running"] == 0 and m["memra:num_requests_waiting"] == 0
                and m["memra:kv_cache_usage_perc"] == 0):
            return m
        assert time.time() < deadline, m
        time.sleep(0.05)


def wait_running(server, timeout=5.0):
    """Waits until the engine's last published stats show one running sequence (they are
    published once per engine step); returns the metrics."""
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        if m["memra:num_requests_running"] == 1:
            return m
        assert time.time() < deadline, m
        time.sleep(0.01)


def test_disconnect_mid_stream_cancels_the_request(qwen):
    aborted = 'memra:request_success_total{finished_reason="abort"}'
    before = wait_idle(qwen).get(aborted, 0)
    body = {"messages": CHAT, "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", qwen.url + "/v1/chat/completions", json=body,
                      headers=qwen.headers(), timeout=60) as r:
        # Kept referenced: httpx closes the connection when a line iterator is dropped
        # (a `for` loop's `break` does that), which would cancel the request too early.
        lines = r.iter_lines()
        seen = []
        while len(seen) < 4:
            line = next(lines)
            if line.startswith("data: "):
                seen.append(line)
        assert all('"content"' in e for e in seen), seen
        m = wait_running(qwen)
        assert m["memra:kv_cache_usage_perc"] > 0, m
        del lines
    # The client is gone: the sequence ends, its blocks come back.
    m = wait_idle(qwen)
    assert m[aborted] == before + 1
    assert "client went away" in qwen.log
    # A non-streaming client that gives up.
    with pytest.raises(httpx.ReadTimeout):
        qwen.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 500,
                                           "ignore_eos": True}, timeout=1.5)
    m = wait_idle(qwen)
    assert m[aborted] == before + 2
    # And the server goes on.
    assert greedy_chat(qwen.client(), max_tokens=2).usage.completion_tokens == 2


def test_concurrent_requests_equal_their_sequential_results(qwen):
    client = qwen.client()
    prompts = [f"# Task {i}: print the number {i * 7}\n" for i in range(32)]

    def one(p):
        return client.completions.create(model="m", prompt=p, max_tokens=8, temperature=0)

    sequential = [one(p).choices[0].text for p in prompts]
    before = qwen.metrics()
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        concurrent_ = [r.choices[0].text for r in pool.map(one, prompts)]
    assert concurrent_ == sequential
    after = wait_idle(qwen)
    assert (after["memra:generation_tokens_total"]
            - before["memra:generation_tokens_total"]) == 32 * 8


def test_metrics_move_as_requests_run(qwen):
    before = wait_idle(qwen)
    body = {"messages": CHAT, "max_tokens": 40, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", qwen.url + "/v1/chat/completions", json=body,
                      headers=qwen.headers(), timeout=60) as r:
        lines = r.iter_lines()
        # The role, then two tokens: the engine publishes its stats each step, so the
        # second token's step saw the sequence running.
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        during = wait_running(qwen)
        for _ in lines:
            pass
    after = wait_idle(qwen)
    assert during["memra:num_requests_running"] == 1
    assert during["memra:kv_cache_usage_perc"] > 0
    length = 'memra:request_success_total{finished_reason="length"}'
    assert after[length] == before.get(length, 0) + 1
    assert after["memra:generation_tokens_total"] == before["memra:generation_tokens_total"] + 40
    assert after["memra:prompt_tokens_total"] > before["memra:prompt_tokens_total"]
    for h in ["time_to_first_token_seconds", "e2e_request_latency_seconds"]:
        assert after[f"memra:{h}_count"] == before[f"memra:{h}_count"] + 1
    assert (after["memra:inter_token_latency_seconds_count"]
            == before["memra:inter_token_latency_seconds_count"] + 39)
    assert after["memra:prefix_cache_queries_total"] > before["memra:prefix_cache_queries_total"]
    # The same conversation again: its prompt's full blocks are cached.
    greedy_chat(qwen.client(), max_tokens=1)
    greedy_chat(qwen.client(), max_tokens=1)
    assert qwen.metrics()["memra:prefix_cache_hits_total"] > before["memra:prefix_cache_hits_total"]


def test_tools_reach_the_chat_template(qwen):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    plain = greedy_chat(qwen.client(), max_tokens=1)
    with_tools = greedy_chat(qwen.client(), max_tokens=1, tools=tools)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    r = qwen.post("/v1/chat/completions", {"messages": CHAT, "tools": "nope"})
    error_of(r, 400, "tools")


def test_garbage_bodies_get_4xx_and_the_server_goes_on(qwen):
    bodies = [b"", b"null", b"[]", b'"x"', b"1e999", b"{", b"[" * 5000 + b"]" * 5000,
              b'{"messages": ' + b"[" * 300 + b"]" * 300 + b"}", "\u00ff".encode("latin-1"),
              b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 1}',
              b'{"prompt": [99999999999]}', b'{"prompt": [151936000]}',
              b'{"prompt": "", "max_tokens": 1}',
              b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["' + b"s" * 5000
              + b'"], "max_tokens": 1}']
    for path in ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize",
                 "/completion", "/infill"]:
        for body in bodies:
            r = httpx.post(qwen.url + path, content=body,
                           headers={**qwen.headers(), "content-type": "application/json"})
            if r.status_code == 200:  # a body another endpoint would refuse
                continue
            error_of(r, 400)
    assert greedy_chat(qwen.client(), max_tokens=1).usage.completion_tokens == 1
