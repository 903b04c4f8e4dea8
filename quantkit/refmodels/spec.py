"""RefModelSpec: everything that determines a reference model's weights, validated at construction.

The spec's hash (over every field) names the model's cache folder, so changing any field gives a
fresh folder instead of silently reusing weights trained under another recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

# vLLM's WNA16 kernels (and our group sizes 32/64/128) want every linear's input dimension to be a
# multiple of 128 and its output dimension a multiple of 64.
LINEAR_IN_MULTIPLE = 128
LINEAR_OUT_MULTIPLE = 64

# Files of a reference-model folder that training writes and the store checks.
WEIGHTS_FILE = "model.safetensors"
TRAINING_RECORD = "training.json"


@dataclass(frozen=True)
class RefModelSpec:
    """Dimensions, data budget and optimiser settings of one reference model.

    Model: a Llama decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) with tied input/output
    embeddings. Data: the train split of the standard-library corpus (see corpus.py), capped at
    ``max_train_bytes`` (None: all of it). Optimiser: AdamW, linear warmup then cosine decay to
    ``min_lr_ratio * lr``, fp32 throughout, gradient clipping at ``grad_clip``.
    """

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    context_length: int
    steps: int
    batch_size: int
    lr: float
    warmup_steps: int
    seed: int
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    rope_theta: float = 10000.0
    max_train_bytes: int | None = None
    tokenizer_train_bytes: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                      "num_kv_heads", "context_length", "steps", "batch_size"):
            if getattr(self, field) <= 0:
                problems.append(f"{field} must be positive, got {getattr(self, field)}")
        if problems:
            raise ValueError(f"RefModelSpec {self.name!r}: " + "; ".join(problems))
        if self.hidden_size % self.num_heads:
            problems.append(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        elif self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        for what, (n_in, n_out) in self.linear_shapes().items():
            if n_in % LINEAR_IN_MULTIPLE or n_out % LINEAR_OUT_MULTIPLE:
                problems.append(
                    f"{what} is {n_in}->{n_out}: inputs must be multiples of {LINEAR_IN_MULTIPLE} and "
                    f"outputs multiples of {LINEAR_OUT_MULTIPLE} so real INT4/INT8 kernels accept it"
                )
        if not 0 <= self.warmup_steps < self.steps:
            problems.append(f"warmup_steps must be in [0, steps={self.steps}), got {self.warmup_steps}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            problems.append(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}")
        if self.vocab_size < 256 + 3:
            problems.append(f"vocab_size {self.vocab_size} cannot hold the 256 byte tokens plus 3 special tokens")
        if problems:
            raise ValueError(f"RefModelSpec {self.name!r}: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.context_length

    @property
    def train_tokens(self) -> int:
        """Tokens the optimiser sees over the whole run (steps x batch x context)."""
        return self.steps * self.tokens_per_step

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every distinct linear in the model, lm_head included."""
        h, kv = self.hidden_size, self.num_kv_heads * (self.hidden_size // max(self.num_heads, 1))
        return {
            "q_proj": (h, h),
            "k_proj/v_proj": (h, kv),
            "o_proj": (h, h),
            "gate_proj/up_proj": (h, self.intermediate_size),
            "down_proj": (self.intermediate_size, h),
            "lm_head": (h, self.vocab_size),
        }

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RefModelSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown RefModelSpec fields {unknown}; known fields: {sorted(known)}")
        return cls(**data)

    def spec_hash(self) -> str:
        """12 hex digits of SHA-256 over the canonical JSON of every field."""
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:12]

    def folder_name(self) -> str:
        return f"{self.name}-{self.spec_hash()}"
