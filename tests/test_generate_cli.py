"""`quantkit generate` (quantkit/commands/generate.py): streams transformers' tokens as whole characters, says
which loop ran and the tokens/s of prefill and decode, stops at --stop strings; bad input exits 2."""

from __future__ import annotations

import io
import shutil

import pytest
import torch
from transformers import AutoTokenizer

import quantkit
from quantkit.commands.cli import main
from quantkit.commands.generate import TextStream
from quantkit.kernels.cpu_extension import load_cpu_kernels
from quantkit.refmodels import resolve_model_name

from .conftest import make_random_model

needs_kernels = pytest.mark.skipif(not load_cpu_kernels().available, reason=load_cpu_kernels().reason)
PROMPT = "def main():\n    "


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_name("ref:tiny"))


def greedy_text(model_name, prompt, n):
    model = quantkit.load(model_name, fast_generate=False)
    tok = AutoTokenizer.from_pretrained(resolve_model_name(model_name))
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def printed(text):
    """What the command writes for `text`: it, and a newline if it ends without one."""
    return text + ("" if text.endswith("\n") else "\n")


@needs_kernels
def test_streams_the_greedy_text_and_reports_the_loop_and_speeds(capsys):
    assert main(["generate", "ref:tiny", "--prompt", PROMPT, "--max-new-tokens", "12", "--threads", "1"]) == 0
    out, err = capsys.readouterr()
    assert out == printed(greedy_text("ref:tiny", PROMPT, 12))
    line = err.strip().splitlines()[-1]
    assert "prefill: " in line and "decode: 11 tokens in" in line and "tokens/s" in line
    assert "greedy; quantkit's C++ loop, 1 thread; stopped at --max-new-tokens" in line


@needs_kernels
def test_sampling_with_a_seed_repeats(capsys):
    args = ["generate", "ref:tiny", "--prompt", PROMPT, "--max-new-tokens", "16", "--temperature", "0.9",
            "--top-k", "40", "--top-p", "0.95", "--seed", "3"]
    texts = []
    for _ in range(2):
        assert main(args) == 0
        out, err = capsys.readouterr()
        texts.append(out)
        assert "sampling at temperature 0.9, top-k 40, top-p 0.95; quantkit's C++ loop" in err
    assert texts[0] == texts[1]


@needs_kernels
def test_a_stop_string_ends_the_text_where_it_ends(capsys):
    full = greedy_text("ref:small", PROMPT, 24)
    stop = full[len(full) // 2: len(full) // 2 + 2]
    assert main(["generate", "ref:small", "--prompt", PROMPT, "--max-new-tokens", "24", "--stop", stop, "zzzz"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == full[:full.index(stop) + len(stop)].rstrip("\n")
    assert "stopped at a --stop string" in err


@needs_kernels
def test_a_gguf_file_generates_with_its_own_tokenizer(tmp_path, capsys):
    pytest.importorskip("gguf")
    gguf_file = tmp_path / "tiny.gguf"
    assert main(["export", "ref:tiny", "--format", "gguf", "--out", str(gguf_file), "--float-type", "f32"]) == 0
    capsys.readouterr()
    assert main(["generate", str(gguf_file), "--prompt", PROMPT, "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    assert out == printed(greedy_text("ref:tiny", PROMPT, 6))  # f32 weights: the model itself
    assert "quantkit's C++ loop" in err


@needs_kernels
def test_chat_puts_the_prompt_in_the_chat_template(tmp_path, capsys):
    folder = tmp_path / "tiny-chat"
    shutil.copytree(resolve_model_name("ref:tiny"), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    tok.save_pretrained(folder)
    assert main(["generate", str(folder), "--prompt", "hello", "--chat", "--max-new-tokens", "5"]) == 0
    templated = "<|bos|>user: hello\nassistant:"
    ids = tok(templated, add_special_tokens=False, return_tensors="pt")["input_ids"]
    assert ids[0, 0] == tok.bos_token_id and (ids[0] == tok.bos_token_id).sum() == 1  # no second BOS added
    want = quantkit.load(folder, fast_generate=False).generate(ids, max_new_tokens=5, do_sample=False)
    assert capsys.readouterr().out == printed(tok.decode(want[0, ids.shape[1]:], skip_special_tokens=True))


def test_a_model_the_loop_cannot_run_goes_to_transformers_with_the_reason(tmp_path, capsys):
    model = make_random_model("mistral", vocab=4096)  # sliding-window attention: not in the loop
    model.save_pretrained(tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{resolve_model_name('ref:tiny')}/{name}", tmp_path / "m" / name)
    assert main(["generate", str(tmp_path / "m"), "--prompt", "x = 1", "--max-new-tokens", "3"]) == 0
    assert "transformers, because sliding-window attention (sliding_window=4096)" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-0.5"], "--temperature: must be >= 0"),
    (["--top-p", "0"], "--top-p: must be > 0"),
    (["--top-p", "1.5"], "--top-p: must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k: must be an integer >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be an integer >= 1"),
    (["--temperature", "nan"], "expected a finite number"),
    (["--stop", ""], "--stop takes non-empty strings"),
    (["--chat"], "has no chat template; drop --chat"),
    (["--max-new-tokens", "600"], "exceed the model's context of 256 positions; give --max-new-tokens 251"),
])
def test_bad_input_exits_2_with_one_line(args, message, capsys):
    try:
        status = main(["generate", "ref:tiny", "--prompt", PROMPT, *args])
    except SystemExit as e:  # argparse's own errors (CommandParser)
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("quantkit generate: error: ") and message in err[-1], err


def test_the_stream_writes_whole_characters_and_the_same_text(tokenizer):
    text = "naïve café: 日本語 🙂 ok"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(text.encode()) // 3  # byte-level pieces, some inside characters
    out = Recorder()
    stream = TextStream(tokenizer, [], out)
    stream.put(torch.tensor([[0]]))  # the prompt
    for token in ids:
        stream.put(torch.tensor([token]))
    stream.end()
    assert "".join(out.writes) == text == stream.text
    assert all("\ufffd" not in piece for piece in out.writes)


def test_the_stream_stops_writing_at_the_first_stop_string(tokenizer):
    ids = tokenizer("print(1)\nprint(2)\nprint(3)", add_special_tokens=False)["input_ids"]
    out = Recorder()
    stream = TextStream(tokenizer, ["(2)", "\n"], out)
    stream.put(torch.tensor([[0]]))
    for token in ids:
        stream.put(torch.tensor([token]))
    stream.end()
    assert stream.text == "print(1)\n"


class Recorder(io.StringIO):
    def __init__(self):
        super().__init__()
        self.writes = []

    def write(self, text):
        if text:
            self.writes.append(text)
        return len(text)
