#!/usr/bin/env bash
# The test suite: fetches the real models it checks against (cached), then runs every
# test of the workspace, then the server's tests (pytest with the official openai client
# against `memra serve`, in a cached virtual environment). Needs ../shared (golden outputs,
# tiny models) beside the checkout, or MEMRA_SHARED pointing at it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/fetch-models.sh --all
cargo test --workspace --release "$@"
cargo build --release -p memra
venv=$(scripts/setup-test-venv.sh)
PYTHONDONTWRITEBYTECODE=1 MEMRA_BIN="${CARGO_TARGET_DIR:-$root/target}/release/memra" \
  "$venv/bin/python" -m pytest -q -p no:cacheprovider crates/memra-server/tests-py
