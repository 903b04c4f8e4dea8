"""Files in and out, whatever they hold: small input files read safely, outputs written whole or not at
all, and the check that a float model holds exactly its source's tensors.

Stands on `quantkit.core` (and beside `quantkit.refmodels`, the built-in reference models).
"""
