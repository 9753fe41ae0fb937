"""Fixtures: real `memra serve` processes on 127.0.0.1 (free ports), on the CPU.

- `qwen`: Qwen2.5-Coder 0.5B Instruct (from the model cache), with an API key and
  `/v1/embeddings`;
- `tiny`: a tiny random-weight llama from shared/golden/tiny, for load and queue tests;
- `spawn`: starts a server of one's own (queue limits, shutdown).

The binary is $MEMRA_BIN, else $CARGO_TARGET_DIR/release/memra, else target/release/memra.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[3]
API_KEY = "test-key-0123"
QWEN_CTX = 1024
QWEN_PARALLEL = 16


def memra_bin() -> str:
    if os.environ.get("MEMRA_BIN"):
        return os.environ["MEMRA_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return str(target / "release" / "memra")


def shared_dir() -> Path:
    return Path(os.environ.get("MEMRA_SHARED", ROOT.parent / "shared"))


def models_dir() -> Path:
    return Path(os.environ.get("MEMRA_MODELS", Path.home() / ".cache/memra/models"))


QWEN = models_dir() / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
TINY = shared_dir() / "golden/tiny/tiny-llama.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `memra serve` process; `log` is its stderr so far."""

    def __init__(self, model: Path, *args: str, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [memra_bin(), "serve", "-m", str(model), "--device", "cpu",
               "--port", str(self.port), *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"memra-serve-{self.port}.log"
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT)
        self.saw_loading = False
        deadline = time.time() + 120
        while True:
            assert self.proc.poll() is None, f"memra serve exited:\n{self.log}"
            assert time.time() < deadline, f"memra serve not ready:\n{self.log}"
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 503:
                    self.saw_loading = True
                    assert r.json()["error"]["message"] == "Loading model"
                elif r.status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.02)

    @property
    def log(self) -> str:
        self.log_file.flush()
        return self.log_path.read_text(errors="replace")

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def post(self, path: str, body, **kw) -> httpx.Response:
        kw.setdefault("timeout", 120)
        return httpx.post(self.url + path, json=body, headers=self.headers(), **kw)

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                             max_retries=0, timeout=120, **kw)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "none",
                                  max_retries=0, timeout=300)

    def metrics(self) -> dict:
        """The Prometheus exposition as {sample name with labels: value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self, sig=signal.SIGTERM, timeout=30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log_file.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def qwen():
    assert QWEN.is_file(), f"{QWEN} missing: run scripts/fetch-models.sh"
    s = Server(QWEN, "-c", str(QWEN_CTX), "-np", str(QWEN_PARALLEL), "--embeddings",
               api_key=API_KEY)
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture(scope="session")
def tiny():
    s = Server(TINY, "-c", "256", "-np", "32")
    yield s
    assert s.stop() == 0, s.log


@pytest.fixture
def spawn():
    started = []

    def start(model: Path, *args: str, **kw) -> Server:
        s = Server(model, *args, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop(signal.SIGKILL)
