"""W4 g128 RTN vs GPTQ vs AWQ on ref:small: calibrated on the training text (64 x 512 tokens, seed 0),
evaluated on the first 32,768 held-out tokens against the float model. Writes evals/calibration/quick-small.json."""
import json
import time

import quantkit
from quantkit.calibration import CalibrationConfig
from quantkit.harness.eval_text import eval_token_windows
from quantkit.harness.quality import evaluate_variants
from quantkit.formats.loading import load_float_model, resolve_model_source


def main() -> dict:
    src = resolve_model_source("ref:small")
    base = load_float_model(src)
    windows = eval_token_windows(src, None, max_tokens=32768, model_config=base.config)
    models, rows = {}, {}
    for r in ["w4a16-rtn", "w4a16-gptq", "w4a16-awq"]:
        m = load_float_model(src)
        t = time.perf_counter()
        quantkit.quantize(m, r, CalibrationConfig(source="ref", num_samples=64, seq_len=512, seed=0), progress=False)
        rows[r] = {"quantize_seconds": time.perf_counter() - t}
        models[r] = m
        print(r, rows[r], flush=True)
    res = evaluate_variants(models, base, windows, progress=False)
    for r in rows:
        rows[r].update(res[r].to_dict())
    print(json.dumps(rows, indent=1))
    with open("evals/calibration/quick-small.json", "w") as f:
        json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
