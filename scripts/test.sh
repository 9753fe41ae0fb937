#!/usr/bin/env bash
# The test suite: fetches the real models it checks against (cached), then runs every
# test of the workspace. Needs ../shared (golden outputs, tiny models) beside the checkout,
# or MEMRA_SHARED pointing at it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
scripts/fetch-models.sh --all
cargo test --workspace --release "$@"
