"""`/v1/embeddings` through the official `openai` client (which asks for base64) and raw
HTTP: shapes, usage, a batch equal to its inputs alone, token-id inputs, normalization,
mean pooling against the last states of the prompt's prefixes (two tiny-model servers),
and every refusal with its status and field."""

import math

import httpx

from conftest import QWEN_CTX, TINY

QWEN_EMBD = 896
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "SELECT name FROM users WHERE id = 1;",
]


def embed(server, body) -> httpx.Response:
    return server.post("/v1/embeddings", {"model": "m", **body})


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


def assert_close(got, want, atol=1e-5, rtol=0.0):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= atol + rtol * abs(w), f"element {i}: {g} against {w}"


def test_client_shapes_usage_and_unit_norm(qwen):
    r = qwen.client().embeddings.create(model="m", input=TEXTS[0])
    assert r.object == "list" and r.model == "m"
    (d,) = r.data
    assert d.object == "embedding" and d.index == 0
    assert len(d.embedding) == QWEN_EMBD
    assert abs(norm(d.embedding) - 1) < 1e-4
    n_tokens = qwen.post("/tokenize", {"prompt": TEXTS[0]}).json()["count"]
    assert r.usage.prompt_tokens == n_tokens == r.usage.total_tokens


def test_a_batch_equals_its_inputs_alone_and_base64_equals_floats(qwen):
    alone = []
    for t in TEXTS:
        r = embed(qwen, {"input": t, "encoding_format": "float"})
        assert r.status_code == 200, r.text
        alone.append(r.json()["data"][0]["embedding"])
    # The client decodes base64 (its default) into floats.
    batch = qwen.client().embeddings.create(model="m", input=TEXTS)
    assert [d.index for d in batch.data] == [0, 1, 2]
    for d, want in zip(batch.data, alone):
        assert_close(d.embedding, want)
    # More inputs than the engine runs at once (they go in windows), in order.
    many = qwen.client().embeddings.create(model="m", input=TEXTS * 14)
    assert [d.index for d in many.data] == list(range(42))
    for d in many.data:
        assert_close(d.embedding, alone[d.index % 3])
    # Different texts, different vectors.
    assert sum(a * b for a, b in zip(alone[0], alone[1])) < 0.9999


def test_token_ids_equal_text(qwen):
    ids = qwen.post("/tokenize", {"prompt": TEXTS[1]}).json()["tokens"]
    by_text = embed(qwen, {"input": TEXTS[1], "encoding_format": "float"}).json()
    by_ids = embed(qwen, {"input": ids, "encoding_format": "float"}).json()
    nested = embed(qwen, {"input": [ids, ids], "encoding_format": "float"}).json()
    want = by_text["data"][0]["embedding"]
    assert_close(by_ids["data"][0]["embedding"], want)
    assert len(nested["data"]) == 2
    assert_close(nested["data"][1]["embedding"], want)
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_normalization_as_llama_server(qwen):
    def get(n):
        body = {"input": TEXTS[2], "encoding_format": "float", "embd_normalize": n}
        return embed(qwen, body).json()["data"][0]["embedding"]

    raw = get(-1)
    assert abs(norm(raw) - 1) > 1e-3  # the model's state, not a unit vector
    assert_close(get(2), [x / norm(raw) for x in raw])
    taxicab = sum(abs(x) for x in raw)
    assert_close(get(1), [x / taxicab for x in raw], atol=1e-6)
    top = max(abs(x) for x in raw)
    assert_close(get(0), [x * 32760 / top for x in raw], atol=1e-3, rtol=1e-4)


def test_mean_pooling_is_the_mean_of_the_prefixes_last_states(spawn):
    last = spawn(TINY, "-c", "128", "--embeddings", "--pooling", "last")
    mean = spawn(TINY, "-c", "128", "--embeddings", "--pooling", "mean")
    assert "embeddings with mean pooling" in mean.log
    ids = [5, 17, 42, 99, 7, 3]
    raw = {"encoding_format": "float", "embd_normalize": -1}
    prefixes = embed(last, {"input": [ids[:i] for i in range(1, len(ids) + 1)], **raw})
    states = [d["embedding"] for d in prefixes.json()["data"]]
    want = [sum(col) / len(states) for col in zip(*states)]
    got = embed(mean, {"input": ids, **raw}).json()["data"][0]["embedding"]
    assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_refusals_name_their_field(qwen):
    cases = [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": ["a"] * 2049}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": "x", "dimensions": "896"}, "dimensions"),
        ({"input": "x", "embd_normalize": 99}, "embd_normalize"),
        ({"input": [151_936 + 5]}, "input"),
    ]
    for body, field in cases:
        r = embed(qwen, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["type"] == "invalid_request_error", (body, err)
    ok = embed(qwen, {"input": "x", "dimensions": QWEN_EMBD, "encoding_format": "float"})
    assert ok.status_code == 200
    too_long = embed(qwen, {"input": [100] * (QWEN_CTX + 1)})
    assert too_long.status_code == 400
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.post(qwen.url + "/v1/embeddings", json={"input": "x"}).status_code == 401
    bad_json = httpx.post(qwen.url + "/v1/embeddings", content=b"{", headers=qwen.headers())
    assert bad_json.status_code == 400


def test_a_server_without_embeddings_says_so(tiny):
    r = httpx.post(tiny.url + "/v1/embeddings", json={"input": "hello"})
    assert r.status_code == 501
    assert "--embeddings" in r.json()["error"]["message"]
    # Its completions are unaffected.
    assert httpx.post(tiny.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def with_bool_key(src, dst, key: str, value: bool):
    """A copy of the GGUF file `src` at `dst` with one more metadata key (a bool): the
    header re-written, the tensor data moved to the next aligned offset."""
    import struct

    data = src.read_bytes()
    pos = 24
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", data, 0)
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip_value(pos, ty):
        if ty == 8:
            (n,) = struct.unpack_from("<Q", data, pos)
            return pos + 8 + n
        if ty == 9:
            ety, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for _ in range(count):
                pos = skip_value(pos, ety)
            return pos
        return pos + sizes[ty]

    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (ty,) = struct.unpack_from("<I", data, pos)
        pos = skip_value(pos + 4, ty)
    kv_end = pos
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        (dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * dims + 4 + 8
    align = 32
    data_start = (pos + align - 1) // align * align
    k = key.encode()
    extra = struct.pack("<Q", len(k)) + k + struct.pack("<IB", 7, int(value))
    header = (struct.pack("<IIQQ", magic, version, n_tensors, n_kv + 1) + data[24:kv_end]
              + extra + data[kv_end:pos])
    header += b"\0" * (-len(header) % align)
    dst.write_bytes(header + data[data_start:])


def test_a_model_that_attends_both_ways_is_refused(tmp_path, spawn):
    import subprocess

    from conftest import free_port, memra_bin

    path = tmp_path / "bidirectional.gguf"
    with_bool_key(TINY, path, "llama.attention.causal", False)
    # The file still loads and serves completions without --embeddings ...
    plain = spawn(path)
    assert httpx.post(plain.url + "/v1/completions",
                      json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    # ... and with it the server stops with the reason.
    cmd = [memra_bin(), "serve", "-m", str(path), "--device", "cpu",
           "--port", str(free_port()), "--embeddings"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "attention is not causal" in r.stderr, r.stderr
