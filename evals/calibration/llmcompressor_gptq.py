"""llm-compressor's GPTQ on the same model and calibration windows, for the side-by-side table.

Runs in an environment where `llmcompressor` is installed (it pins transformers <= 5.17, so keep it out
of quantkit's environment):

    python -m venv --system-site-packages VENV && VENV/bin/pip install llmcompressor==0.14.0.1 torch==2.13.0
    VENV/bin/python evals/calibration/llmcompressor_gptq.py MODEL_DIR CALIB.safetensors OUT_DIR [SCHEME [OBSERVER [DTYPE]]]

CALIB.safetensors holds `input_ids` int64 [N, L] (written by compare.py, the exact windows quantkit
calibrates on). SCHEME: an llm-compressor preset (default W4A16), or a quantkit checkpoint folder whose
config groups (per-layer group sizes) llm-compressor should use. OBSERVER: how llm-compressor picks the
weights' ranges with those config groups (default memoryless_minmax, its default; memoryless_mse: its
MSE grid search). DTYPE: the dtype the model is loaded and calibrated in (default float32;
bfloat16: the model's own). Writes a compressed-tensors checkpoint to OUT_DIR and OUT_DIR/timing.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path


def main(model_dir: str, calib_file: str, out_dir: str, scheme: str = "W4A16", observer: str = "memoryless_minmax",
         dtype: str = "float32") -> int:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import llmcompressor

    torch.set_num_threads(int(torch.get_num_threads()))
    ids = load_file(calib_file)["input_ids"]  # [N, L]
    n, length = ids.shape
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    groups = _config_groups(Path(scheme), observer) if Path(scheme).is_dir() else None
    chosen = {"config_groups": groups} if groups else {"targets": "Linear", "scheme": scheme}
    recipe = GPTQModifier(**chosen, ignore=["lm_head"], block_size=128, dampening_frac=0.01, actorder="static")
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    oneshot(model=model, tokenizer=tokenizer, dataset=data, recipe=recipe, num_calibration_samples=n, max_seq_length=length,
            shuffle_calibration_samples=False)
    seconds = time.perf_counter() - start
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (Path(model_dir) / name).is_file():
            shutil.copy2(Path(model_dir) / name, out / name)
    (out / "timing.json").write_text(json.dumps({
        "seconds": seconds, "llmcompressor": llmcompressor.__version__,
        "scheme": f"config groups of {scheme}" if groups else scheme, "actorder": "static",
        "observer": observer if groups else "the preset's",
        "dampening_frac": 0.01, "block_size": 128, "samples": n, "seq_len": length, "dtype": dtype,
    }, indent=2) + "\n")
    return 0


def _config_groups(checkpoint: Path, observer: str) -> dict:
    """The weight config groups of a quantkit checkpoint's quantization_config, as llm-compressor takes them
    (same targets, bits, symmetry and group size per layer; GPTQ with static act-order; `observer` for the ranges)."""
    config = json.loads((checkpoint / "config.json").read_text())["quantization_config"]
    groups = {}
    for name, group in config["config_groups"].items():
        weights = {k: group["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy", "group_size")}
        groups[name] = {"targets": group["targets"], "weights": {**weights, "actorder": None, "observer": observer}}
    return groups


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
