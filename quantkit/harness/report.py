"""The evaluation report: one Markdown file, the JSON it was made from, and PNG plots.

Inputs are the JSON of ``quantkit bench`` (schema ``quantkit.bench/1``: ``prefill`` and
``decode`` records per variant, with roofline predictions) and any number of ``quantkit eval``
JSON files (``perplexity``, ``kl_divergence``, ``top1_agreement``, ``baseline_perplexity``),
read by quantkit.harness.results.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .context_growth import growth_lines
from .cpu_features import CpuFeatures
from .formatting import fmt_intensity, fmt_perplexity_change
from .hardware import DeviceSpec
from .machine_load import busy_caution
from .results import (SHAPE_KEYS, QualityResult, ranges_overlap, records, roofline_problem, shape_key, speedup_summary,
                      time_range, variant_names)
from .timing import describe_skipped


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _fmt_x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}x"


def _fmt_summary(s: dict, phase: str) -> str:
    return "–" if s[f"{phase}_measured"] is None else _fmt_range(s, phase)


RANGE_NOTE = ("in brackets, the range the repeats allow over those lengths (from the slowest baseline repeat over "
              "the fastest variant repeat, to the other way round).")


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def summary_lines(bench: dict) -> list[str]:
    """A short plain-text summary of bench results (printed by `quantkit bench`)."""
    problem = roofline_problem(bench)
    lines = [f"model {bench['model']['name']} on {bench['device']['name']} ({bench['device']['type']})",
             f"  {_dtype_line(bench, why=True)}",
             "  times: median [fastest-slowest] of the repeats; speedups: median over the lengths [the range the "
             "repeats allow]"]
    for phase, unit in (("prefill", "TTFT"), ("decode", "TPOT")):
        for r in sorted(bench[phase], key=lambda r: (shape_key(r, phase), r["variant"])):
            shape = ", ".join(f"{k}={r[k]}" for k in SHAPE_KEYS[phase])
            lo, hi = time_range(r)
            line = f"  {unit} {shape:<26} {r['variant']:<18} {_fmt_ms(r['median_s']):>8} ms [{_fmt_ms(lo)}-{_fmt_ms(hi)}]"
            if "cache_dtype" in r:  # quantkit's decode loop: the cache it decoded with
                line += f"   {r['cache_dtype']} KV cache {_fmt_bytes(r['memory']['kv_cache_bytes'])}"
            if not problem:
                line += f"   x{r['roofline']['measured_over_predicted']:.2f} of roofline ({r['roofline']['bound']})"
            lines.append(line)
    for s in speedup_summary(bench):
        if problem:
            lines.append(f"  speedup {s['variant']:<18} prefill {_fmt_summary(s, 'prefill')}   "
                         f"decode {_fmt_summary(s, 'decode')}")
        else:
            lines.append(f"  speedup {s['variant']:<18} prefill {_fmt_summary(s, 'prefill')} "
                         f"(roofline {_fmt_x(s['prefill_predicted'])})   decode {_fmt_summary(s, 'decode')} "
                         f"(roofline {_fmt_x(s['decode_predicted'])})")
    for v in bench.get("variants", []):
        if v.get("scheme", {}).get("layers"):  # linears of several schemes: the roofline sums each by its own
            lines.append(f"  {v['name']} weights: {v.get('weights')}")
    caution = busy_caution(bench["device"].get("load"))
    if caution:
        lines.append(f"  {caution}")
    if problem:
        lines.append(f"  no roofline: {problem}")
    elif bench.get("model", {}).get("moe_note"):
        lines.append(f"  roofline: {bench['model']['moe_note']}")
    return lines


# -- the report -------------------------------------------------------------------------------------

#: Every file a report can write (render_report writes some of them): a forced report removes those of an
#: earlier one that it does not write again.
REPORT_OUTPUTS = ("report.md", "report.json", "ttft_vs_prompt.png", "tpot_vs_context.png", "speedups.png",
                  "roofline.png", "quality.png")


def render_report(bench: dict | None, quality: Sequence[QualityResult], out_dir: str | Path, *,
                  title: str = "quantkit evaluation report", notes: Sequence[str] = ()) -> Path:
    """Write report.md, report.json and the plots into ``out_dir``; returns the Markdown path.

    ``notes``: Markdown blocks put under the title, each followed by a blank line (a table is one block)."""
    from . import plots  # import time: matplotlib loads only where a plot is drawn

    if bench is None and not quality:
        raise ValueError("nothing to report: give bench results, quality results, or both")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colors = plots.variant_colors(variant_names(bench) if bench else [], [q.name for q in quality])
    images: dict[str, str] = {}
    if bench is not None:
        images.update(plots.bench_plots(bench, out, colors))
    if quality:
        images.update(plots.quality_plots(quality, out, colors))

    md = [f"# {title}", ""]
    for note in notes:
        md += [note.strip("\n"), ""]
    if bench is not None:
        md += _bench_sections(bench, images)
    md += _quality_section(quality, images, bench)
    md += ["## Files", "", "- `report.json`: the bench and quality results this report was made from"]
    md += [f"- `{name}`" for name in images.values()]
    (out / "report.md").write_text("\n".join(md) + "\n")
    payload = {"bench": bench, "quality": [q.report_dict() for q in quality]}
    (out / "report.json").write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")  # valid JSON only
    return out / "report.md"


def _dtype_line(bench: dict, why: bool = False) -> str:
    """Which dtype each phase was timed in, and (``why``, when the results say) why."""
    dtypes = bench.get("dtypes") or dict.fromkeys(("prefill", "decode"), bench["model"]["dtype"])
    reasons = (bench.get("dtype_reasons") or {}) if why else {}
    if len(set(dtypes.values())) == 1 and not reasons:
        return next(iter(dtypes.values()))
    return ", ".join(f"{phase} timed in {d}" + (f" ({reasons[phase]})" if reasons.get(phase) else "")
                     for phase, d in dtypes.items())


def _cpu_lines(bench: dict) -> list[str]:
    """The CPU features found and what follows from them (CPU runs only)."""
    dev = bench["device"]
    if dev["type"] != "cpu":
        return []
    if not dev.get("cpu_features"):
        text = (f"CPU features were not recorded with this run (an older `quantkit bench`); every phase was timed "
                f"in {bench['model']['dtype']}.")
        spec = dev["spec"]
        if "bfloat16 matmul" in spec.get("notes", "") and not roofline_problem(bench):
            text += (f" Its bf16 matmul probe measured {_fmt_flops(spec['peak_flops'])}, above what a matrix-vector "
                     "product reaches at its bandwidth, so bf16 matrix products were not emulated on that CPU "
                     "(emulated, they measure below 1.5 GFLOP/s).")
        return [text, ""]
    features = CpuFeatures.from_dict(dev["cpu_features"])
    timed = bench.get("dtypes") or dict.fromkeys(("prefill", "decode"), bench["model"]["dtype"])
    return [" ".join(features.sentences(timed)), ""]


def _bench_sections(bench: dict, images: dict[str, str]) -> list[str]:
    dev, model, settings = bench["device"], bench["model"], bench["settings"]
    spec = dev["spec"]
    shape = model["shape"]
    problem = roofline_problem(bench)
    md = ["## Setup", ""]
    if dev["type"] == "cpu":
        md += ["CPU timings depend on the machine and its load: read the ratios (speedups measured side by side "
               "in one run, variants interleaved shape by shape" + ("" if problem else "; measured over roofline")
               + "), not the milliseconds.", ""]
        caution = busy_caution(dev.get("load"))
        if caution:
            md += [f"**{caution}**", ""]
    md += _cpu_lines(bench)
    params = model["params"]
    params = f"{params / 1e9:.2f} B" if params >= 1e8 else f"{params / 1e6:.2f} M"
    width = (f"{shape['experts']} experts of intermediate {shape['expert_intermediate']}, top-"
             f"{shape['experts_per_token']}" + (f", shared expert {shape['shared_intermediate']}"
                                               if shape.get("shared_intermediate") else "")
             if shape.get("experts") else f"intermediate {shape['intermediate']}")
    md += [f"- Model: `{model['name']}` ({params} parameters; hidden "
           f"{shape['hidden']}, {width}, {shape['layers']} layers, {shape['heads']} heads, "
           f"{shape['kv_heads']} KV heads, vocab {shape['vocab']})",
           *([f"- Roofline: {model['moe_note']}"] if model.get("moe_note") else []),
           f"- Dtypes: {_dtype_line(bench, why=True)}",
           f"- Device: {dev['name']} ({dev['type']}" + (f", {dev['threads']} threads" if "threads" in dev else "")
           + f"), torch {dev['torch']}",
           f"- Timing: {settings['timer']}, {settings['warmup']} warm-up run{'s' if settings['warmup'] != 1 else ''}, "
           f"median of {settings['repeats']}" + (f" ({settings['order']})" if settings.get("order") else "") + "; "
           "decode = one step at a fixed context with a pre-filled static KV cache "
           f"(mode: {', '.join(sorted({r.get('mode', 'eager') for r in bench['decode']})) or '–'})",
           f"- Memory: {settings['memory_method']}"
           + (" (CPU: bytes of the model's and the cache's tensors; peak-RSS growth in report.json)"
              if settings["memory_method"] == "tensor_bytes" else
              " (the variant's weights plus the allocator's peak growth during the measurement)")]
    if problem:
        md += [f"- Roofline: not shown, because {problem}."]
    else:
        md += [f"- Roofline device: {spec['name']}: {DeviceSpec.from_dict(spec).figures()}; ridge "
               f"{fmt_intensity(spec['ridge_intensity'])} flop/byte"]
    md += [""]
    md += ["| variant | source | backend | weights in memory |", "|---|---|---|---|"]
    md += [f"| {v['name']} | {v['source']} | {v.get('backend') or '–'}"
           f"{' (' + v['kernels'] + ')' if v.get('kernels') else ''} | {_fmt_bytes(v['weight_bytes'])} |"
           for v in bench["variants"]]
    md += [""]

    summary = speedup_summary(bench)
    if summary:
        md += ["## Prefill versus decode speedup", ""]
        if problem:
            md += [f"Median over the measured lengths (decode at the smallest batch); {RANGE_NOTE}", ""]
            md += _table(["variant", "prefill measured", "decode measured"],
                         [[s["variant"], _fmt_summary(s, "prefill"), _fmt_summary(s, "decode")] for s in summary])
        else:
            md += [f"Median over the measured lengths (decode at the smallest batch); {RANGE_NOTE} The roofline "
                   "column is the prediction max(bytes / bandwidth, flops / peak) for the same shapes.", ""]
            md += _table(["variant", "prefill measured", "prefill roofline", "decode measured", "decode roofline"],
                         [[s["variant"], _fmt_summary(s, "prefill"), _fmt_x(s["prefill_predicted"]),
                           _fmt_summary(s, "decode"), _fmt_x(s["decode_predicted"])] for s in summary])
        md += ["", _headline(summary), ""]
        if "speedups" in images:
            md += [f"![prefill and decode speedups]({images['speedups']})", ""]
        if not problem:
            md += _why_paragraph(bench) + [""]

    md += ["## Time to first token (prefill)", ""]
    md += _phase_table(bench, "prefill", "prompt_len", "TTFT ms")
    if "ttft" in images:
        md += ["", f"![TTFT against prompt length]({images['ttft']})"]
    md += ["", "## Time per output token (decode)", ""]
    for b in sorted({r["batch"] for r in bench["decode"]}):
        md += [f"Batch {b}:", ""]
        md += _phase_table(bench, "decode", "context_len", "TPOT ms", batch=b)
        md += [""]
    if "tpot" in images:
        md += [f"![TPOT against context length]({images['tpot']})", ""]
    if not problem:
        for b in sorted({r["batch"] for r in bench["decode"]}):
            if growth := growth_lines(bench, b):
                md += growth + [""]
    if not problem:
        md += _roofline_section(bench, images)
    md += _memory_section(bench)
    if bench.get("skipped"):
        md += ["## Skipped shapes", ""] + [f"- {describe_skipped(s)}" for s in bench["skipped"]] + [""]
    if bench.get("command"):
        md += ["## Reproduce", "", "```", bench["command"], "```", ""]
    return md


def _fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:.2f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def _phase_table(bench: dict, phase: str, length_key: str, unit: str, batch: int | None = None) -> list[str]:
    """Median [fastest-slowest repeat] per variant and length, and the speedup over the baseline,
    marked when the two repeat ranges overlap (a difference the run does not show)."""
    match = {} if batch is None else {"batch": batch}
    lengths = sorted({r[length_key] for r in records(bench, phase, **match)})
    rows = []
    base = bench.get("baseline")
    for name in variant_names(bench):
        by_len = {r[length_key]: r for r in records(bench, phase, name, **match)}
        if not by_len:
            continue
        cells = []
        for n in lengths:
            r = by_len.get(n)
            if r is None:
                cells.append("–")
                continue
            lo, hi = time_range(r)
            cell = _fmt_ms(r["median_s"]) + (f" [{_fmt_ms(lo)}-{_fmt_ms(hi)}]" if hi > lo else "")
            if base and name != base:
                b = next((x for x in records(bench, phase, base, **match) if x[length_key] == n
                          and x["batch"] == r["batch"]), None)
                if b:
                    cell += f" ({b['median_s'] / r['median_s']:.2f}x" + (", ranges overlap)" if ranges_overlap(b, r)
                                                                          else ")")
            cells.append(cell)
        rows.append([name] + cells)
    header = [f"{unit} \\ {length_key.replace('_', ' ')}"] + [str(n) for n in lengths]
    note = ("(median [fastest-slowest] of the repeats; in parentheses: speedup over the baseline, the ratio of "
            "medians, measured side by side; \"ranges overlap\": the two variants' repeats overlap, so the run does "
            "not show which is faster)")
    return _table(header, rows) + ["", note] if base else _table(header, rows)


def _fmt_range(s: dict, phase: str) -> str:
    """'2.16x [1.90-2.40]': a summary's median speedup of ``phase`` and the range its repeats allow."""
    med, lo, hi = s[f"{phase}_measured"], s.get(f"{phase}_low"), s.get(f"{phase}_high")
    if lo is None or hi is None or (f"{lo:.2f}" == f"{med:.2f}" == f"{hi:.2f}"):
        return f"{med:.2f}x"
    return f"{med:.2f}x [{lo:.2f}-{hi:.2f}]"


def _headline(summary: list[dict]) -> str:
    """One sentence: does decode gain more than prefill, variant by variant?

    It claims a difference only outside the noise: decode gains more when the lowest speedup its
    repeats allow (over every length) is above the highest prefill's allow, less when the other way
    round; ranges that overlap, or medians equal as printed, are no difference the run shows.
    """
    both = [s for s in summary if s["prefill_measured"] is not None and s["decode_measured"] is not None]
    if not both:
        return ""

    def bounds(s, phase):
        lo, hi = s.get(f"{phase}_low"), s.get(f"{phase}_high")
        med = s[f"{phase}_measured"]
        return (med if lo is None else lo), (med if hi is None else hi)

    more, less, same = [], [], []
    for s in both:
        (p_lo, p_hi), (d_lo, d_hi) = bounds(s, "prefill"), bounds(s, "decode")
        if f"{s['decode_measured']:.2f}" == f"{s['prefill_measured']:.2f}":
            same.append(s["variant"])
        elif d_lo > p_hi:
            more.append(s["variant"])
        elif d_hi < p_lo:
            less.append(s["variant"])
        else:
            same.append(s["variant"])
    claims = []
    if more:
        claims.append("decode speeds up more than prefill for " + ("every variant" if len(more) == len(both) > 1
                                                                    else ", ".join(more)))
    if less:
        claims.append("decode speeds up less than prefill for " + ("every variant" if len(less) == len(both) > 1
                                                                    else ", ".join(less)))
    if same:
        claims.append("the run shows no difference between the decode and prefill speedups (their ranges overlap "
                      "or they are equal as printed) for " + ("any variant" if len(same) == len(both) > 1
                                                               else ", ".join(same)))
    parts = ", ".join(f"{s['variant']} {_fmt_range(s, 'decode')} vs {_fmt_range(s, 'prefill')}" for s in both)
    return (f"Measured: {'; '.join(claims)} (speedup of decode vs prefill, median [range over the lengths and "
            f"repeats]: {parts}).")


def _why_paragraph(bench: dict) -> list[str]:
    """Why prefill and decode gain differently, in terms of where each sits against the ridge point."""
    spec = bench["device"]["spec"]
    base = bench.get("baseline")
    pf = records(bench, "prefill", base)
    dc = records(bench, "decode", base)
    if not pf or not dc:
        return []
    p, d = pf[-1], dc[0]
    text = (f"Why: on this device the ridge point is {fmt_intensity(spec['ridge_intensity'])} flop/byte. "
            f"The baseline's prefill of {p['prompt_len']} tokens runs at {fmt_intensity(p['roofline']['intensity'])} "
            f"flop/byte ({p['roofline']['bound']}-bound): ")
    if p["roofline"]["bound"] == "compute":
        text += "its time is set by flops, which weight-only quantization does not reduce. "
        text += _int8_prompts(bench, p)
    else:
        text += "its time is set by the bytes it reads, so smaller weights can shorten it too. "
    text += (f"A decode step (batch {d['batch']}, context {d['context_len']}) runs at "
             f"{fmt_intensity(d['roofline']['intensity'])} flop/byte ({d['roofline']['bound']}-bound): ")
    if d["roofline"]["bound"] == "memory":
        weights = d["roofline"]["bytes_breakdown"]["weights"]
        cuts = [f"{r['variant']} cuts them {weights / r['roofline']['bytes_breakdown']['weights']:.1f}x"
                for name in variant_names(bench) if name != base
                for r in records(bench, "decode", name, batch=d["batch"], context_len=d["context_len"])]
        text += (f"its time is set by the bytes it reads, and {_fmt_bytes(weights)} of its "
                 f"{_fmt_bytes(d['roofline']['bytes'])} are the decoder weights" + (f"; {', '.join(cuts)}." if cuts else "."))
        text += _off_roofline(bench, d)
    else:
        text += "its time is set by flops, so on this device fewer bytes of weights do not shorten it by themselves."
    return [text]


def _int8_prompts(bench: dict, base_prefill: dict) -> str:
    """A sentence naming the variants whose prefill (at ``base_prefill``'s shape) gains over 10% more than the
    roofline predicts while they run quantkit's C++ CPU kernel: it multiplies int8-rounded activations by the
    integer weights, and integer dot products run at a higher rate than the float matmul peak the roofline
    prices every variant's flops at."""
    faster = []
    for v in bench["variants"]:
        if v["name"] == base_prefill["variant"] or "wna16_cpu_q8dot" not in str(v.get("kernels") or ""):
            continue
        for r in records(bench, "prefill", v["name"], batch=base_prefill["batch"], prompt_len=base_prefill["prompt_len"]):
            measured = base_prefill["median_s"] / r["median_s"]
            predicted = base_prefill["roofline"]["predicted_s"] / r["roofline"]["predicted_s"]
            if measured > 1.1 * predicted:
                faster.append(f"{v['name']} {measured:.2f}x against a predicted {predicted:.2f}x")
    if not faster:
        return ""
    return (f"Measured at that shape, the quantized prompts gain more ({', '.join(faster)}): quantkit's CPU kernel "
            f"rounds their activations to int8 and runs integer dot products (VNNI / AVX2), whose rate is above the "
            f"float matmul peak the roofline assumes for every variant, so fewer flops are not what makes them faster. ")


def _off_roofline(bench: dict, base_step: dict) -> str:
    """Sentences naming the variants whose decode step (at ``base_step``'s shape) gains less than half the
    speedup the roofline predicts (their kernels, not the bytes, set the time), or over 10% more (the
    baseline's kernel streams its weights at a smaller share of the bandwidth than theirs)."""
    bandwidth = bench["device"]["spec"]["memory_bandwidth"]
    base_share = 100 * base_step["achieved_bandwidth"] / bandwidth
    short, beyond = [], []
    for name in variant_names(bench):
        if name == base_step["variant"]:
            continue
        for r in records(bench, "decode", name, batch=base_step["batch"], context_len=base_step["context_len"]):
            measured = base_step["median_s"] / r["median_s"]
            predicted = base_step["roofline"]["predicted_s"] / r["roofline"]["predicted_s"]
            said = (f"{name} gains {measured:.2f}x against a predicted {predicted:.2f}x "
                    f"({100 * r['achieved_bandwidth'] / bandwidth:.0f}% of the bandwidth)")
            if measured < predicted / 2:
                short.append(said)
            elif measured > 1.1 * predicted:
                beyond.append(said)
    text = ""
    if short:
        text += (f" Measured at that shape, the baseline reaches {base_share:.0f}% of the bandwidth, but "
                 f"{', '.join(short)}: on this device their kernels, not the bytes they read, set their decode time.")
    if beyond:
        text += (f" Measured at that shape, {', '.join(beyond)}, more than the roofline predicts: the baseline "
                 f"reaches only {base_share:.0f}% of the bandwidth, so its float kernel, not only its bytes, slows it.")
    return text


def _roofline_section(bench: dict, images: dict[str, str]) -> list[str]:
    md = ["## Measured against the roofline", "",
          "measured / roofline: 1.0 would be a kernel at the device's achievable bandwidth or matmul rate; "
          "larger is slower than the roofline (below 1.0 would beat the measured limits: a sign the probe "
          "underestimates the device). Achieved GB/s: the roofline's bytes over the measured time, "
          "and its share of the device's bandwidth.", ""]
    rows = []
    bandwidth = bench["device"]["spec"]["memory_bandwidth"]
    for phase, key in (("prefill", "prompt_len"), ("decode", "context_len")):
        for name in variant_names(bench):
            for r in records(bench, phase, name):
                rows.append([phase, name, r["batch"], r[key], f"{r['roofline']['intensity']:.1f}",
                             r["roofline"]["bound"], _fmt_ms(r["roofline"]["predicted_s"]), _fmt_ms(r["median_s"]),
                             f"{r['roofline']['measured_over_predicted']:.2f}",
                             f"{r['achieved_bandwidth'] / 1e9:.1f}",
                             f"{100 * r['achieved_bandwidth'] / bandwidth:.0f}%"])
    md += _table(["phase", "variant", "batch", "length", "flop/byte", "bound", "roofline ms", "measured ms",
                  "measured / roofline", "achieved GB/s", "% of bandwidth"], rows)
    if "roofline" in images:
        md += ["", f"![measured against the roofline]({images['roofline']})"]
    return md + [""]


def _memory_section(bench: dict) -> list[str]:
    method = bench["settings"]["memory_method"]
    md = ["## Memory", "", f"Peak per decode shape ({method}):", ""]
    rows = []
    for name in variant_names(bench):
        for r in records(bench, "decode", name):
            m = r["memory"]
            rows.append([name, r["batch"], r["context_len"], _fmt_bytes(m["weights_bytes"]),
                         _fmt_bytes(m["kv_cache_bytes"]), _fmt_bytes(m["peak_bytes"])])
    return md + _table(["variant", "batch", "context", "weights", "KV cache", "peak"], rows) + [""]


def _fmt_delta(q: QualityResult) -> str:
    return fmt_perplexity_change(q.perplexity, q.baseline_perplexity, q.log_ppl_ratio_stderr)


def _quality_section(quality: Sequence[QualityResult], images: dict[str, str], bench: dict | None) -> list[str]:
    md = ["## Quality", ""]
    if not quality:
        return md + ["No `quantkit eval` results were given (pass them with `--quality FILE...`).", ""]
    rows = []
    for q in quality:
        rows.append([q.name, f"{q.baseline_perplexity:.3f}" if q.baseline_perplexity else "–", f"{q.perplexity:.3f}",
                     _fmt_delta(q), "–" if q.kl_divergence is None else f"{q.kl_divergence:.4g}",
                     "–" if q.top1_agreement is None else f"{100 * q.top1_agreement:.1f}%"])
    md += _table(["variant", "baseline ppl", "perplexity", "Δ ppl", "KL divergence", "top-1 agreement"], rows)
    md += [""]
    if any(q.log_ppl_ratio_stderr is not None for q in quality):
        md += ["Δ ppl ± two standard errors of the mean per-window change in log-perplexity (windows taken as "
               "independent samples of the text). A change within that band is noise, not an effect of "
               "quantization; a negative Δ outside it means the quantized model happens to predict this text "
               "slightly better, which is not an improvement of the model in general.", ""]
    if any(q.log_ppl_ratio_stderr is None and q.perplexity_increase is not None for q in quality):
        md += ["Where Δ ppl has no ± band, the results do not carry a standard error (written by an older "
               "`quantkit eval`): a change of a few hundredths of a percent, of either sign, may be noise; KL "
               "divergence and top-1 agreement, which compare the two models position by position, are the "
               "reliable measures of such small differences.", ""]
    md += _dtype_note(quality, bench)
    if "quality" in images:
        md += [f"![quality]({images['quality']})", ""]
    return md


def _dtype_note(quality: Sequence[QualityResult], bench: dict | None) -> list[str]:
    """Say plainly when quality and speed were measured in different dtypes."""
    quality_dtypes = sorted({q.dtype for q in quality if q.dtype})
    if bench is None:
        return [f"Evaluated in {', '.join(quality_dtypes)}.", ""] if quality_dtypes else []
    speed_dtypes = sorted(set((bench.get("dtypes") or {}).values()) or {bench["model"]["dtype"]})
    speed = _dtype_line(bench)
    if not quality_dtypes:
        return [f"The quality results do not record their dtype; the timings above ran in {speed}.", ""]
    if quality_dtypes != speed_dtypes:
        return [f"Quality was measured in {', '.join(quality_dtypes)} and speed in {speed}: the two sections "
                "do not describe the same numerics.", ""]
    return [f"Quality and speed were both measured in {', '.join(quality_dtypes)}.", ""]
