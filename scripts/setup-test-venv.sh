#!/usr/bin/env bash
# The Python environment of the server tests: the official openai client, httpx and
# pytest at pinned versions, in a virtual environment cached outside the checkout
# ($MEMRA_VENV, default ~/.cache/memra/venv); prints its path. Rebuilt when the pins change.
set -euo pipefail
venv=${MEMRA_VENV:-$HOME/.cache/memra/venv}
py=${PYTHON:-python3}
pins="openai==3.57.0 httpx==0.28.1 pytest==9.2.0 jsonschema==4.26.0"
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.memra-pins" 2>/dev/null)" != "$pins" ]; then
  rm -rf "$venv"
  "$py" -m venv "$venv" >&2
  # shellcheck disable=SC2086
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check $pins >&2
  echo "$pins" > "$venv/.memra-pins"
fi
echo "$venv"
