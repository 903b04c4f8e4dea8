"""`quantkit eval` with every quantized linear on the int8-activation kernel (decode's numerics).

    python evals/kernels/cpu_q8dot_quality.py CHECKPOINT --baseline ref:small --window 512 --max-tokens 32768 \
        --dtype float32 --json OUT.json

An evaluation feeds whole windows (512 tokens) through each linear; on a CPU with native bf16, bf16
windows run the dequantize-once path (exact weights, unrounded activations:
``cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_q8"]``), which is not what a decode step computes. This raises
that switch above any window, so every call rounds its activations to int8 in blocks of 32 as decode
does (elsewhere every call does so already): the quality cost of the activation rounding. Arguments
are `quantkit eval`'s.
"""

import sys

from quantkit.commands.cli import main
from quantkit.kernels import cpu_kernel_choice

cpu_kernel_choice.DEQUANT_MIN_ROWS["cpu_q8"] = 1 << 30
sys.exit(main(["eval", *sys.argv[1:]]))
