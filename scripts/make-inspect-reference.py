#!/usr/bin/env python3
"""Record what gguf-py (llama.cpp's Python GGUF reader) sees in each model, as the
independent reference for `memra inspect`:  make-inspect-reference.py OUT.json MODEL...
"""
import json
import os
import sys
from collections import defaultdict

from gguf import GGUFReader, GGUFValueType

KEYS = ["context_length", "embedding_length", "block_count", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "attention.key_length",
        "attention.sliding_window", "expert_count", "expert_used_count"]


def scalar(field):
    return field.parts[field.data[0]].tolist()[0]


def main():
    out = {}
    for path in sys.argv[2:]:
        r = GGUFReader(path)
        f = r.fields
        arch = bytes(f["general.architecture"].parts[-1]).decode()
        types = defaultdict(lambda: [0, 0])
        for t in r.tensors:
            types[t.tensor_type.name][0] += 1
            types[t.tensor_type.name][1] += int(t.n_bytes)
        hp = {k: scalar(f[f"{arch}.{k}"]) for k in KEYS if f"{arch}.{k}" in f}
        tok = f.get("tokenizer.ggml.tokens")
        out[os.path.basename(path)] = {
            "architecture": arch,
            "file_size": os.path.getsize(path),
            "tensors": len(r.tensors),
            "metadata_keys": len(f) - 3,  # gguf-py lists the three header fields as fields too
            "types": dict(types),
            "hyperparameters": hp,
            "tokenizer_model": bytes(f["tokenizer.ggml.model"].parts[-1]).decode(),
            "n_tokens": len(tok.data) if tok else 0,
        }
    with open(sys.argv[1], "w") as fh:
        json.dump(out, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
