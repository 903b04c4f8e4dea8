"""What a quantization asks for and what it made: recipes, the recipe.yaml a checkpoint carries, the
census of quantized and float weights, and the summaries printed of them.

Stands on the formats, GGUF, modules, algorithms and core floors; `quantkit.calibration` and
`quantkit.api` stand on it.
"""
