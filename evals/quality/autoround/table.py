"""The results table of run.sh: reads OUT_DIR/{recipe}.json (quantkit eval) and {recipe}.time (/usr/bin/time -v),
writes results.json beside this file and prints the Markdown rows.

    python evals/quality/autoround/table.py OUT_DIR
"""

import json
import re
import sys
from pathlib import Path

RECIPES = ("w4a16-rtn", "w4a16-gptq", "w4a16-autoround")


def _time(path: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MB) of the quantize command."""
    text = path.read_text()
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = 0.0
    for part in clock.split(":"):
        seconds = seconds * 60 + float(part)
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return seconds, rss_kb / 1024


def main(out: Path) -> None:
    rows = []
    for recipe in RECIPES:
        quality = json.loads((out / f"{recipe}.json").read_text())
        seconds, rss = _time(out / f"{recipe}.time")
        rows.append({"recipe": recipe, "kl_divergence": quality["kl_divergence"], "perplexity": quality["perplexity"],
                     "baseline_perplexity": quality["baseline_perplexity"], "top1_agreement": quality["top1_agreement"],
                     "windows": quality["windows"], "window": quality["window"],
                     "quantize_wall_s": seconds, "quantize_peak_rss_mb": rss})
    (Path(__file__).parent / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    rtn = rows[0]["kl_divergence"]
    print("| recipe | KL (nats/token) | KL / RTN | perplexity (float %.2f) | top-1 agree | quantize wall (s) | peak RSS (MB) |"
          % rows[0]["baseline_perplexity"])
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| `{r['recipe']}` | {r['kl_divergence']:.6f} | {r['kl_divergence'] / rtn:.2f}x | {r['perplexity']:.2f} | "
              f"{r['top1_agreement']:.4f} | {r['quantize_wall_s']:.1f} | {r['quantize_peak_rss_mb']:.0f} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
