"""GB/s of quantkit::wna16_cpu_q8dot at batch 1 with the weights streamed from DRAM, per decode layer.

    python evals/kernels/cpu_decoder/layer_bandwidth.py [LIBRARY.so ...]

Each LIBRARY is a build of the C++ kernels (the cache folder's quantkit_cpu_<key>.so) loaded in its own
process, so two builds can be compared in alternation; with none, the current sources are built and run.
Per layer: more than 256 MiB of weight copies called round-robin (DRAM, not cache), 6 rounds, median;
bytes = int4 weights + fp32 scales; 2 threads, bf16 x, int4 symmetric.
"""

from __future__ import annotations

import subprocess
import sys
import time

LAYERS = [(960, 576, 64), (3072, 576, 64), (576, 1536, 64), (1536, 1024, 128), (5632, 1024, 128),
          (1024, 2816, 128), (49152, 576, 64)]  # (N, K, group): SmolLM2-135M's, then the demo speed model's


def run(library: str | None) -> str:
    import torch

    if library:
        torch.ops.load_library(library)
    else:
        from quantkit.kernels.cpu_extension import load_cpu_kernels

        load_cpu_kernels()
    torch.set_num_threads(2)
    out = []
    for n, k, g in LAYERS:
        nbytes = n * k // 2
        ws = [torch.randint(0, 256, (n, k // 2), dtype=torch.uint8) for _ in range(max(2, min(64, int(300e6 // nbytes))))]
        s = torch.rand(n, k // g) + 0.01
        x = torch.randn(1, k, dtype=torch.bfloat16)
        for w in ws:
            torch.ops.quantkit.wna16_cpu_q8dot(x, w, s, None, None)
        times = []
        for _ in range(6):
            for w in ws:
                t = time.perf_counter()
                torch.ops.quantkit.wna16_cpu_q8dot(x, w, s, None, None)
                times.append(time.perf_counter() - t)
        times.sort()
        out.append(f"{n}x{k}:{nbytes * (1 + 8 / g) / times[len(times) // 2] / 1e9:5.1f}")
    return f"{(library or 'current sources').split('/')[-1]} " + " ".join(out) + " GB/s"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:  # a child: one library per process
        print(run(sys.argv[2] if len(sys.argv) > 2 else None))
    else:
        for lib in sys.argv[1:] or [""]:
            print(subprocess.run([sys.executable, __file__, "--one", *([lib] if lib else [])], capture_output=True,
                                 text=True, check=True).stdout.strip())
