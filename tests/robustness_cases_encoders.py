"""Encoders, classifiers and base models, FP8 KV caches that cannot be, impossible MoE configs, caches, rooflines."""

from __future__ import annotations

import json
import os
from pathlib import Path

from quantkit.errors import CheckpointError, QuantizationError, UsageError

from .robustness_cases import Case, PythonCase

#: one short prefill and decode step, timed once
BENCH_SMALL = ["--prompt-lens", "8", "--context-lens", "8", "--batch-sizes", "1", "--warmup", "0", "--repeats", "1",
               "--gpu", "h200", "--device", "cpu", "--dtype", "float32"]


def _shared(work: Path, name: str) -> Path:
    return work.parent / "_shared" / name


def _moe_pair(work: Path) -> tuple[Path, Path]:
    """A small Qwen3-MoE (vocab 4096, ref:tiny's tokenizer beside it) and its w4a16-rtn checkpoint, whose
    config.json then routes each token to 9 of its 8 experts."""
    src, ckpt = _shared(work, "moe-float"), _shared(work, "moe-w4-topk9")
    if not ckpt.exists():
        import shutil

        import quantkit
        from quantkit.refmodels.registry import reference_model_path

        from .moe_fixtures import make_moe_model

        model = make_moe_model("qwen3_moe", layers=1, vocab_size=4096)
        model.save_pretrained(src)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(reference_model_path("tiny") / name, src / name)
        quantkit.save(quantkit.quantize(model, "w4a16-rtn", progress=False), ckpt)
        _route_to_nine(ckpt)
    return src, ckpt


def _route_to_nine(folder: Path) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config["num_experts_per_tok"] = 9
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _bad_moe_float(work: Path) -> Path:
    """The float MoE of _moe_pair with num_experts_per_tok 9 in its config.json."""
    import shutil

    src, _ = _moe_pair(work)
    dest = work / "moe-topk9"
    shutil.copytree(src, dest)
    return _route_to_nine(dest)


def _ragged(work: Path) -> tuple[Path, Path]:
    """A random Llama of SmolLM2-135M's widths (hidden 576: groups of 64 there, 128 on down_proj's 1536),
    one layer, and its w4a16-rtn checkpoint."""
    float_dir, w4 = _shared(work, "ragged-float"), _shared(work, "ragged-w4")
    if not w4.exists():
        import torch
        import transformers

        import quantkit

        config = transformers.LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                          num_attention_heads=9, num_key_value_heads=3, vocab_size=256,
                                          max_position_embeddings=256, tie_word_embeddings=True)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        model.save_pretrained(float_dir)
        quantkit.save(quantkit.quantize(model, "w4a16-rtn", progress=False), w4)
    return float_dir, w4


def _eval_moe_topk9(work):
    src, ckpt = _moe_pair(work)
    return ["eval", str(ckpt), "--baseline", str(src), "--max-tokens", "256"]


def _bench_ragged(work):
    float_dir, w4 = _ragged(work)
    return ["bench", str(w4), "--baseline", str(float_dir), "--variants", "w4a16-rtn", *BENCH_SMALL,
            "--json", str(work / "bench.json")]


def _check_ragged(work, out):
    data = json.loads((work / "bench.json").read_text())
    described = {v["name"]: v["weights"] for v in data["variants"]}
    assert set(described.values()) >= {"int4 g64 sym, except down_proj: int4 g128 sym"}, described
    return f"exit 0; the variants' weights: {described['w4a16-rtn']} (both), each linear's bytes by its scheme"


CASES = [
    Case("enc-quantize-calib-4-tokens", "`quantize ref:tiny --recipe w4a16-gptq --calib-samples 1 --calib-seq-len 4` "
         "(was: calibrated on 4 tokens, where the Python API refuses fewer than 256)",
         lambda w: ["quantize", "ref:tiny", "--recipe", "w4a16-gptq", "--out", str(w / "out"), "--calib-samples",
                    "1", "--calib-seq-len", "4"], "calibration needs at least 256", creates="out"),
    Case("enc-eval-moe-topk9", "`eval` of a MoE checkpoint whose config has num_experts_per_tok 9 > 8 experts "
         "(was: RuntimeError from topk)", _eval_moe_topk9,
         "num_experts_per_tok 9 with num_"),
    Case("enc-quantize-moe-topk9", "`quantize` of a MoE model whose config has num_experts_per_tok 9 > 8 experts "
         "(was: quantized and saved)", lambda w: ["quantize", str(_bad_moe_float(w)), "--recipe", "w4a16-rtn",
                                                  "--out", str(w / "out")],
         "num_experts_per_tok 9 with num_", creates="out"),
    Case("enc-advise-moe-topk9", "`advise` of a MoE model whose config has num_experts_per_tok 9 > 8 experts (was: "
         "a roofline of 9 experts per token)", lambda w: ["advise", str(_bad_moe_float(w)), "--gpu", "h200",
                                                          "--prompt-len", "8", "--output-len", "8"],
         "num_experts_per_tok 9 with num_"),
    Case("enc-bench-ragged", "`bench CKPT --baseline FLOAT --variants w4a16-rtn` on a model of SmolLM2's widths "
         "(groups of 64 and 128; was: ValueError 'the roofline models one weight scheme', and int4 g128 reported "
         "for the g64 layers)", _bench_ragged, "each linear's bytes by its scheme", status=0, check=_check_ragged),
]


# -- the Python API -----------------------------------------------------------------------------------

def _tiny(cls_name: str):
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=100, pad_token_id=0)
    torch.manual_seed(0)
    return getattr(transformers, cls_name)(config)


def _kv_fp8(cls_name: str):
    def call(work):
        import torch

        import quantkit

        quantkit.quantize(_tiny(cls_name), "kv-fp8", torch.randint(0, 100, (2, 256)), progress=False)
    return call


def _kv_fp8_whisper(work):
    import torch
    import transformers

    import quantkit

    model = transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, num_mel_bins=16, max_source_positions=32, max_target_positions=32))
    quantkit.quantize(model, "kv-fp8", torch.randint(0, 100, (2, 256)), progress=False)


def _bert_own_lm_head(work):
    import transformers

    import quantkit

    model = transformers.BertModel(transformers.BertConfig(hidden_size=64, num_hidden_layers=1,
                                                           num_attention_heads=2, intermediate_size=128))
    recipe = quantkit.load_recipe({"weights": {"num_bits": 8, "strategy": "channel"}, "ignore": ["lm_head"]})
    quantkit.quantize(model, recipe, progress=False)


def _quantize_moe_topk9(work):
    import quantkit

    from .moe_fixtures import make_moe_model

    model = make_moe_model("qwen3_moe", layers=1)
    model.config.num_experts_per_tok = 9
    quantkit.quantize(model, "w4a16-rtn", progress=False)


def _load_moe_topk9(work):
    import quantkit

    quantkit.load(_moe_pair(work)[1])


def _calib(**fields):
    def call(work):
        from quantkit.calibration import CalibrationConfig

        return CalibrationConfig(**fields)
    return call


def _corpus_cache_is_a_file(work):
    from quantkit.refmodels import corpus

    (work / "cache").write_text("a file where the cache folder goes\n")
    before = os.environ.get("QUANTKIT_CACHE_DIR")
    os.environ["QUANTKIT_CACHE_DIR"] = str(work / "cache")
    try:
        corpus.heldout_text_path()
    finally:
        if before is None:
            del os.environ["QUANTKIT_CACHE_DIR"]
        else:
            os.environ["QUANTKIT_CACHE_DIR"] = before


PYTHON_CASES = [
    PythonCase("enc-py-kv-fp8-base-model", "`quantize(LlamaModel, \"kv-fp8\", tokens)` (was: AttributeError)",
               _kv_fp8("LlamaModel"), QuantizationError, "an FP8 KV cache needs a decoder-only causal LM"),
    PythonCase("enc-py-kv-fp8-classifier", "`quantize(LlamaForSequenceClassification, \"kv-fp8\", tokens)` (was: "
               "ValueError from the model's padding check)", _kv_fp8("LlamaForSequenceClassification"),
               QuantizationError, "an FP8 KV cache needs a decoder-only causal LM"),
    PythonCase("enc-py-kv-fp8-whisper", "`quantize(Whisper, \"kv-fp8\", tokens)` (was: AttributeError)",
               _kv_fp8_whisper, QuantizationError, "is an encoder-decoder model"),
    PythonCase("enc-py-bert-own-lm-head", "`quantize(BertModel, recipe)` with the user's own `ignore: [lm_head]` "
               "(built-in recipes apply their default list where it matches; a user's entry must match)",
               _bert_own_lm_head, QuantizationError, "ignore entry 'lm_head' matches no module"),
    PythonCase("enc-py-quantize-moe-topk9", "`quantize` of a MoE model with num_experts_per_tok 9 > 8 experts (was: "
               "quantized)", _quantize_moe_topk9, QuantizationError, "num_experts_per_tok 9 with num_experts 8"),
    PythonCase("enc-py-load-moe-topk9", "`quantkit.load` of a MoE checkpoint with num_experts_per_tok 9 > 8 experts "
               "(was: loaded; RuntimeError from topk at the first forward)", _load_moe_topk9, CheckpointError,
               "num_experts_per_tok 9 with num_"),
    PythonCase("enc-py-calib-4-tokens", "`CalibrationConfig(num_samples=1, seq_len=4)` (was: accepted, 4 tokens)",
               _calib(num_samples=1, seq_len=4), QuantizationError, "calibration needs at least 256"),
    PythonCase("enc-py-calib-samples-string", "`CalibrationConfig(num_samples=\"8\")` (was: TypeError)",
               _calib(num_samples="8"), QuantizationError, "calibration num_samples must be an integer"),
    PythonCase("enc-py-corpus-cache-file", "the corpus cache under a `QUANTKIT_CACHE_DIR` that is a file (was: "
               "NotADirectoryError, exit 1)", _corpus_cache_is_a_file, UsageError,
               "set QUANTKIT_CACHE_DIR to a writable folder"),
]
