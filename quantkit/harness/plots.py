"""PNG plots of bench and quality results (matplotlib, Agg backend: no display needed).

Each function writes one file into ``out_dir`` and returns its file name (relative, for Markdown).
A variant has one colour in every plot (``variant_colors``).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .context_growth import cache_growth  # noqa: E402
from .formatting import fmt_intensity  # noqa: E402
from .results import QualityResult, records, roofline_problem, speedups, time_range, variant_names  # noqa: E402

DPI = 130
STYLE = {"axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
         "font.size": 10, "axes.titlesize": 11, "legend.fontsize": 9, "legend.framealpha": 0.9}


BASELINE_COLOR = "#555555"
ROOFLINE_MARKER = dict(linestyle="--", marker="_", markersize=14)  # a dash stays visible at a single point
CROSSOVER_MARKER = dict(linestyle=":", linewidth=1.2, alpha=0.8)
CROSSOVER_LABEL = "dotted: the context at which the KV cache reads as many bytes as the variant's weights"


def variant_colors(bench_names: Sequence[str], quality_names: Sequence[str] = ()) -> dict[str, str]:
    """One colour per variant across all plots. The first bench name (the float baseline) is grey; a
    quality result named after a bench variant with a prefix ("small-w4a16-rtn" for "w4a16-rtn")
    shares that variant's colour."""
    palette = [matplotlib.colors.to_hex(c) for c in plt.get_cmap("tab10").colors if c != (0.5, 0.5, 0.5)]
    colors: dict[str, str] = {}
    for i, name in enumerate(bench_names):
        colors[name] = BASELINE_COLOR if i == 0 else palette[(i - 1) % len(palette)]
    for name in quality_names:
        if name in colors:
            continue
        match = next((b for b in bench_names[1:] if name.endswith("-" + b)), None)
        used = {c for c in colors.values() if c != BASELINE_COLOR}
        colors[name] = colors[match] if match else palette[len(used) % len(palette)]
    return colors


def _int_ticks(ax, values: Sequence[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(set(values)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{int(v)}"))
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def _save(fig, out_dir: Path, name: str) -> str:
    fig.savefig(out_dir / name, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return name


ROOFLINE_LABEL = "roofline (dashed, in each variant's colour; black: the same for all variants)"


def _figure_legend(fig, axes, roofline: bool = True, crossover: bool = False) -> None:
    """One legend for all panels, below them: the variants' colours and (when drawn) the dashed roofline
    and the dotted lines where the KV cache overtakes the weights."""
    handles, labels = {}, []
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles:
                handles[label] = h
                labels.append(label)
    if roofline:
        handles[ROOFLINE_LABEL] = Line2D([], [], color="black", **ROOFLINE_MARKER)
        labels.append(ROOFLINE_LABEL)
    if crossover:
        handles[CROSSOVER_LABEL] = Line2D([], [], color="black", **CROSSOVER_MARKER)
        labels.append(CROSSOVER_LABEL)
    fig.legend([handles[x] for x in labels], labels, loc="lower center", ncol=min(len(labels), 5),
               bbox_to_anchor=(0.5, -0.02), frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))


def _plot_roofline_lines(ax, bench: dict, phase: str, length_key: str, batch: int, colors: dict[str, str]) -> None:
    """Each variant's predicted times as a dashed line in its colour; one black line when the
    prediction is the same for every variant (e.g. a compute-bound prefill)."""
    lines = {}
    for name in variant_names(bench):
        rs = records(bench, phase, name, batch=batch)
        if rs:
            lines[name] = ([r[length_key] for r in rs], [1e3 * r["roofline"]["predicted_s"] for r in rs])
    same = len({(tuple(x), tuple(round(v, 9) for v in y)) for x, y in lines.values()}) == 1
    for name, (x, y) in lines.items():
        ax.plot(x, y, color="black" if same else colors[name], alpha=0.6, **ROOFLINE_MARKER)
        if same:
            break


def plot_ttft(bench: dict, out_dir: Path, colors: dict[str, str]) -> str | None:
    if not bench["prefill"]:
        return None
    names = variant_names(bench)
    roofline = not roofline_problem(bench)
    batches = sorted({r["batch"] for r in bench["prefill"]})
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, len(batches), figsize=(6.4 * len(batches), 4.6), squeeze=False)
        for ax, b in zip(axes[0], batches):
            _plot_measured_lines(ax, bench, "prefill", "prompt_len", b, names, colors, roofline)
            _int_ticks(ax, [r["prompt_len"] for r in bench["prefill"]])
            ax.set_yscale("log")
            ax.set_xlabel("prompt length (tokens)")
            ax.set_ylabel("TTFT (ms, log scale)")
            ax.set_title(f"Time to first token, batch {b}\n(median; bars: fastest to slowest repeat)")
        _figure_legend(fig, axes.flat, roofline)
        return _save(fig, out_dir, "ttft_vs_prompt.png")


def _plot_measured_lines(ax, bench: dict, phase: str, x_key: str, batch: int, names: list[str],
                         colors: dict[str, str], roofline: bool) -> None:
    """One line of measured median times (ms) per variant against ``x_key``, with error bars from the
    fastest to the slowest repeat, and its roofline lines."""
    for name in names:
        rs = records(bench, phase, name, batch=batch)
        if rs:
            med = [1e3 * r["median_s"] for r in rs]
            spread = [[m - 1e3 * time_range(r)[0] for m, r in zip(med, rs)],
                      [1e3 * time_range(r)[1] - m for m, r in zip(med, rs)]]
            ax.errorbar([r[x_key] for r in rs], med, yerr=spread, fmt="o-", color=colors[name], label=name,
                        capsize=3, elinewidth=1)
    if roofline:
        _plot_roofline_lines(ax, bench, phase, x_key, batch, colors)


def plot_tpot(bench: dict, out_dir: Path, colors: dict[str, str]) -> str | None:
    if not bench["decode"]:
        return None
    names = variant_names(bench)
    roofline = not roofline_problem(bench)
    batches = sorted({r["batch"] for r in bench["decode"]})
    cols = min(len(batches), 2)
    rows = -(-len(batches) // cols)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows + 0.5), squeeze=False)
        contexts = [r["context_len"] for r in bench["decode"]]
        crossed = False
        for ax, b in zip(axes.flat, batches):
            _plot_measured_lines(ax, bench, "decode", "context_len", b, names, colors, roofline)
            _int_ticks(ax, contexts)
            for g in cache_growth(bench, b):  # where the cache reads as many bytes as the weights
                if min(contexts) <= g.crossover_context <= max(contexts):
                    ax.axvline(g.crossover_context, color=colors[g.variant], **CROSSOVER_MARKER)
                    crossed = True
            ax.set_ylim(bottom=0)
            ax.set_xlabel("context length (tokens in the KV cache)")
            ax.set_ylabel("TPOT (ms)")
            ax.set_title(f"Time per output token, batch {b}\n(median; bars: fastest to slowest repeat)")
        for ax in list(axes.flat)[len(batches):]:
            ax.set_visible(False)
        _figure_legend(fig, list(axes.flat)[:len(batches)], roofline, crossover=crossed)
        return _save(fig, out_dir, "tpot_vs_context.png")


def plot_speedups(bench: dict, out_dir: Path, colors: dict[str, str]) -> str | None:
    """Bars in each variant's colour: median prefill (hatched) and decode (solid) speedup over the
    lengths, whiskers over the range the repeats allow at every length (slowest baseline repeat over
    fastest variant repeat, and the other way round), roofline as diamonds (when the device spec gives one)."""
    pf, dc = speedups(bench, "prefill"), speedups(bench, "decode")
    if not pf and not dc:
        return None
    min_batch = min((s["batch"] for s in dc), default=None)
    dc1 = [s for s in dc if s["batch"] == min_batch]
    names = [n for n in variant_names(bench) if any(s["variant"] == n for s in pf + dc1)]
    roofline = not roofline_problem(bench)
    groups = [("prefill (TTFT)", pf, "//"), (f"decode (TPOT, batch {min_batch})", dc1, "")]
    width = 0.38
    top = max([s["high"] for s in pf + dc1] + ([s["predicted"] for s in pf + dc1] if roofline else [])) * 1.15
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=(max(6.0, 2.2 * len(names) + 2), 4.4))
        ax.set_ylim(0, top)
        for gi, (label, data, hatch) in enumerate(groups):
            for vi, name in enumerate(names):
                mine = [s for s in data if s["variant"] == name]
                if not mine:
                    continue
                x = vi + (gi - 0.5) * width
                med = statistics.median(s["measured"] for s in mine)
                low, high = min(s["low"] for s in mine), max(s["high"] for s in mine)
                ax.bar(x, med, width * 0.92, color=colors[name], alpha=0.55 if hatch else 1.0, hatch=hatch,
                       edgecolor="white", yerr=[[med - low], [high - med]], capsize=4, ecolor="#333333")
                ax.text(x, 0.02 * top, f"{med:.2f}x", ha="center", va="bottom", fontsize=9, fontweight="bold",
                        bbox=dict(boxstyle="round,pad=0.2", facecolor="white", edgecolor="none", alpha=0.85))
                if roofline:
                    ax.plot([x], [statistics.median(s["predicted"] for s in mine)], "D", color="black", markersize=6)
        ax.axhline(1.0, color="gray", linewidth=1)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
        ax.set_ylabel(f"speedup over {bench.get('baseline')} (x)")
        ax.set_title("Prefill vs decode speedup (median over lengths;\nwhiskers: the range the repeats allow over all lengths)")
        legend = [matplotlib.patches.Patch(facecolor="#bbbbbb", hatch=h, edgecolor="white", label=label)
                  for label, _, h in groups]
        if roofline:
            legend.append(Line2D([], [], marker="D", linestyle="", color="black", label="roofline prediction"))
        ax.legend(handles=legend, loc="upper left")
        return _save(fig, out_dir, "speedups.png")


def _roofline_title(bench: dict) -> str:
    """The left panel's title: says where the points sit only when that is true of all of them."""
    ridge = bench["device"]["spec"]["ridge_intensity"]
    decode_left = all(r["roofline"]["intensity"] < ridge for r in bench["decode"])
    prefill_right = all(r["roofline"]["intensity"] > ridge for r in bench["prefill"])
    if bench["decode"] and bench["prefill"] and decode_left and prefill_right:
        return "Roofline: decode (circles) is left of the ridge, prefill (squares) right"
    return "Roofline: achieved flop/s of decode (circles) and prefill (squares)"


def plot_roofline(bench: dict, out_dir: Path, colors: dict[str, str]) -> str | None:
    """Left: the roofline (achieved flop/s against arithmetic intensity). Right: measured vs predicted time."""
    recs = bench["prefill"] + bench["decode"]
    if not recs or roofline_problem(bench):
        return None
    spec = bench["device"]["spec"]
    names = variant_names(bench)
    with plt.rc_context(STYLE):
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
        intens = [r["roofline"]["intensity"] for r in recs]
        lo, hi = min(intens) / 2, max(max(intens) * 2, spec["ridge_intensity"] * 4)
        xs = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(xs, [min(spec["peak_flops"], spec["memory_bandwidth"] * x) for x in xs], color="black",
                linewidth=1.5, label=f"roofline ({spec['source']})")
        ax.axvline(spec["ridge_intensity"], color="gray", linestyle=":", linewidth=1)
        ax.annotate(f"ridge {fmt_intensity(spec['ridge_intensity'])} flop/B", (spec["ridge_intensity"], spec["peak_flops"]),
                    textcoords="offset points", xytext=(4, -14), fontsize=8, color="gray")
        for phase, marker in (("prefill", "s"), ("decode", "o")):
            for name in names:
                rs = records(bench, phase, name)
                if rs:
                    ax.scatter([r["roofline"]["intensity"] for r in rs], [r["achieved_flops"] for r in rs],
                               marker=marker, color=colors[name], alpha=0.8, edgecolor="white", linewidth=0.5)
                    ax2.scatter([1e3 * r["roofline"]["predicted_s"] for r in rs], [1e3 * r["median_s"] for r in rs],
                                marker=marker, color=colors[name], alpha=0.8, edgecolor="white", linewidth=0.5)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("arithmetic intensity (flop / byte)")
        ax.set_ylabel("achieved flop/s")
        ax.set_title(_roofline_title(bench))
        legend = [Line2D([], [], color="black", label=f"roofline ({spec['source']})")]
        legend += [Line2D([], [], marker="o", linestyle="", color=colors[n], label=n) for n in names]
        legend += [Line2D([], [], marker="s", linestyle="", color="gray", label="prefill"),
                   Line2D([], [], marker="o", linestyle="", color="gray", label="decode")]
        ax.legend(handles=legend, loc="lower right")

        pts = [1e3 * r["roofline"]["predicted_s"] for r in recs] + [1e3 * r["median_s"] for r in recs]
        a, b = min(pts) / 1.5, max(pts) * 1.5
        ax2.plot([a, b], [a, b], color="black", linewidth=1, label="measured = roofline")
        for k, style in ((2, ":"), (10, "--")):
            ax2.plot([a, b], [a * k, b * k], color="gray", linestyle=style, linewidth=0.8, label=f"{k}x roofline")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.set_xlim(a, b)
        ax2.set_ylim(a, b * 12)
        ax2.set_xlabel("roofline prediction (ms)")
        ax2.set_ylabel("measured (ms)")
        ax2.set_title("Measured time against the roofline prediction")
        ax2.legend(handles=ax2.get_legend_handles_labels()[0] + legend[1:], loc="upper left")
        fig.tight_layout()
        return _save(fig, out_dir, "roofline.png")


def bench_plots(bench: dict, out_dir: Path, colors: dict[str, str] | None = None) -> dict[str, str]:
    colors = colors or variant_colors(variant_names(bench))
    made = {"ttft": plot_ttft(bench, out_dir, colors), "tpot": plot_tpot(bench, out_dir, colors),
            "speedups": plot_speedups(bench, out_dir, colors), "roofline": plot_roofline(bench, out_dir, colors)}
    return {k: v for k, v in made.items() if v}


def quality_plots(quality: Sequence[QualityResult], out_dir: Path, colors: dict[str, str] | None = None) -> dict[str, str]:
    """Bars per variant: perplexity increase over the unquantized model (or perplexity when no
    baseline is known) and KL divergence (log scale when the values span decades)."""
    if not quality:
        return {}
    names = [q.name for q in quality]
    colors = colors or variant_colors([], names)
    has_kl = any(q.kl_divergence is not None for q in quality)
    relative = all(q.perplexity_increase is not None for q in quality)
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(1, 2 if has_kl else 1, figsize=(11 if has_kl else 6, 4.4), squeeze=False)
        ax = axes[0][0]
        x = range(len(quality))
        if relative:
            vals = [100 * q.perplexity_increase for q in quality]
            # two standard errors of the change, where the results carry one
            noise = [200 * q.log_ppl_ratio_stderr if q.log_ppl_ratio_stderr is not None else 0.0 for q in quality]
            ax.bar(x, vals, color=[colors[n] for n in names], yerr=noise if any(noise) else None, capsize=4,
                   ecolor="#333333")
            ax.axhline(0, color="black", linewidth=0.8)
            for i, q in enumerate(quality):
                label = f"{vals[i]:+.2f}%" + (" (noise)" if q.within_noise else "") + f"\n(ppl {q.perplexity:.3f})"
                ax.annotate(label, (i, max(vals[i] + noise[i], 0)),
                            textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            top = max(max(v + n for v, n in zip(vals, noise)), 0)
            bottom = min(min(v - n for v, n in zip(vals, noise)), 0)
            ax.set_ylim(bottom * 1.3, top * 1.35 + 1e-3)
            base = statistics.median(q.baseline_perplexity for q in quality)
            ax.set_ylabel("perplexity increase (%)")
            ax.set_title(f"Perplexity vs unquantized ({base:.3f}); lower is better"
                         + ("\nwhiskers: ±2 standard errors (noise)" if any(noise) else
                            "\nnoise not measured (no standard error in these results)"))
        else:
            vals = [q.perplexity for q in quality]
            ax.bar(x, vals, color=[colors[n] for n in names])
            for i, v in enumerate(vals):
                ax.annotate(f"{v:.3f}", (i, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            ax.set_ylabel("perplexity")
            ax.set_title("Perplexity (lower is better)")
        if has_kl:
            ax2 = axes[0][1]
            kl = [q.kl_divergence or 0.0 for q in quality]
            ax2.bar(x, kl, color=[colors[n] for n in names])
            positive = [v for v in kl if v > 0]
            if positive and max(positive) / min(positive) > 100:
                ax2.set_yscale("log")
                ax2.set_ylim(min(positive) / 3, max(positive) * 4)
            else:
                ax2.set_ylim(0, max(kl) * 1.2 + 1e-12)
            for i, v in enumerate(kl):
                ax2.annotate(f"{v:.3g}", (i, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=8)
            ax2.set_ylabel("nats / token")
            ax2.set_title("KL(unquantized || quantized); lower is better")
        for a in axes.flat:
            a.set_xticks(list(x))
            a.set_xticklabels(names, rotation=15)
        fig.tight_layout()
        return {"quality": _save(fig, out_dir, "quality.png")}
