"""llama.cpp's own quantizer as the GGUF evals run it: the command lines, one home for both callers.

- the float model as GGUF: `quantkit export MODEL --format gguf --float-type f32` (llama.cpp's
  convert_hf_to_gguf.py does not know the reference models' tokenizer), or, given llama.cpp's source,
  its `convert_hf_to_gguf.py --outtype bf16` (a bf16 model as it ships);
- `llama-imatrix` on the calibration text: 8 chunks of 512 tokens (the 4096 calibration tokens quantkit's
  GPTQ takes as 16 windows of 256);
- `llama-quantize [--imatrix FILE] FLOAT OUT TYPE THREADS`, and llama.cpp's Q4_K laid out as quantkit's
  export (`--pure`, Q4_1 where the inputs are no whole super-block, the token embedding's type given).

evals/gguf/compare.py and evals/quality/frontier/frontier.py import these and run the commands with their
own logs and caches.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

#: llama-imatrix's chunks: 8 x 512 = 4096 tokens of calibration text
IMATRIX_CHUNK, IMATRIX_CHUNKS = 512, 8
#: llama.cpp's Q8_0 quantizer takes no importance matrix (llama-quantize --imatrix writes the same file)
IGNORES_IMATRIX = frozenset({"Q8_0"})
#: the file types llama-quantize names, Q2_K to Q8_0 (its `TYPE` argument)
FILE_TYPES = ("Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M",
              "Q6_K", "Q8_0")


def float_gguf_command(folder: str | Path, out: Path, llama_src: str | Path | None = None) -> list[str]:
    """The command that writes the float model `folder` as GGUF to `out`: quantkit's export in float32, or
    llama.cpp's own converter in bf16 where `llama_src` (llama.cpp's source tree) is given."""
    if llama_src is not None:
        return [sys.executable, str(Path(llama_src) / "convert_hf_to_gguf.py"), str(folder), "--outfile", str(out),
                "--outtype", "bf16"]
    return [sys.executable, "-m", "quantkit", "export", str(folder), "--format", "gguf", "--out", str(out),
            "--float-type", "f32"]


def imatrix_command(bins: Path, float_gguf: Path, calibration_text: Path, out: Path, threads: int = 2) -> list[str]:
    """`llama-imatrix` on the calibration text (8 chunks of 512 tokens), its matrix to `out`."""
    return [str(Path(bins) / "llama-imatrix"), "-m", str(float_gguf), "-f", str(calibration_text), "-o", str(out),
            "-c", str(IMATRIX_CHUNK), "--chunks", str(IMATRIX_CHUNKS), "-t", str(threads)]


def quantize_command(bins: Path, float_gguf: Path, out: Path, file_type: str, imatrix: Path | None = None,
                     threads: int = 2) -> list[str]:
    """`llama-quantize [--imatrix FILE] FLOAT OUT TYPE THREADS`: one of llama-quantize's own file types."""
    return ([str(Path(bins) / "llama-quantize")] + (["--imatrix", str(imatrix)] if imatrix is not None else []) +
            [str(float_gguf), str(out), file_type, str(threads)])


def quantkit_layout_q4k_command(bins: Path, float_gguf: Path, out: Path, folder: str | Path, embedding: str,
                                imatrix: Path | None = None, threads: int = 2) -> list[str]:
    """llama.cpp's Q4_K laid out as quantkit's export is: every linear Q4_K (`--pure`: no mix), Q4_1 where the
    inputs are no whole super-block (quantkit's fallback; llama-quantize's own is Q5_0), the token embedding
    `embedding` (q8_0 / q6_k): the same types tensor by tensor as quantkit's Q4_K file."""
    return ([str(Path(bins) / "llama-quantize"), "--pure", "--token-embedding-type", embedding] +
            [a for t in same_layout_overrides(folder) for a in ("--tensor-type", f"{t}=q4_1")] +
            (["--imatrix", str(imatrix)] if imatrix is not None else []) +
            [str(float_gguf), str(out), "Q4_K_S", str(threads)])


def same_layout_overrides(folder: str | Path) -> list[str]:
    """GGUF tensor kinds whose inputs are no whole Q4_K super-block (256) in the model of `folder`."""
    config = json.loads((Path(folder) / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    inputs = {"attn_q": hidden, "attn_k": hidden, "attn_v": hidden, "attn_output": heads, "ffn_gate": hidden,
              "ffn_up": hidden, "ffn_down": inter}
    return [kind for kind, k in inputs.items() if k % 256]


def build_of(log_text: str) -> str | None:
    """The llama.cpp build a llama-quantize log names ("0.5.0-dev (build 1, commit 0c1e570)": its version, build
    number and commit; the older "build = 6750 (1f5accb8d)" as "build 6750, commit 1f5accb8d"), or None."""
    match = re.search(r"^version: (\S+ \(build \d+, commit \w+\))", log_text, re.MULTILINE)
    if match:
        return match.group(1)
    match = re.search(r"build\s*=\s*(\d+)\s*\((\w+)\)", log_text)
    return f"build {match.group(1)}, commit {match.group(2)}" if match else None
