"""`quantkit generate MODEL --prompt TEXT`: stream a continuation; tokens/s of prefill and decode on stderr."""

from __future__ import annotations

import argparse
import sys
import time

from quantkit.core.errors import UsageError

from . import add_model_options, int_at_least, nonnegative_float, positive_float, torch_dtype

DEFAULT_MAX_NEW_TOKENS = 128


def top_p(text: str) -> float:
    """An argparse `type`: a number in (0, 1]."""
    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def register(sub) -> None:
    p = sub.add_parser(
        "generate", help="continue a prompt, streaming the tokens; tokens/s of prefill and decode",
        description="Tokenize TEXT (the --prompt) with MODEL's tokenizer, run it through MODEL and stream the new "
                    "tokens' text to stdout as they come. Stops at an end-of-sequence token, a --stop string or "
                    "--max-new-tokens. stderr gets the tokens/s of prefill and of decode and which loop ran: "
                    "quantkit's C++ loop where it runs the model (on the CPU: Llama, Mistral, Qwen2, Qwen3), else "
                    "transformers' generate, with the reason.")
    p.add_argument("model", metavar="MODEL",
                   help="quantized checkpoint, float model folder, hub id, ref:tiny / ref:small, or a .gguf file")
    p.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    p.add_argument("--chat", action="store_true",
                   help="put TEXT in the tokenizer's chat template as one user message, with the assistant's turn "
                        "opened (default: TEXT as it is, with the special tokens the tokenizer adds)")
    p.add_argument("--max-new-tokens", type=int_at_least(1), default=DEFAULT_MAX_NEW_TOKENS, metavar="N",
                   help=f"most tokens to generate (default: {DEFAULT_MAX_NEW_TOKENS}; prompt + N must fit the "
                        f"model's context)")
    p.add_argument("--temperature", type=nonnegative_float, default=0.0, metavar="T",
                   help="0: the most likely token each step (greedy, the default); > 0: sample at this temperature")
    p.add_argument("--top-k", type=int_at_least(0), default=0, metavar="K",
                   help="sample among the K most likely tokens (default 0: no limit)")
    p.add_argument("--top-p", type=top_p, default=1.0, metavar="P",
                   help="sample among the most likely tokens holding probability P, 0 < P <= 1 (default 1: no limit)")
    p.add_argument("--seed", type=int_at_least(0), default=0, metavar="S",
                   help="random seed of sampling (default 0: the same text each run)")
    p.add_argument("--stop", action="extend", nargs="+", default=[], metavar="STRING",
                   help="stop once the text holds one of these strings (printed up to its end)")
    p.add_argument("--threads", type=int_at_least(1), default=None, metavar="N",
                   help="CPU threads (default: torch's, one per core)")
    add_model_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    import quantkit
    from quantkit.runtime.fast_generate import FastGenerate
    from quantkit.runtime.sampling import SamplingConfig

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if any(not s for s in args.stop):
        raise UsageError("--stop takes non-empty strings; drop the empty one")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = quantkit.load(args.model, dtype=torch_dtype(args.dtype), device=args.device,
                          trust_remote_code=args.trust_remote_code, strict=not args.allow_source_mismatch)
    tokenizer = load_tokenizer(args.model)
    ids = prompt_ids(tokenizer, args.prompt, args.chat)  # [1, L]
    context = getattr(model.config, "max_position_embeddings", None)
    if context is not None and ids.shape[1] + args.max_new_tokens > context:
        raise UsageError(f"the prompt's {ids.shape[1]} tokens + --max-new-tokens {args.max_new_tokens} exceed the "
                         f"model's context of {context} positions; give --max-new-tokens "
                         f"{max(context - ids.shape[1], 1)} or less, or a shorter prompt")
    settings = dict(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p) if not sampling.greedy else dict(do_sample=False)
    eos = model.generation_config.eos_token_id
    if eos is None and tokenizer.eos_token_id is not None:
        settings["eos_token_id"] = eos = tokenizer.eos_token_id
    if model.generation_config.pad_token_id is None:
        settings["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (
            eos if isinstance(eos, int) else (eos or [None])[0])
    if args.stop:
        settings.update(stop_strings=list(args.stop), tokenizer=tokenizer)
    stream = TextStream(tokenizer, args.stop, sys.stdout)
    torch.manual_seed(args.seed)
    device = next(model.parameters()).device
    result = FastGenerate.of(model).run(ids.to(device), attention_mask=torch.ones_like(ids).to(device),
                                        max_new_tokens=args.max_new_tokens, streamer=stream, **settings)
    if not stream.text.endswith("\n"):
        print(flush=True)
    new = result.sequences[0, ids.shape[1]:].tolist()
    eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
    why = ("an end-of-sequence token" if new and new[-1] in eos_ids else
           "--max-new-tokens" if len(new) == args.max_new_tokens else "a --stop string")
    threads = torch.get_num_threads()
    print(f"{stream.timing(ids.shape[1], len(new))}; {sampling.describe()}; {result.loop}, {threads} thread"
          f"{'s' * (threads != 1)}; stopped at {why}", file=sys.stderr)
    return 0


def load_tokenizer(source: str):
    """MODEL's tokenizer: a .gguf file's own (gguf_reading.load_gguf_tokenizer, the file checked first), else
    the folder's."""
    from quantkit.gguf.reading import is_gguf_file, load_gguf_tokenizer
    from quantkit.harness import eval_text

    return load_gguf_tokenizer(source) if is_gguf_file(source) else eval_text.load_tokenizer(source)


def prompt_ids(tokenizer, prompt: str, chat: bool):
    """The prompt's token ids, int64 [1, L]: the text with the tokenizer's special tokens, or (chat) in its
    chat template as a user message with the assistant's turn opened."""
    import torch

    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UsageError("this model's tokenizer has no chat template; drop --chat to give the prompt as it is")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise UsageError("the prompt has no tokens; give some text with --prompt")
    return torch.tensor([ids], dtype=torch.int64)


class TextStream:
    """transformers' streamer interface (``put`` the prompt, then each token; ``end``): writes the text of the
    new tokens to `out` as soon as it is whole characters, and times the prefill and the decode.

    Byte-level BPE tokens may hold part of a character's UTF-8 bytes: the text of the tokens since the last
    write is decoded together with the tokens before them (for their context) and written once it no
    longer ends in an incomplete character (U+FFFD). With stop strings, nothing after the first one is written.
    """

    def __init__(self, tokenizer, stop_strings, out) -> None:
        self.tokenizer, self.stop_strings, self.out = tokenizer, list(stop_strings), out
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[prefix:read]: the written tokens decoded again as context
        self.text = ""  # what was written
        self.stopped = False
        self.started = self.first = self.ended = None  # perf_counter at the prompt, the first token, the end

    def put(self, value) -> None:
        now = time.perf_counter()
        if self.started is None:  # the prompt
            self.started = now
            return
        if self.first is None:
            self.first = now
        self.ids.extend(int(t) for t in value.reshape(-1).tolist())
        self._write(final=False)

    def end(self) -> None:
        self.ended = time.perf_counter()
        self._write(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _write(self, final: bool) -> None:
        if self.stopped:
            return
        before = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if not final and (len(text) <= len(before) or text.endswith("\ufffd")):
            return
        new = text[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        whole = self.text + new
        ends = [i + len(s) for s in self.stop_strings
                if (i := whole.find(s, max(0, len(self.text) - len(s) + 1))) >= 0]
        if ends:
            new, self.stopped = whole[len(self.text):min(ends)], True
        self.text += new
        self.out.write(new)
        self.out.flush()

    def timing(self, prompt_tokens: int, new_tokens: int) -> str:
        """'prefill: L tokens in S s, R tokens/s; decode: ...': prefill is the prompt to the first new token,
        decode each token after it."""
        prefill = max(self.first - self.started, 1e-9)
        parts = [f"prefill: {prompt_tokens} tokens in {prefill:.3f} s, {prompt_tokens / prefill:.1f} tokens/s"]
        if new_tokens > 1:
            decode = max(self.ended - self.first, 1e-9)
            parts.append(f"decode: {new_tokens - 1} tokens in {decode:.3f} s, {(new_tokens - 1) / decode:.1f} tokens/s")
        else:
            parts.append("decode: no step after the first token")
        return "; ".join(parts)
