"""GPTQ time of quantkit against llm-compressor's oneshot on one model, the same calibration windows, the
same CPU threads: the time of the quantization call alone (no load, no save), per decoder block.

    python evals/calibration/gptq_time.py MODEL_DIR --samples 16 --seq-len 256 \
        [--llmcompressor-python VENV/bin/python] [--llmcompressor-dtypes float32,bfloat16] [--threads 2] [--json OUT.json]

The windows are quantkit's calibration sampling of the reference text (CalibrationConfig(source="ref")),
written once and given to llm-compressor as token ids (evals/calibration/llmcompressor_gptq.py), which
loads and calibrates the model in each of --llmcompressor-dtypes (default float32). quantkit's calibration
passes run in the model's dtype, or in fp32 on a CPU without native bf16 (calibration.runner.calibration_dtype):
the row names the dtype.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llmcompressor-python")
    p.add_argument("--llmcompressor-dtypes", default="float32", help="comma-separated: float32, bfloat16")
    p.add_argument("--json")
    args = p.parse_args(argv)
    import torch
    from safetensors.torch import save_file

    import quantkit
    from quantkit.calibration import CalibrationConfig
    from quantkit.calibration.data import calibration_batches
    from quantkit.calibration.runner import calibration_dtype
    from quantkit.formats.loading import load_float_model

    torch.set_num_threads(args.threads)
    model = load_float_model(args.model)
    blocks = model.config.num_hidden_layers
    windows = torch.cat(calibration_batches(CalibrationConfig(source="ref", num_samples=args.samples,
                                                              seq_len=args.seq_len), model))
    rows = []
    minmax = (HERE.parents[1] / "recipes" / "w4a16-gptq.yaml").read_text().replace("observer: mse", "observer: minmax")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "w4a16-gptq-minmax.yaml").write_text(minmax)
        for recipe, what in (("w4a16-gptq", "w4a16-gptq (MSE range search)"),
                             (str(Path(tmp) / "w4a16-gptq-minmax.yaml"), "w4a16-gptq with observer: minmax")):
            model = load_float_model(args.model)
            start = time.perf_counter()
            quantkit.quantize(model, recipe, [windows], progress=False)
            seconds = time.perf_counter() - start
            passes = str(calibration_dtype(model.dtype, torch.device("cpu"))).removeprefix("torch.")
            rows.append({"tool": f"quantkit {quantkit.__version__} {what}, passes in {passes}", "seconds": seconds})
    if args.llmcompressor_python:
        for dtype in args.llmcompressor_dtypes.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                save_file({"input_ids": windows.contiguous()}, f"{tmp}/calib.safetensors")
                subprocess.run([args.llmcompressor_python, str(HERE / "llmcompressor_gptq.py"), args.model,
                                f"{tmp}/calib.safetensors", f"{tmp}/out", "W4A16", "memoryless_minmax", dtype], check=True,
                               env={**__import__("os").environ, "OMP_NUM_THREADS": str(args.threads)})
                timing = json.loads(Path(f"{tmp}/out/timing.json").read_text())
            rows.append({"tool": f"llm-compressor {timing['llmcompressor']} GPTQ (W4A16 preset: minmax, actorder static), "
                                 f"model in {dtype}", "seconds": timing["seconds"]})
    print(f"{blocks} blocks, {args.samples} x {args.seq_len} tokens, {args.threads} threads\n")
    print("| tool | seconds | per block | vs quantkit |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['tool']} | {r['seconds']:.1f} | {r['seconds'] / blocks:.1f} | {r['seconds'] / rows[0]['seconds']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"blocks": blocks, "samples": args.samples, "seq_len": args.seq_len,
                                               "threads": args.threads, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
