"""The README keeps what a user needs on the first day and points to the reference pages in docs/; every
relative link of README.md and docs/*.md names a file of the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_every_relative_link_names_a_file(page):
    for target, _ in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), f"{page.name} links {target}, which does not exist"


def test_the_readme_starts_with_the_two_commands_and_links_the_reference():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block == ["pip install torch==2.13.0 && pip install -e . && quantkit demo",
                           "pip install torch==2.13.0 && pip install -e '.[dev]' && python -m pytest -q"]
    for page in ("docs/safety.md", "docs/checkpoint-format.md", "docs/vllm.md"):
        assert f"]({page})" in text, f"the README does not link {page}"


def test_the_reference_pages_hold_what_left_the_readme():
    """The output contract, the checkpoint checks and the vLLM plugin live in one place each."""
    safety = (ROOT / "docs" / "safety.md").read_text(encoding="utf-8")
    for fact in ("`quantkit COMMAND: error: ...`", "`.quantkit-output.json`", "/dev/stdout", "renameat2"):
        assert fact in safety
    checkpoint = (ROOT / "docs" / "checkpoint-format.md").read_text(encoding="utf-8")
    assert "weight_packed" in checkpoint and "kv_cache_scheme" in checkpoint
    vllm = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    assert "VLLM_DISABLED_KERNELS=QuantkitWNA16LinearKernel" in vllm


def test_the_readme_stays_a_first_page():
    """The README is the two commands, what quantkit is, one example per entry point and links: reference
    material lives in docs/ (a README past 200 lines has grown back into a manual)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move reference material into docs/"
