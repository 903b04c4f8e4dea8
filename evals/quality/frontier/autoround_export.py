"""One GGUF file from auto-round (Intel's AutoRound, the `auto-round` package): its SignRound tuning of one float
model, then its own GGUF export, for frontier.py's method `auto-round`.

Run by the Python of an environment that has auto-round (frontier.py's --autoround-python; see the README's
auto-round section), with one thread:

    python evals/quality/frontier/autoround_export.py --model /tmp/smollm2-float --type Q4_K_M \
        --windows WORK/calibration-windows.json --iters 50 --lr 0.005 --out WORK/Q4_K_M-auto-round.gguf

--windows: a JSON list of token-id lists, the calibration windows (frontier.py writes the 16 windows of 256 that
`quantkit quantize --calib-samples 16 --calib-seq-len 256` takes); auto-round gets them as token tensors
[1, L] (its `dataset=` takes a list of token tensors) with nsamples = their count and seqlen = their length,
so it reads no dataset of its own. The file auto-round writes under a scratch folder is moved to --out.
Prints one JSON line at the end: {"auto_round_version", "format", "iters", "nsamples", "seqlen", ...}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

#: llama.cpp's type (frontier.py's names) -> auto-round's GGUF format. auto-round writes no plain Q2_K mix
#: (gguf:q2_k_mixed is for MoE models, and falls back to gguf:q2_k_s on others): Q2_K is its Q2_K_S.
FORMATS = {
    "Q2_K": "gguf:q2_k_s",
    "Q3_K_S": "gguf:q3_k_s",
    "Q3_K_M": "gguf:q3_k_m",
    "Q3_K_L": "gguf:q3_k_l",
    "Q4_K_S": "gguf:q4_k_s",
    "Q4_K_M": "gguf:q4_k_m",
    "Q5_K_S": "gguf:q5_k_s",
    "Q5_K_M": "gguf:q5_k_m",
    "Q6_K": "gguf:q6_k",
    "Q4_0": "gguf:q4_0",
    "Q4_1": "gguf:q4_1",
    "Q8_0": "gguf:q8_0",
}


def _name_unknown_pre_tokenizers(folder: Path) -> None:
    """auto-round's GGUF converter (llama.cpp's convert_hf_to_gguf) names a BPE tokenizer's pre-tokenizer only from
    its table of published models' hashes and raises NotImplementedError for any other (quantkit's reference
    models). Where it would, the name comes from quantkit's GGUF writer's rule (the same table, else "gpt-2" for a
    plain byte-level pre-tokenizer), so that auto-round writes the file quantkit's own export would name."""
    from auto_round.export.export_to_gguf.llama_cpp_conversion import get_conversion

    from quantkit.gguf.writing import pre_tokenizer_name

    get_conversion(model_path=folder)  # imports the converter as the top-level package `conversion`, kept for the export
    base = sys.modules["conversion.base"]
    known = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            return pre_tokenizer_name(tokenizer, json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")))

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the float model's Hugging Face folder")
    parser.add_argument("--type", required=True, choices=sorted(FORMATS), help="llama.cpp type of the file")
    parser.add_argument("--windows", type=Path, required=True, help="JSON list of calibration windows (token ids)")
    parser.add_argument("--out", type=Path, required=True, help="the GGUF file to write")
    parser.add_argument("--iters", type=int, default=200, help="SignRound iterations per block (auto-round's "
                                                                "default 200; 0: its optimized RTN)")
    parser.add_argument("--lr", type=float, default=None, help="SignRound's learning rate (auto-round's default: "
                                                               "1 / iters; its light recipe: 50 iters at 0.005)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows per iteration (auto-round's default 8)")
    parser.add_argument("--seed", type=int, default=42, help="auto-round's seed (its default 42)")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    import auto_round
    from auto_round import AutoRound
    from transformers import AutoTokenizer

    _name_unknown_pre_tokenizers(Path(args.model))

    windows = json.loads(args.windows.read_text())
    lengths = {len(w) for w in windows}
    if len(lengths) != 1:
        raise SystemExit(f"{args.windows}: windows of several lengths {sorted(lengths)}")
    seqlen = lengths.pop()
    dataset = [torch.tensor([w], dtype=torch.int64) for w in windows]  # [1, L] each
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    fmt = FORMATS[args.type]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="autoround-", dir=args.out.parent) as scratch:
        ar = AutoRound(args.model, tokenizer, scheme=fmt.upper(), dataset=dataset, iters=args.iters, lr=args.lr,
                       nsamples=len(dataset), seqlen=seqlen, batch_size=min(args.batch_size, len(dataset)),
                       seed=args.seed, device_map="cpu", enable_torch_compile=False)
        ar.quantize_and_save(scratch, format=fmt)
        written = sorted(Path(scratch).rglob("*.gguf"))
        if len(written) != 1:
            raise SystemExit(f"auto-round wrote {len(written)} GGUF files under {scratch}: {written}")
        shutil.move(str(written[0]), args.out)
    print(json.dumps({"auto_round_version": auto_round.__version__, "torch": torch.__version__, "format": fmt,
                      "iters": args.iters, "lr": args.lr, "nsamples": len(dataset), "seqlen": seqlen,
                      "batch_size": min(args.batch_size, len(dataset)), "seed": args.seed,
                      "wrote": written[0].name, "seconds": round(time.perf_counter() - start, 1)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
