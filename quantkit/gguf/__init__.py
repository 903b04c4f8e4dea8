"""GGUF, llama.cpp's file format: its block types and their byte layouts (blocks), the grids quantkit
quantizes onto (grids) with llama.cpp's own reference quantizers (reference_quants), llama-quantize's
mixes (mix), the layer that holds such weights (linear), the writer (writing, with choices,
pretokenizers and sentencepiece for the tokenizer) and the reader (reading)."""
