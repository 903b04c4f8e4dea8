"""Help texts name the placeholders their usage line shows."""

import argparse
import re

from quantkit.commands import eval as eval_cmd


def test_eval_help_names_the_baseline_as_its_usage_does():
    parser = argparse.ArgumentParser(prog="quantkit")
    eval_cmd.register(parser.add_subparsers())
    sub = parser._subparsers._group_actions[0].choices["eval"]
    usage, description = sub.format_usage(), sub.description
    placeholders = set(re.findall(r"\b[A-Z][A-Z_]{3,}\b", description))
    assert placeholders and all(p in usage or p.lower() in usage for p in placeholders), (placeholders, usage)
    assert "BASELINE" in description
