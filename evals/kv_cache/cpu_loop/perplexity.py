"""Perplexity cost of the FP8 KV cache on SmolLM2-135M at 2k-token windows: the model's own bf16 forward
against the same forward with quantkit's FP8 cache (k/v scales per tensor, or per kv head with
--per-head, calibrated on another text),
which stores the values the C++ loop's fp8 cache stores.

    python evals/kv_cache/cpu_loop/perplexity.py SMOLLM2_BF16_FOLDER [--per-head] --out evals/kv_cache/cpu_loop/perplexity.json

With --rotation hadamard the scales are calibrated in both bases in one pass and the cache is measured
without and with the Hadamard rotation of head_dim (quantkit.modules.kv_rotation), side by side.

Evaluation text: /usr/share/common-licenses/GPL-3 (3 windows of 2048 tokens); calibration:
/usr/share/common-licenses/Apache-2.0 (windows of 512 tokens).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from transformers import AutoTokenizer

import quantkit
from quantkit.calibration.kv_scales import quantize_kv_cache
from quantkit.modules.kv_cache import enable_fp8_kv_cache
from quantkit.modules.kv_scales import ROTATION_ATTRIBUTE
from quantkit.files.outputs import write_output_file

WINDOW = 2048


def perplexity(model, ids: torch.Tensor) -> float:
    nll, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, ids.numel() - WINDOW + 1, WINDOW):
            window = ids[start:start + WINDOW][None]
            logits = model(window).logits[0, :-1].float()
            nll += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
            count += WINDOW - 1
    return math.exp(nll / count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--per-head", action="store_true")
    parser.add_argument("--rotation", choices=("none", "hadamard"), default="none")
    parser.add_argument("--out", default="evals/kv_cache/cpu_loop/perplexity.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    ids = tokenizer(Path("/usr/share/common-licenses/GPL-3").read_text(), return_tensors="pt").input_ids[0]
    calib = tokenizer(Path("/usr/share/common-licenses/Apache-2.0").read_text(), return_tensors="pt").input_ids[0]
    model = quantkit.load(args.model, dtype=torch.bfloat16)
    base = perplexity(model, ids)
    batches = [calib[i:i + 512][None] for i in range(0, calib.numel() - 511, 512)]
    quantize_kv_cache(model, batches, per_head=args.per_head, rotation=args.rotation)
    enable_fp8_kv_cache(model, attention="dequantize")
    setattr(model, ROTATION_ATTRIBUTE, "none")  # the unrotated cache first (its scales: k_scale / v_scale)
    fp8 = perplexity(model, ids)
    result = {"model": args.model, "per_head": args.per_head, "windows": ids.numel() // WINDOW, "window": WINDOW,
              "bf16_ppl": base, "fp8_kv_ppl": fp8, "change": fp8 / base - 1}
    if args.rotation != "none":
        setattr(model, ROTATION_ATTRIBUTE, args.rotation)  # the rotated cache (k_scale_rotated / v_scale_rotated)
        rotated = perplexity(model, ids)
        result.update({"rotation": args.rotation, "fp8_kv_rotated_ppl": rotated, "rotated_change": rotated / base - 1})
    write_output_file(args.out, json.dumps(result, indent=1) + "\n")
    print(result)


if __name__ == "__main__":
    main()
