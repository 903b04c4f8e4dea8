"""The GGUF export's choices, importable without torch (the CLI's parser reads them)."""

#: types of the embedding, the output head and float linears ("auto": llama.cpp's converter's default,
#: bf16 for a bf16 checkpoint, else f16; q8_0, q6_k, q4_k: llama.cpp's own rounding of the float tensor, a
#: width that is no multiple of 256 falling back from q6_k / q4_k to q8_0)
FLOAT_TYPES = ("auto", "f32", "f16", "bf16", "q8_0", "q6_k", "q4_k")
#: the built-in recipes whose grids GGUF holds exactly, by block type
RECIPES_FOR = {"Q4_0": "w4a16-rtn-g32 or w4a16-gptq-g32", "Q4_1": "w4a16-rtn-asym-g32 or w4a16-gptq-asym-g32",
               "Q8_0": "w8a16-rtn-g32 or w8a16-gptq-g32"}
