"""Prompts to token ids off the step loop: ``PromptEncoder``.

Tokenizing a prompt takes time in proportion to its length (a 50 MB prompt: over a
minute on a CPU core). Done in the engine's thread, it would stall every other
request's steps meanwhile. So ``AsyncLLM`` hands text prompts and conversations to this
encoder, which tokenizes in a worker thread of its own, with a tokenizer of its own (a
copy: a fast tokenizer must not be called from two threads at once, and the engine's
thread keeps using the engine's for detokenizing). The Rust tokenizer releases the GIL
while it works, so the engine steps on meanwhile.

It also refuses early what could never fit, before paying for it:

- text that is not valid Unicode (a lone surrogate from a JSON escape such as ``\\ud800``:
  the tokenizer cannot encode it);
- text with at least ``max_model_len`` tokens for sure, without tokenizing it: no token
  covers more than ``max_token_bytes`` bytes of text, so ``len(utf8) / max_token_bytes``
  tokens at least (only where that bound holds: no normalizer, no added token that
  swallows whitespace);
- token-id lists of ``max_model_len`` ids or more (their ids are checked in the engine).

What passes has the ids ``LLMEngine.tokenize`` (and ``LLM.chat_prompt``) would give: the
same calls, on an identical tokenizer.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import math
from typing import Any, Sequence

from ..inputs import parse_conversation
from .guards import check_text


class PromptEncoder:
    """Tokenizes prompts and conversations in one worker thread; checks lengths early."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.max_model_len = max_model_len
        self.tokenizer = None if tokenizer is None else copy.deepcopy(tokenizer)  # this worker's own
        self.max_token_bytes = max_token_bytes(self.tokenizer) if self.tokenizer is not None else None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minillm-tokenize")

    async def encode(self, prompt: str | None, messages: Any = None) -> tuple[str | None, list[int]]:
        """``(text, ids)`` of a text prompt, or ``(None, ids)`` of a conversation (chat template
        applied). Raises ValueError for bad input, as ``LLMEngine.make_request`` would."""
        loop = asyncio.get_running_loop()
        if messages is not None:
            return None, await loop.run_in_executor(self._pool, self._chat, messages)
        return prompt, await loop.run_in_executor(self._pool, self._text, prompt)

    def check_ids(self, ids: Sequence[Any]) -> None:
        """The length check of a token-id prompt (its ids are validated in the engine thread)."""
        if len(ids) >= self.max_model_len:
            raise _too_long(str(len(ids)), self.max_model_len)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- in the worker thread -------------------------------------------------------------
    def _text(self, prompt: str) -> list[int]:
        if not prompt:
            raise ValueError("prompt is empty: give at least one character or token id")
        self._check_bytes(prompt)
        ids = list(self.tokenizer(prompt).input_ids)  # as LLMEngine.tokenize
        if len(ids) >= self.max_model_len:
            raise _too_long(str(len(ids)), self.max_model_len)
        return ids

    def _chat(self, messages: Any) -> list[int]:
        conversation = parse_conversation(messages)
        rendered = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        if isinstance(rendered, str):
            self._check_bytes(rendered, "conversation")
        ids = chat_prompt_ids(self.tokenizer, conversation)  # as LLM.chat_prompt
        if len(ids) >= self.max_model_len:
            raise _too_long(str(len(ids)), self.max_model_len)
        return ids

    def _check_bytes(self, text: str, what: str = "prompt") -> None:
        try:
            n = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            check_text(text, None, what)  # raises, naming the code point and where it is
            raise
        if self.max_token_bytes and n / self.max_token_bytes >= self.max_model_len:
            raise _too_long(f"at least {math.ceil(n / self.max_token_bytes)}", self.max_model_len,
                            f" ({n} bytes of text; no token is longer than {self.max_token_bytes} bytes)")


def chat_prompt_ids(tokenizer: Any, messages: Any) -> list[int]:
    """A conversation -> the chat template's token ids, ready for the assistant's turn (as ``LLM.chat_prompt``)."""
    if tokenizer is None:
        raise ValueError("chat needs the tokenizer of the GGUF, which this engine does not have")
    messages = parse_conversation(messages)
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(enc["input_ids"] if not isinstance(enc, list) else enc)


def _too_long(count: str, max_model_len: int, detail: str = "") -> ValueError:
    # The engine's own message (LLMEngine.make_request), so a client sees one wording.
    return ValueError(f"prompt has {count} tokens{detail} but max_model_len is {max_model_len}: "
                      f"shorten the prompt to at most {max_model_len - 1} tokens or raise max_model_len")


def max_token_bytes(tokenizer: Any) -> int | None:
    """An upper bound on the bytes of text one token of ``tokenizer`` covers; None where
    there is none to rely on (a normalizer may shrink text; an added token with lstrip or
    rstrip swallows any run of whitespace; WordPiece's or a fused unknown token covers a
    whole unknown word)."""
    try:
        backend = getattr(tokenizer, "backend_tokenizer", None) or tokenizer._tokenizer
        spec = json.loads(backend.to_str())
        if spec.get("normalizer") is not None:
            return None
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or model.get("fuse_unk"):  # an unknown-word token may cover any length
            return None
        added = spec.get("added_tokens") or []
        if any(t.get("lstrip") or t.get("rstrip") for t in added):
            return None
        # A vocabulary entry's UTF-8 length bounds the bytes it stands for: byte-level BPE
        # writes each byte as one character of up to 2 bytes, sentencepiece a space as 3.
        longest = max(len(piece.encode("utf-8")) for piece in backend.get_vocab(with_added_tokens=True))
    except Exception:  # noqa: BLE001 -- another kind of tokenizer: no bound, tokenize everything
        return None
    return max(longest, 1)


__all__ = ["PromptEncoder", "chat_prompt_ids", "max_token_bytes"]
