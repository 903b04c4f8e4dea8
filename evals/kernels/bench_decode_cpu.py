"""End-to-end CPU prefill and decode speed at batch 1: bf16 vs W8 (per channel) vs W4 (g128) on a random ~1.1B Llama.

    python evals/kernels/bench_decode_cpu.py --out evals/kernels            # writes decode_cpu.{json,md}
    python evals/kernels/bench_decode_cpu.py --out evals/kernels --prompt 512 --stem prefill_decode_cpu

The model is random-initialised (speed does not depend on the values) with TinyLlama-1.1B's
dimensions by default: hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocab
32000: ~2.2 GB of bf16 weights, far beyond any CPU cache. W8/W4 are made with
``quantkit.quantize(model, "w8a16-rtn" / "w4a16-rtn")`` (lm_head stays bf16, as the recipes say)
and run on the "torch" backend (``QuantLinear.prepare("torch")``: PyTorch's CPU weight-only
kernels through torch.ops.quantkit.*).

Measurement: prefill a fixed prompt (timed: TTFT), then greedy-decode ``--new-tokens`` tokens one
forward at a time through a DynamicCache, timing every step. The variants run in turn, round after round
(interleaved, so a slower or busier machine slows all of them alike); a variant's speed is
1 / median step time over all its rounds after the warm-up round; its prefill time is the median over
those rounds. Only the ratios to the baseline are meaningful across machines. ``--dtype fp32`` builds
the float model in fp32 (the baseline variant is then called "fp32"): on CPUs without native bf16
(no avx512_bf16 / AMX) bf16 GEMMs are emulated and a bf16 prefill baseline is meaningless there.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from quantkit.harness.hardware import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_timing import realtime_priority  # noqa: E402

# name -> (recipe, also quantize lm_head); "-all" variants quantize every linear, as torchao's
# quantize_() does by default, instead of keeping lm_head in bf16 as the recipes (and vLLM checkpoints) do.
VARIANTS = {
    "bf16": (None, False),
    "fp32": (None, False),
    "w8": ("w8a16-rtn", False),
    "w4": ("w4a16-rtn", False),
    "w4-asym": ("w4a16-rtn-asym", False),
    "w8-all": ("w8a16-rtn", True),
    "w4-all": ("w4a16-rtn", True),
}
FUSED = "+fused"  # suffix of a quantized variant: q/k/v and gate/up run as one linear each


def build_model(args):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=2048, tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config)
    return model.to(getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}[getattr(args, "dtype", "bf16")])).eval()


class FusedProjections(torch.nn.Module):
    """Several QuantLinears that read the same input, run as one linear over their weights concatenated
    along N (quantkit.kernels.concat_wna16_weights). Each original linear is replaced by a
    ``_FusedSlice`` that returns its part; the first slice called with a given input tensor computes
    all parts, the others reuse the result for that very tensor object."""

    def __init__(self, linears, backend: str):
        import quantkit.kernels as qk

        super().__init__()
        first = linears[0]
        self.bits, self.in_features = first.scheme.num_bits, first.in_features
        self.sizes = [lin.out_features for lin in linears]
        self.out_features = sum(self.sizes)
        packed, scale, zero = qk.concat_wna16_weights(
            [(lin.weight_packed, lin.weight_scale, lin.weight_zero_point) for lin in linears],
            bits=self.bits, in_features=self.in_features)
        self.backend = qk.resolve_backend(backend, packed.device, scale.dtype)
        prepared = qk.prepare_wna16(packed, scale, zero, bits=self.bits, in_features=self.in_features,
                                    backend=self.backend)
        self.keys = list(prepared)
        for key, tensor in prepared.items():
            self.register_buffer(key, tensor, persistent=False)
        biases = [lin.bias for lin in linears]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(n, dtype=scale.dtype) for b, n in zip(biases, self.sizes)])
        self._last = (None, None)

    def parts(self, x):
        if self._last[0] is not x:
            import quantkit.kernels as qk

            y = qk.wna16_linear(x, {k: getattr(self, k) for k in self.keys}, bits=self.bits,
                                in_features=self.in_features, out_features=self.out_features,
                                backend=self.backend, bias=self.bias)
            self._last = (x, y.split(self.sizes, dim=-1))
        return self._last[1]


class _FusedSlice(torch.nn.Module):
    def __init__(self, owner: FusedProjections, index: int):
        super().__init__()
        self.owner = [owner]  # a list: not registered as a submodule of every slice
        self.index = index

    def forward(self, x):
        return self.owner[0].parts(x)[self.index]


def fuse_projections(model, backend: str) -> int:
    """Fuse q/k/v and gate/up of every decoder layer (Llama-style names); returns the number of fusions."""
    fused = 0
    for layer in model.model.layers:
        for parent, names in ((layer.self_attn, ("q_proj", "k_proj", "v_proj")), (layer.mlp, ("gate_proj", "up_proj"))):
            owner = FusedProjections([getattr(parent, n) for n in names], backend)
            parent.add_module("fused_" + "_".join(n.split("_")[0] for n in names), owner)
            for i, n in enumerate(names):
                setattr(parent, n, _FusedSlice(owner, i))
            fused += 1
    return fused


def quantized_copy(model, recipe_name: str, lm_head: bool, backend: str, fuse: bool):
    import dataclasses

    import quantkit
    from quantkit.modules import QuantLinear

    recipe = quantkit.load_recipe(recipe_name)
    if lm_head:
        recipe = dataclasses.replace(recipe, ignore=())
    qmodel = quantkit.quantize(copy.deepcopy(model), recipe, progress=False)
    if fuse:
        fuse_projections(qmodel, backend)
    for module in qmodel.modules():
        if isinstance(module, QuantLinear):
            module.prepare(backend, release_checkpoint_tensors=True)
    gc.collect()
    return qmodel


def weight_bytes(model) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@torch.inference_mode()
def decode_steps(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, list[float], torch.Tensor]:
    """Seconds of the prefill, of each of `new_tokens` single-token forwards after it; and the tokens."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)  # [1, 1]
    prefill = time.perf_counter() - t0
    tokens, times = [token], []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        times.append(time.perf_counter() - t0)
        tokens.append(token)
    return prefill, times, torch.cat(tokens, dim=1)


def profile_step(model, prompt: torch.Tensor, rows: int = 15) -> str:
    """torch.profiler table of a few decode steps (where the time goes)."""
    from torch.profiler import ProfilerActivity, profile

    decode_steps(model, prompt, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        decode_steps(model, prompt, 4)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for STEM.json / STEM.md")
    p.add_argument("--stem", default="decode_cpu", help="output file name without suffix (default decode_cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="float dtype of the model")
    p.add_argument("--variants", default="bf16,w8,w4",
                   help=f"comma-separated, from {sorted(VARIANTS)}; append {FUSED} to a quantized one to fuse "
                        "its projections")
    p.add_argument("--backend", default="torch", help="quantkit kernel backend for the quantized variants")
    p.add_argument("--fuse", action="store_true", help="fuse q/k/v and gate/up in every quantized variant")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=4, help="rounds per variant (the first is a warm-up)")
    p.add_argument("--profile", action="store_true", help="print a torch.profiler table per variant")
    p.add_argument("--realtime", action="store_true",
                   help="time under SCHED_FIFO (Linux, root): shields the ratios from other load on a shared machine")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = args.variants.split(",")
    unknown = [n for n in names if n.removesuffix(FUSED) not in VARIANTS or n == "bf16" + FUSED]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {sorted(VARIANTS)}")

    base = build_model(args)
    models = {}
    for name in names:
        recipe, lm_head = VARIANTS[name.removesuffix(FUSED)]
        fuse = args.fuse or name.endswith(FUSED)
        models[name] = base if recipe is None else quantized_copy(base, recipe, lm_head, args.backend, fuse)
    if "bf16" not in names:
        del base
    gc.collect()
    prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(args.seed))

    steps: dict[str, list[float]] = {n: [] for n in names}
    prefills: dict[str, list[float]] = {n: [] for n in names}
    tokens = {}
    decode_steps(models[names[0]], prompt, 1)  # the thread pool exists before priorities are set
    with realtime_priority(args.realtime):
        for r in range(args.rounds):
            for name in names:
                prefill, times, toks = decode_steps(models[name], prompt, args.new_tokens)
                if r > 0:
                    steps[name].extend(times)
                    prefills[name].append(prefill)
                tokens[name] = toks
            print(f"round {r}: " + ", ".join(f"{n} {statistics.median(steps[n] or [float('nan')]) * 1e3:.1f} ms/token"
                                             for n in names), flush=True)
    result = {
        "command": "python evals/kernels/bench_decode_cpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "model": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "kv_heads", "vocab")},
        "prompt_tokens": args.prompt, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "dtype": args.dtype,
        "backend": args.backend, "fused_projections": args.fuse, "realtime_priority": args.realtime,
        "variants": {},
    }
    ref = statistics.median(steps[names[0]])
    ref_prefill = statistics.median(prefills[names[0]])
    for name in names:
        med = statistics.median(steps[name])
        med_prefill = statistics.median(prefills[name])
        result["variants"][name] = {
            "recipe": VARIANTS[name.removesuffix(FUSED)][0],
            "lm_head_quantized": VARIANTS[name.removesuffix(FUSED)][1],
            "fused_projections": name != "bf16" and (args.fuse or name.endswith(FUSED)),
            "weight_GB": weight_bytes(models[name]) / 1e9,
            "median_ms_per_token": med * 1e3,
            "tokens_per_s": 1 / med,
            f"speedup_vs_{names[0]}": ref / med,
            "median_prefill_ms": med_prefill * 1e3,
            f"prefill_speedup_vs_{names[0]}": ref_prefill / med_prefill,
            "steps_timed": len(steps[name]),
            "same_tokens_as_first": bool(torch.equal(tokens[name], tokens[names[0]])),
        }
    if args.profile:
        for name in names:
            print(f"== {name}\n{profile_step(models[name], prompt)}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps(result, indent=1))
    (args.out / f"{args.stem}.md").write_text(to_markdown(result, names))
    print(to_markdown(result, names))
    return result


def to_markdown(result: dict, names: list[str]) -> str:
    m = result["model"]
    lines = [
        f"# CPU prefill and decode speed, batch 1: {names[0]} vs quantkit W8 / W4",
        "",
        f"Random-initialised Llama: hidden {m['hidden']}, intermediate {m['intermediate']}, {m['layers']} layers, "
        f"{m['heads']} heads / {m['kv_heads']} KV heads, vocab {m['vocab']}. "
        f"Prompt {result['prompt_tokens']} tokens, {result['new_tokens']} decode steps per round, "
        f"{result['rounds']} interleaved rounds (first discarded), median step time. "
        f"{result['machine']}, {result['threads']} threads, torch {result['torch']}, backend `{result['backend']}`"
        f"{', q/k/v and gate/up fused in every quantized variant' if result['fused_projections'] else ''}"
        f"{', timed under SCHED_FIFO (shared machine)' if result.get('realtime_priority') else ''}.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"| variant | recipe | weights (GB) | prefill ms | prefill speedup | decode ms / token | tokens / s "
        f"| decode speedup vs {names[0]} |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        v = result["variants"][name]
        prefill = (f"{v['median_prefill_ms']:.0f} | {v[f'prefill_speedup_vs_{names[0]}']:.2f}x"
                   if "median_prefill_ms" in v else "- | -")
        lines.append(f"| {name} | {v['recipe'] or '-'} | {v['weight_GB']:.2f} | {prefill} | "
                     f"{v['median_ms_per_token']:.1f} | {v['tokens_per_s']:.2f} | {v[f'speedup_vs_{names[0]}']:.2f}x |")
    if any(result["variants"][n]["lm_head_quantized"] for n in names):
        lines += ["", "Variants ending in `-all` also quantize lm_head (every linear, as torchao's quantize_ does by "
                  "default); the others keep it in bf16 as the recipes do."]
    if any(result["variants"][n].get("fused_projections") for n in names):
        lines += ["", f"Variants ending in `{FUSED}` run q/k/v and gate/up as one linear each over weights "
                  "concatenated along N (quantkit.kernels.concat_wna16_weights)."]
    lines += ["", f"Prefill: one forward over the {result['prompt_tokens']}-token prompt (the quantized linears take "
              "the dequantize-once path from 128 rows for int4, 32 for int8: quantkit/kernels/wna16_cpu_dequant.py); "
              "decode: the steps after it.",
              "", "Absolute times depend on the machine and its load; the ratios were measured side by side in "
              "one run."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
