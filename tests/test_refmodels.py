"""Reference models: corpus split, tokenizer, committed weights, and the deterministic builder."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from quantkit import refmodels
from quantkit.refmodels import corpus, registry
from quantkit.refmodels.cli import main as refmodels_main
from quantkit.refmodels.spec import RefModelSpec
from quantkit.refmodels.store import build_atomically, committed_folder, is_complete
from quantkit.refmodels.tokenizer import BOS_TOKEN, EOS_TOKEN, train_tokenizer
from quantkit.refmodels.train import heldout_nll

# A spec small enough to train in seconds: 1 layer, 384 tokens, 4 steps on ~60 kB of text.
MICRO = RefModelSpec(
    name="micro",
    vocab_size=384,
    hidden_size=128,
    intermediate_size=128,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    context_length=64,
    steps=4,
    batch_size=4,
    lr=3e-3,
    warmup_steps=1,
    seed=7,
    max_train_bytes=60_000,
    tokenizer_train_bytes=200_000,
)
HELDOUT_SLICE_BYTES = 40_000
QUICK_BUILD = dict(num_threads=1, progress=False, heldout_max_bytes=HELDOUT_SLICE_BYTES)


@pytest.fixture
def short_heldout(monkeypatch):
    """Builds score only the first HELDOUT_SLICE_BYTES of the held-out text (keeps tests fast)."""
    full = corpus.heldout_text
    monkeypatch.setattr(corpus, "heldout_text", lambda max_bytes=None, root=None: full(HELDOUT_SLICE_BYTES, root))


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("QUANTKIT_CACHE_DIR", raising=False)  # it wins over the older name set here
    monkeypatch.setenv("QUANTKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---- corpus -------------------------------------------------------------------------------------

def test_split_is_deterministic_disjoint_and_covers_every_file():
    train, heldout = corpus.split_files()
    assert (train, heldout) == corpus.split_files()
    assert not set(train) & set(heldout)
    assert sorted(train + heldout) == corpus.corpus_files()
    assert train == sorted(train) and heldout == sorted(heldout)
    assert 0.05 < len(heldout) / (len(train) + len(heldout)) < 0.2
    assert all(corpus.is_heldout(p) for p in heldout) and not any(corpus.is_heldout(p) for p in train)


def test_corpus_excludes_tests_site_packages_and_big_files(tmp_path):
    files = {
        "os.py": "import sys\n",
        "json/decoder.py": "x = 1\n",
        "test/test_os.py": "pass\n",
        "unittest/test/test_case.py": "pass\n",
        "idlelib/editor.py": "pass\n",
        "lib2to3/main.py": "pass\n",
        "site-packages/pkg/mod.py": "pass\n",
        "big.py": "#" * (corpus.MAX_FILE_BYTES + 1),
        "notes.txt": "not python\n",
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert corpus.corpus_files(tmp_path) == ["json/decoder.py", "os.py"]


def test_texts_come_from_their_own_split_and_respect_the_cap():
    root = corpus.stdlib_root()
    train, heldout = corpus.split_files()
    heldout_texts = corpus.heldout_documents(max_bytes=100_000)
    assert heldout_texts == [corpus.read_source(root, p) for p in heldout[: len(heldout_texts)]]
    capped = corpus.train_text(max_bytes=150_000)
    assert 0 < len(capped.encode()) <= 150_000
    assert capped == corpus.train_text(max_bytes=150_000)
    train_set = {corpus.read_source(root, p) for p in train}
    assert all(doc in train_set for doc in corpus.train_documents(max_bytes=150_000))


def test_text_paths_are_cached_files_with_the_split_text(tmp_cache):
    path = refmodels.heldout_text_path()
    assert path.is_relative_to(tmp_cache) and path.read_text(encoding="utf-8") == corpus.heldout_text()
    mtime = path.stat().st_mtime_ns
    assert refmodels.heldout_text_path() == path and path.stat().st_mtime_ns == mtime
    train_path = refmodels.train_text_path()
    assert train_path != path and train_path.stat().st_size > 5 * path.stat().st_size


# ---- tokenizer ----------------------------------------------------------------------------------

def test_bpe_tokenizer_round_trips_any_text():
    tokenizer = train_tokenizer(corpus.train_documents(max_bytes=200_000), vocab_size=512)
    assert tokenizer.get_vocab_size() == 512
    samples = [corpus.heldout_text(max_bytes=20_000), "déjà vu \t\r\n 🐍 \x00 λx: x**2\n", "   indented\n\n"]
    for text in samples:
        ids = tokenizer.encode(text).ids
        assert ids[0] == tokenizer.token_to_id(BOS_TOKEN)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


# ---- committed models ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(refmodels.REFERENCE_MODELS))
def test_committed_model_loads_with_required_dims_and_has_learned(name):
    spec = refmodels.REFERENCE_MODELS[name]
    folder = committed_folder(spec)
    assert is_complete(folder, spec), (
        f"{folder} is missing or stale: run python -m quantkit.refmodels build {name} --out {folder} --force")
    assert refmodels.reference_model_path(name) == folder

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.is_fast and tokenizer.bos_token == BOS_TOKEN and tokenizer.eos_token == EOS_TOKEN
    text = corpus.heldout_text(max_bytes=HELDOUT_SLICE_BYTES)
    ids = tokenizer(text, verbose=False)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text

    model = AutoModelForCausalLM.from_pretrained(folder)
    cfg = model.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        spec.hidden_size, spec.intermediate_size, spec.num_layers)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (
        spec.num_heads, spec.num_kv_heads, spec.vocab_size)
    assert cfg.num_key_value_heads < cfg.num_attention_heads and cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert next(model.parameters()).dtype == torch.float32
    for module_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.in_features % 128 == 0 and module.out_features % 64 == 0, module_name
    stored = load_file(folder / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in stored.values())

    nll, count = heldout_nll(model, torch.tensor(ids[: 8 * spec.context_length]), spec.context_length)
    random_loss = math.log(spec.vocab_size)
    assert nll / count < 0.7 * random_loss, f"held-out loss {nll / count:.2f} vs random {random_loss:.2f}"

    record = json.loads((folder / "training.json").read_text())
    assert record["spec"] == spec.to_dict() and record["heldout_window"] == spec.context_length
    assert record["heldout_perplexity"] < spec.vocab_size / 10


# ---- building -----------------------------------------------------------------------------------

def test_micro_build_is_loadable_and_deterministic(tmp_path):
    first = build_atomically(MICRO, tmp_path / "a", **QUICK_BUILD)
    second = build_atomically(MICRO, tmp_path / "b", **QUICK_BUILD)
    assert is_complete(first, MICRO)
    assert not list(tmp_path.glob(".*")), "staging folders must not be left behind"
    weights_a, weights_b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()

    model = AutoModelForCausalLM.from_pretrained(first)
    tokenizer = AutoTokenizer.from_pretrained(first)
    ids = tokenizer("def f(x):\n    return x\n", return_tensors="pt")["input_ids"]
    assert model(input_ids=ids).logits.shape == (1, ids.shape[1], MICRO.vocab_size)
    record = json.loads((first / "training.json").read_text())
    assert record["tokens_seen"] == MICRO.steps * MICRO.batch_size * MICRO.context_length
    assert math.isfinite(record["final_train_loss"]) and record["heldout_perplexity"] > 1

    changed = dataclasses.replace(MICRO, seed=8)
    third = build_atomically(changed, tmp_path / "c", **QUICK_BUILD)
    weights_c = load_file(third / "model.safetensors")
    assert not torch.equal(weights_a["model.embed_tokens.weight"], weights_c["model.embed_tokens.weight"])


def test_reference_model_path_builds_into_the_cache_once(tmp_cache, short_heldout, monkeypatch):
    monkeypatch.setitem(registry.REFERENCE_MODELS, "micro", MICRO)
    path = refmodels.reference_model_path("micro")
    assert path == tmp_cache / "refmodels" / f"micro-{MICRO.spec_hash()}" and is_complete(path, MICRO)
    stamp = (path / "training.json").stat().st_mtime_ns
    assert refmodels.reference_model_path("micro") == path
    assert (path / "training.json").stat().st_mtime_ns == stamp
    assert refmodels.resolve_model_name("ref:micro") == str(path)
    assert refmodels.resolve_model_name("meta-llama/Llama-3.2-1B") == "meta-llama/Llama-3.2-1B"
    assert refmodels.resolve_model_name("./ref:not-a-prefix") == "./ref:not-a-prefix"


def test_cli_build_writes_into_out(tmp_path, short_heldout, monkeypatch, capsys):
    monkeypatch.setitem(registry.REFERENCE_MODELS, "micro", dataclasses.replace(MICRO, steps=2))
    out = tmp_path / "built"
    assert refmodels_main(["build", "micro", "--out", str(out), "--no-progress", "--threads", "1"]) == 0
    assert is_complete(out, registry.REFERENCE_MODELS["micro"]) and str(out) in capsys.readouterr().out


def test_build_refuses_to_replace_a_folder_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="quantkit did not write it"):
        build_atomically(MICRO, tmp_path, force=True, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_unknown_model_name_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown reference model 'huge'.*small, tiny"):
        refmodels.reference_model_path("huge")
    with pytest.raises(ValueError, match="unknown reference model"):
        refmodels.resolve_model_name("ref:huge")
    with pytest.raises(SystemExit):
        refmodels_main(["build", "huge"])


@pytest.mark.parametrize("out", ["m" * 300, "m" * 300 + "/model"], ids=["name", "folder"])
def test_cli_names_an_output_path_too_long_for_the_filesystem(tmp_path, monkeypatch, capsys, out):
    monkeypatch.chdir(tmp_path)
    assert refmodels_main(["build", "tiny", "--out", out, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"python -m quantkit.refmodels build: error: cannot write {tmp_path / out}: ")
    assert "300 bytes" in err and err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_cli_reports_an_interrupt_and_a_full_disk_as_quantkit_does(tmp_path, monkeypatch, capsys):
    from quantkit.core.errors import NoSpaceError
    from quantkit.refmodels import cli

    for raised, status, line in [
        (KeyboardInterrupt(), 130, "interrupted"),
        (NoSpaceError("no space left on the device: free 1 GB"), 1, "error: no space left on the device: free 1 GB"),
    ]:
        def fail(*args, **kwargs):
            raise raised

        monkeypatch.setattr(cli, "build_atomically", fail)
        assert refmodels_main(["build", "tiny", "--out", str(tmp_path / "m")]) == status
        assert capsys.readouterr().err == f"python -m quantkit.refmodels build: {line}\n"


def test_spec_rejects_dimensions_real_kernels_cannot_take():
    with pytest.raises(ValueError, match="multiples of 128"):
        dataclasses.replace(MICRO, intermediate_size=688)
    with pytest.raises(ValueError, match="not divisible by num_kv_heads"):
        dataclasses.replace(MICRO, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown RefModelSpec fields"):
        RefModelSpec.from_dict({**MICRO.to_dict(), "dropout": 0.1})
    assert RefModelSpec.from_dict(MICRO.to_dict()) == MICRO
    assert dataclasses.replace(MICRO, lr=1e-3).spec_hash() != MICRO.spec_hash()


def test_heldout_nll_scores_each_window_alone():
    from quantkit.refmodels.train import llama_config

    torch.manual_seed(0)
    special_ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    model = AutoModelForCausalLM.from_config(llama_config(MICRO, special_ids))
    ids = torch.randint(0, MICRO.vocab_size, (5 * 64 + 17,))
    expected_nll, expected_count = 0.0, 0
    for window in torch.split(ids, 64):  # [64] x 5, then [17]
        logits = model(input_ids=window[None]).logits[0]  # [T, V]
        expected_nll += torch.nn.functional.cross_entropy(logits[:-1], window[1:], reduction="sum").item()
        expected_count += window.numel() - 1
    for tokens_per_batch in (64, 128, 4096):
        nll, count = heldout_nll(model, ids, 64, tokens_per_batch=tokens_per_batch)
        assert count == expected_count == 5 * 63 + 16
        assert nll == pytest.approx(expected_nll, rel=1e-5)
