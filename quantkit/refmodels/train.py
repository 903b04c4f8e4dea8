"""Deterministic training of a reference model from its RefModelSpec.

Steps: train the tokenizer on the train split -> tokenize train files into one stream
(``<|bos|> file <|eos|>`` per file) -> AdamW over windows of ``context_length + 1`` tokens in a
seeded order -> write the model folder (bf16 safetensors, tokenizer, ``training.json``) -> reload
that folder and measure held-out perplexity on what users actually get.
"""

from __future__ import annotations

import json
import math
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from . import corpus
from .spec import TRAINING_RECORD, WEIGHTS_FILE, RefModelSpec
from .tokenizer import save_tokenizer, special_token_ids, train_tokenizer



def llama_config(spec: RefModelSpec, token_ids: dict[str, int]) -> LlamaConfig:
    """The transformers config for ``spec`` (GQA, RoPE, SwiGLU, tied embeddings, no biases)."""
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.context_length,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        **token_ids,
    )


def token_stream(tokenizer, documents: list[str]) -> torch.Tensor:
    """int64 [N]: ``<|bos|> doc <|eos|>`` for every document, concatenated in order."""
    eos_id = special_token_ids(tokenizer)["eos_token_id"]
    encodings = tokenizer.encode_batch(documents)  # the post-processor adds <|bos|>
    ids = []
    for encoding in encodings:
        ids.extend(encoding.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def window_batches(stream: torch.Tensor, spec: RefModelSpec, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless int64 [batch, context+1] batches of windows cut from ``stream``, in a seeded order.

    Each epoch starts the non-overlapping windows at a fresh random offset in [0, context) and
    visits them in a fresh random permutation; all randomness comes from ``generator``.
    """
    span = spec.context_length + 1
    if stream.numel() < span + spec.context_length:
        raise ValueError(
            f"the training stream has {stream.numel()} tokens, too few for windows of {span}: "
            f"raise max_train_bytes or lower context_length"
        )
    pending: list[torch.Tensor] = []
    while True:
        offset = int(torch.randint(0, spec.context_length, (1,), generator=generator))
        count = (stream.numel() - offset) // span
        starts = offset + torch.randperm(count, generator=generator) * span
        for start in starts.tolist():
            pending.append(stream[start : start + span])
            if len(pending) == spec.batch_size:
                yield torch.stack(pending)  # [B, T+1]
                pending = []


def lr_lambda(spec: RefModelSpec):
    """Multiplier of spec.lr at each step: linear warmup, then cosine decay to min_lr_ratio."""

    def multiplier(step: int) -> float:
        if step < spec.warmup_steps:
            return (step + 1) / spec.warmup_steps
        progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return multiplier


@contextmanager
def torch_threads(num_threads: int | None):
    """Run the body with ``torch.set_num_threads(num_threads)`` (None: leave it), then restore."""
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def optimizer_for(model: torch.nn.Module, spec: RefModelSpec) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings, linears) and none on norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


def train_model(spec: RefModelSpec, tokenizer, *, progress: bool = True) -> tuple[LlamaForCausalLM, dict]:
    """Train a fresh fp32 model for ``spec.steps`` steps; returns (model, statistics)."""
    documents = corpus.train_documents(spec.max_train_bytes)
    stream = token_stream(tokenizer, documents)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, special_token_ids(tokenizer)))
    model.config.use_cache = False
    model.train()
    optimizer = optimizer_for(model, spec)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(spec))
    batches = window_batches(stream, spec, torch.Generator().manual_seed(spec.seed + 1))

    started = time.perf_counter()
    recent: list[float] = []
    bar = tqdm(range(spec.steps), desc=f"train {spec.name}", unit="step", disable=not progress, mininterval=2.0)
    for step in bar:
        batch = next(batches)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # [B, T] each
        logits = model(input_ids=inputs).logits  # [B, T, V]
        loss = F.cross_entropy(logits.reshape(-1, spec.vocab_size), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        recent = (recent + [loss.item()])[-20:]
        elapsed = time.perf_counter() - started
        bar.set_postfix(loss=f"{recent[-1]:.3f}", tok_s=f"{(step + 1) * spec.tokens_per_step / elapsed:.0f}")
    bar.close()
    stats = {
        "train_files": len(documents),
        "train_bytes": sum(len(d.encode("utf-8")) for d in documents),
        "train_stream_tokens": int(stream.numel()),
        "tokens_seen": spec.train_tokens,
        "epochs": round(spec.train_tokens / stream.numel(), 3),
        "final_train_loss": round(sum(recent) / len(recent), 4),
        "final_train_loss_note": "mean over the last 20 steps",
        "train_seconds": round(time.perf_counter() - started, 1),
    }
    model.eval()
    return model, stats


@torch.no_grad()
def heldout_nll(model, token_ids: torch.Tensor, window: int, tokens_per_batch: int = 8192) -> tuple[float, int]:
    """(total negative log-likelihood in nats, predicted tokens) over non-overlapping windows.

    ``token_ids`` int64 [N] is cut into windows of ``window`` tokens (the last one may be shorter);
    each window is scored on its own: every token but the window's first is predicted. Full windows
    are batched ``tokens_per_batch // window`` at a time.
    """
    windows = list(torch.split(token_ids, window))
    if windows and windows[-1].numel() < 2:
        windows.pop()
    full = [w for w in windows if w.numel() == window]
    per_batch = max(1, tokens_per_batch // window)
    chunks = [torch.stack(full[i : i + per_batch]) for i in range(0, len(full), per_batch)]  # [b, window]
    chunks += [w[None] for w in windows if w.numel() != window]  # the short tail, [1, n]
    total, count = 0.0, 0
    for chunk in chunks:
        logits = model(input_ids=chunk).logits.float()  # [b, T, V]
        targets = chunk[:, 1:]  # [b, T-1]
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
        total += nll.item()
        count += targets.numel()
    return total, count


def heldout_perplexity(folder: Path, text: str, window: int) -> dict:
    """Perplexity of the model saved in ``folder`` on ``text``, as the folder loads for users."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.int64)
    nll, count = heldout_nll(model, ids, window)
    return {
        "heldout_perplexity": round(math.exp(nll / count), 3),
        "heldout_loss": round(nll / count, 4),
        "heldout_tokens": int(ids.numel()),
        "heldout_bytes": len(text.encode("utf-8")),
        "heldout_window": window,
        "heldout_method": (
            f"tokenizer(text) with <|bos|> once at the start, cut into non-overlapping windows of {window} "
            "tokens (last one shorter); each window scored alone, first token of each window not predicted; "
            "weights as stored (bf16) upcast to fp32"
        ),
    }


def save_bf16_weights(folder: Path) -> None:
    """Rewrite ``folder/model.safetensors`` with every floating tensor in bfloat16."""
    path = Path(folder) / WEIGHTS_FILE
    tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in load_file(path).items()}
    save_file(tensors, path, metadata={"format": "pt"})


def build_into(folder: Path, spec: RefModelSpec, *, num_threads: int | None = None, progress: bool = True,
               heldout_max_bytes: int | None = None) -> dict:
    """Train ``spec`` and write a complete model folder into the (existing, empty) ``folder``.

    Returns the training record also written to ``folder/training.json``.
    """
    folder = Path(folder)
    started = time.perf_counter()
    with torch_threads(num_threads):
        tokenizer = train_tokenizer(corpus.train_documents(spec.tokenizer_train_bytes), spec.vocab_size)
        model, stats = train_model(spec, tokenizer, progress=progress)
        model.config.use_cache = True
        model.generation_config.pad_token_id = model.config.pad_token_id
        model.save_pretrained(folder)
        save_bf16_weights(folder)
        save_tokenizer(tokenizer, folder, model_max_length=spec.context_length)
        wall = time.perf_counter() - started
        quality = heldout_perplexity(folder, corpus.heldout_text(heldout_max_bytes), spec.context_length)
    record = {
        "name": spec.name,
        "spec_hash": spec.spec_hash(),
        "spec": spec.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "python_version": platform.python_version(),
        "torch_version": torch.__version__,
        "torch_threads": num_threads if num_threads is not None else torch.get_num_threads(),
        "corpus_version": corpus.CORPUS_VERSION,
        **stats,
        "build_wall_seconds": round(wall, 1),
        "weights_dtype": "bfloat16",
        **quality,
    }
    (folder / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"built {spec.name} in {folder}: held-out perplexity {quality['heldout_perplexity']}", file=sys.stderr)
    return record
