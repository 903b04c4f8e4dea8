"""The tables of depth_run.sh: quantkit's decode tokens/s at each context and batch beside llama-bench's.

    python evals/kernels/cpu_decoder/depth_table.py OUT_DIR     # reads quantkit.json, llama_bench_{f16,q8_0}.md

quantkit: one decode step of the whole batch at a fixed context (``quantkit bench``, median of the repeats);
tokens/s = batch / step time. llama-bench: ``tg32 @ dN``, 32 tokens generated one at a time after a context
of N tokens (batch 1), mean and standard deviation of its repetitions.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

CACHES = ("f16", "q8_0")
TEST = re.compile(r"tg(\d+) @ d(\d+)")


def llama_bench_rows(path: Path) -> dict[tuple[str, int], float]:
    """(type, depth) -> tokens/s from one llama-bench Markdown table (its 'model' column ends in the type)."""
    rows = {}
    lines = [line for line in path.read_text().splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
        test = TEST.fullmatch(cells["test"])
        if test:
            rows[(cells["model"].split()[-1], int(test[2]))] = float(cells["t/s"].split("±")[0])
    return rows


FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")


def _cpu_words(path: Path) -> str:
    """'Intel(R) Xeon(R) Processor (avx2, avx512f, avx512_vnni; no avx512_bf16, amx_*)' from depth_run's lscpu lines."""
    if not path.exists():
        return "?"
    lines = dict(line.split(":", 1) for line in path.read_text().splitlines() if ":" in line)
    flags = set(lines.get("Flags", "").split())
    have = [f for f in FLAGS if f in flags]
    lack = [f for f in FLAGS if f not in flags]
    return f"{lines.get('Model name', '?').strip()} ({', '.join(have)}; without {', '.join(lack) or 'none'})"


def main(out: Path) -> None:
    bench = json.loads((out / "quantkit.json").read_text())
    decode = bench["decode"]
    names = [v["name"] for v in bench["variants"]]
    contexts = sorted({r["context_len"] for r in decode})
    batches = sorted({r["batch"] for r in decode})
    tps = {(r["variant"], r["batch"], r["context_len"]): r["batch"] / r["median_s"] for r in decode}
    base = bench["baseline"]
    cpu = _cpu_words(out / "cpu.txt")
    print(f"# SmolLM2-135M decode against context and batch: quantkit and llama.cpp, one run\n\nCPU: {cpu}, "
          f"{bench['device'].get('threads', '?')} threads. Command: `bash evals/kernels/cpu_decoder/depth_run.sh`.\n")
    print("quantkit (`quantkit.json`): decode tokens/s (batch / step time), in brackets the speedup over "
          f"{base} with its bf16 cache at the same batch and context.\n")
    print("What each variant ran (from `quantkit.json`): its decode loop and KV cache dtype, and its linears' kernel.\n")
    for v in bench["variants"]:
        modes = sorted({r["mode"] for r in decode if r["variant"] == v["name"]})
        print(f"- {v['name']}: {'; '.join(modes)}; linears: {v.get('kernels') or 'the float model (at::linear)'}")
    print()
    print("| variant | batch | " + " | ".join(f"context {c}" for c in contexts) + " |")
    print("|---|---:|" + "---:|" * len(contexts))
    for name in names:
        for b in batches:
            cells = []
            for c in contexts:
                v = tps.get((name, b, c))
                ref = tps.get((base, b, c))
                cells.append("–" if v is None else f"{v:.1f}" + ("" if name == base or not ref else f" ({v / ref:.2f}x)"))
            print(f"| {name} | {b} | " + " | ".join(cells) + " |")
    llama = {cache: llama_bench_rows(out / f"llama_bench_{cache}.md") for cache in CACHES
             if (out / f"llama_bench_{cache}.md").exists()}
    if not llama:
        return
    depths = sorted({d for rows in llama.values() for _, d in rows})
    print("\nllama.cpp (`llama_bench_{f16,q8_0}.md`): tokens/s at batch 1 after a context of the given depth.\n")
    print("| type | cache | " + " | ".join(f"depth {d}" for d in depths) + " |")
    print("|---|---|" + "---:|" * len(depths))
    for cache, rows in llama.items():
        for t in sorted({t for t, _ in rows}):
            print(f"| {t} | {cache} | " + " | ".join(f"{rows.get((t, d), float('nan')):.1f}" for d in depths) + " |")
    w4_fp8 = next((n for n in names if "kv-fp8" in n), None)
    if w4_fp8 and "q8_0" in llama:
        print("\nquantkit W4 + FP8 KV against llama.cpp Q4_0 with a q8_0 cache, batch 1 (tokens/s ratio):")
        for c in contexts:
            q = llama["q8_0"].get(("Q4_0", c))
            v = tps.get((w4_fp8, 1, c))
            if q and v:
                print(f"- context {c}: {v:.1f} against {q:.1f}: {v / q:.2f}x")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
