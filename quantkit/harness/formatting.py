"""Numbers as the report, the plots and the CLI print them."""

from __future__ import annotations

from .results import perplexity_change_within_noise


def fmt_intensity(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.1f}"


def fmt_perplexity_change(perplexity: float, baseline: float | None, log_ratio_stderr: float | None) -> str:
    """'+0.11% ± 0.05%': the change over the baseline and two standard errors of it, with
    '(within noise)' when the change is inside them; '–' without a baseline."""
    if not baseline:
        return "–"
    cell = f"{100 * (perplexity / baseline - 1):+.2f}%"
    if log_ratio_stderr is not None:
        cell += f" ± {100 * 2 * log_ratio_stderr:.2f}%"
        if perplexity_change_within_noise(perplexity, baseline, log_ratio_stderr):
            cell += " (within noise)"
    return cell
