#!/usr/bin/env python3
"""Record dequantization reference data with the `gguf` Python package (gguf-py, the
llama.cpp project's own implementation, independent of memra's Rust code).

    scripts/make-quant-reference.py OUT.json MODEL.gguf...

For every model: for each tensor type present, up to two tensors: the first 256 values
exactly, and sum / sum of squares over the first rows (up to 2M values). Plus synthetic
random blocks of every type gguf-py can dequantize, with valid f16 scale fields.
Run it with gguf==0.19.0 and numpy; the result is committed as test data.
"""
import json
import os
import sys

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFReader, quants

FIRST_VALUES = 256
STAT_VALUES = 2_000_000

# Byte offsets of f16 scale fields inside each block, so random blocks hold finite scales.
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.TQ1_0: [52], T.TQ2_0: [64], T.MXFP4: [],
    T.IQ2_XXS: [0], T.IQ2_XS: [0], T.IQ2_S: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ1_S: [0],
    T.IQ1_M: [],
}


def floats(a):
    # Nine significant digits identify an f32 exactly.
    return [float(f"{x:.9g}") for x in np.asarray(a, dtype=np.float32).ravel()]


def model_cases(path):
    r = GGUFReader(path)
    seen = {}
    out = []
    for t in r.tensors:
        qt = T(t.tensor_type)
        if seen.get(qt, 0) >= 2:
            continue
        seen[qt] = seen.get(qt, 0) + 1
        raw = np.asarray(t.data)
        row_elems = int(t.shape[0])
        # gguf-py returns quantized data as uint8 rows of bytes, plain types as values.
        rows = raw.reshape(-1, raw.shape[-1])
        n_rows = max(1, min(rows.shape[0], STAT_VALUES // row_elems))
        part = rows[:n_rows]
        if qt in (T.F32, T.F16, T.BF16):
            if qt == T.BF16:
                vals = quants.dequantize(part.view(np.uint8), qt)
            else:
                vals = part.astype(np.float32)
        else:
            vals = quants.dequantize(part, qt)
        vals = vals.astype(np.float64).ravel()
        out.append({
            "file": os.path.basename(path),
            "tensor": t.name,
            "type": qt.name,
            "rows": n_rows,
            "row_elements": row_elems,
            "first": floats(vals[:FIRST_VALUES]),
            "sum": float(vals.sum()),
            "sum_sq": float((vals * vals).sum()),
        })
    return out


def synthetic_cases(rng):
    out = []
    for qt in sorted(set(F16_FIELDS) | {T.F16, T.BF16}, key=lambda q: q.value):
        block, size = quants.GGML_QUANT_SIZES[qt]
        n_blocks = 16
        raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
        for off in F16_FIELDS.get(qt, []):
            scale = (rng.uniform(0.001, 0.1, n_blocks) * rng.choice([-1, 1], n_blocks)).astype(np.float16)
            raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
        if qt == T.IQ1_M:
            # The f16 scale is spread over the top nibbles of the four u16 scale words.
            for b in range(n_blocks):
                d = int(np.float16(rng.uniform(0.001, 0.1)).view(np.uint16))
                for k in range(4):
                    at = 48 + 2 * k + 1
                    raw[b, at] = (raw[b, at] & 0x0F) | (((d >> (4 * k)) & 0xF) << 4)
        if qt == T.F16:
            raw = rng.normal(0, 2, n_blocks * size // 2).astype(np.float16).view(np.uint8).reshape(n_blocks, size)
        if qt == T.BF16:
            f = rng.normal(0, 2, n_blocks * size // 2).astype(np.float32).view(np.uint32) >> 16
            raw = f.astype(np.uint16).view(np.uint8).reshape(n_blocks, size)
        vals = quants.dequantize(raw.reshape(1, -1), qt).ravel()
        out.append({"type": qt.name, "hex": raw.tobytes().hex(), "values": floats(vals)})
    return out


def main():
    out_path, models = sys.argv[1], sys.argv[2:]
    rng = np.random.default_rng(20261130)
    cases = []
    for m in models:
        cases += model_cases(m)
        print(f"{m}: {len(cases)} cases so far", file=sys.stderr)
    doc = {"generator": "gguf-py 0.19.0 quants.dequantize", "models": cases,
           "synthetic": synthetic_cases(rng)}
    with open(out_path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))


if __name__ == "__main__":
    main()
