"""quantkit: INT8/INT4 weight and FP8 KV-cache quantization for fast LLM decoding."""
