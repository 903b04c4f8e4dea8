"""`python -m quantkit ...`: the quantkit command (also what `torchrun -m quantkit quantize ...` runs)."""

import sys

from quantkit.commands.cli import main

sys.exit(main())
