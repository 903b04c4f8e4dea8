"""Built-in quantization recipes (YAML files, looked up by stem)."""
