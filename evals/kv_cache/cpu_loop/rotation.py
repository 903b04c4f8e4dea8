"""Perplexity cost of an FP8 (e4m3) KV cache on SmolLM2-135M at 2k-token windows, with and without an
orthogonal rotation of head_dim before the cache (a normalized 64 x 64 Sylvester-Hadamard matrix H):
keys and values are stored as fp8(x H / s) and read back as (code * s) H^T. Attention is unchanged by
the rotation in exact arithmetic (q k^T = (q H)(k H)^T, and sum_t p_t v_t = (sum_t p_t v_t H) H^T),
so only the rounding differs: the rotation spreads an outlier channel over all 64, which e4m3's 3-bit
mantissa and per-tensor scale handle better.

    python evals/kv_cache/cpu_loop/rotation.py SMOLLM2_BF16_FOLDER --out evals/kv_cache/cpu_loop/rotation.json

The cache is simulated in the attention (fake quantization: what a cache storing those codes would
give, subnormal codes read as 0 as the C++ loop reads them); scales are amax / 448 per tensor (or per
kv head with --per-head) of each layer's keys and values on the calibration text. The model runs in
fp32. Texts as perplexity.py's: GPL-3 (3 windows of 2048 tokens), calibration on Apache-2.0 (512-token
windows).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from perplexity import WINDOW, perplexity  # this folder's script
from quantkit.files.outputs import write_output_file

FP8_MAX, FP8_SMALLEST_NORMAL = 448.0, 2.0 ** -6


def hadamard(n: int) -> torch.Tensor:
    """The normalized Sylvester-Hadamard matrix fp32 [n, n] (n a power of two): orthogonal, H H^T = I."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


class SimulatedCache:
    """Per-layer state of the simulated cache: 'observe' collects amax, 'quantize' rounds k / v."""

    def __init__(self, which: str, rotate: bool, per_head: bool, head_dim: int):
        self.which, self.rotate, self.per_head = which, rotate, per_head
        self.h = hadamard(head_dim) if rotate else None
        self.mode, self.amax = "off", {}

    def _amax(self, x: torch.Tensor) -> torch.Tensor:  # x [B, Hkv, T, D] -> [Hkv] or [1]
        return x.abs().amax(dim=(0, 2, 3)) if self.per_head else x.abs().amax().reshape(1)

    def apply(self, layer: int, name: str, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "off" or name not in self.which:
            return x
        y = x @ self.h if self.rotate else x
        key = (layer, name)
        if self.mode == "observe":
            a = self._amax(y)
            self.amax[key] = torch.maximum(self.amax.get(key, a), a)
            return x
        s = (self.amax[key] / FP8_MAX).clamp_min(1e-12).reshape(1, -1, 1, 1)
        q = (y / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
        q = torch.where(q.abs() < FP8_SMALLEST_NORMAL, 0.0, q) * s
        return q @ self.h.T if self.rotate else q


STATE: SimulatedCache | None = None


def simulated_attention(module, query, key, value, attention_mask, **kwargs):
    key = STATE.apply(module.layer_idx, "k", key)
    value = STATE.apply(module.layer_idx, "v", value)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def main() -> None:
    global STATE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--out", default="evals/kv_cache/cpu_loop/rotation.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(Path("/usr/share/common-licenses/GPL-3").read_text(), return_tensors="pt").input_ids[0]
    calib = tokenizer(Path("/usr/share/common-licenses/Apache-2.0").read_text(), return_tensors="pt").input_ids[0]
    AttentionInterface.register("simulated_fp8_kv", simulated_attention)
    AttentionMaskInterface.register("simulated_fp8_kv", sdpa_mask)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="simulated_fp8_kv")
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    STATE = SimulatedCache("", False, False, head_dim)
    base = perplexity(model, ids)
    rows = []
    for which, rotate, per_head in [("kv", False, False), ("k", False, False), ("v", False, False),
                                    ("kv", True, False), ("k", True, False), ("v", True, False),
                                    ("kv", False, True), ("kv", True, True)]:
        STATE = SimulatedCache(which, rotate, per_head, head_dim)
        STATE.mode = "observe"
        with torch.inference_mode():
            for i in range(0, calib.numel() - 511, 512):
                model(calib[i:i + 512][None])
        STATE.mode = "quantize"
        ppl = perplexity(model, ids)
        rows.append({"fp8": which, "rotation": "hadamard" if rotate else "none",
                     "scales": "per kv head" if per_head else "per tensor", "ppl": ppl, "change": ppl / base - 1})
        print(rows[-1], flush=True)
    lines = [f"fp32 forward, no cache quantization: perplexity {base:.3f}", "",
             "| fp8 | rotation | scales | perplexity | change |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['fp8']} | {r['rotation']} | {r['scales']} | {r['ppl']:.3f} | {100 * r['change']:+.2f}% |" for r in rows]
    result = {"model": args.model, "windows": ids.numel() // WINDOW, "window": WINDOW, "fp32_ppl": base, "rows": rows}
    write_output_file(args.out, json.dumps(result, indent=1) + "\n")
    write_output_file(Path(args.out).with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
