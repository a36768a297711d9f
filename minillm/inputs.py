"""What ``LLM.generate`` and ``LLM.chat`` accept, normalised before anything runs.

``parse_prompts`` takes every prompt shape vLLM's ``LLM.generate`` takes:

    "text"                                    one prompt
    [1, 2, 3]                                 one prompt of token ids
    {"prompt": "text"}                        one prompt (vLLM's TextPrompt)
    {"prompt_token_ids": [1, 2, 3]}           one prompt (vLLM's TokensPrompt)
    a list of any of these, mixed             one request each, in order

and returns one ``str`` or ``list[int]`` per request. ``parse_messages`` does the same
for ``LLM.chat``: one conversation (a list of ``{"role", "content"}`` dicts) or a list
of them.

Python's duck typing makes wrong shapes dangerous here: ``list({"prompt": "hi"})`` is
``["prompt"]``, ``list(b"hi")`` is ``[104, 105]`` and a string is a sequence of strings,
so a loose check generates from the wrong input without a word. Every shape is therefore
checked explicitly, and anything else is a ValueError that says where the bad value is
(``prompts[2]``, ``messages[0][1]['content']``) and what to pass instead.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from numbers import Integral
from typing import Any

PROMPT_KEYS = ("prompt", "prompt_token_ids")
VALID_ROLES = ("system", "user", "assistant")  # the roles SmolLM2's chat template was trained on
MESSAGE_KEYS = ("role", "content")

_ONE = "a str, a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
_SHAPES = _ONE + ", or a list of these"


def parse_prompts(prompts: Any) -> list[str | list[int]]:
    """One ``str`` (text) or ``list[int]`` (token ids) per request, in the order given.

    A flat list of integers is ONE prompt of token ids (as in vLLM); a list of strings,
    of token-id lists or of prompt dicts is a batch. Emptiness, token-id ranges and
    lengths are the engine's to check (it knows the vocabulary and max_model_len); the
    one exception is an empty batch, which has no request to check.
    """
    _reject_non_prompt(prompts, "prompts")
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, Mapping):
        return [_parse_prompt_dict(prompts, "prompts")]
    if isinstance(prompts, (set, frozenset)):
        raise ValueError("prompts is a set, which has no order: give a list (outputs come in the order of "
                         "the prompts)")
    if not isinstance(prompts, Iterable):
        raise ValueError(f"prompts must be {_SHAPES}; got {_describe(prompts)}")
    items = list(prompts)
    if not items:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(_is_token_id(t) for t in items):
        return [[int(t) for t in items]]  # one prompt of token ids
    if any(_is_token_id(t) for t in items):
        i = next(i for i, t in enumerate(items) if not _is_token_id(t))
        hint = ", call .tolist() on a tensor or array" if hasattr(items[i], "tolist") else ""
        raise ValueError(f"prompts mixes token ids with other things (prompts[{i}] is "
                         f"{_describe(items[i])}{hint}): give one list of token ids, or a list of prompts in which "
                         f"each prompt of token ids is its own list, e.g. [[1, 2], [3, 4]]")
    return [_parse_one(p, f"prompts[{i}]") for i, p in enumerate(items)]


def _parse_one(prompt: Any, where: str) -> str | list[int]:
    """One member of a batch: text, a list of token ids, or a prompt dict."""
    _reject_non_prompt(prompt, where)
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        return _parse_prompt_dict(prompt, where)
    if isinstance(prompt, (list, tuple)):
        return _token_ids(prompt, where)
    raise ValueError(f"{where} must be {_ONE}; got {_describe(prompt)}")


def _parse_prompt_dict(prompt: Mapping, where: str) -> str | list[int]:
    keys = list(prompt)
    unknown = [k for k in keys if k not in PROMPT_KEYS]
    if unknown:
        raise ValueError(f"{where} has unsupported key(s) {', '.join(map(repr, unknown))}: a prompt dict is "
                         f"{{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}")
    if len(keys) != 1:
        raise ValueError(f"{where} must have exactly one of the keys 'prompt' (text) or 'prompt_token_ids' "
                         f"(token ids), got {'both' if keys else 'neither'}")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"{where}['prompt'] must be a str (for token ids use the key 'prompt_token_ids'); "
                             f"got {_describe(text)}")
        return text
    ids = prompt["prompt_token_ids"]
    _reject_non_prompt(ids, f"{where}['prompt_token_ids']")
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{where}['prompt_token_ids'] must be a list of integer token ids (for text use the "
                         f"key 'prompt'); got {_describe(ids)}")
    return _token_ids(ids, f"{where}['prompt_token_ids']")


def _token_ids(ids: list | tuple, where: str) -> list[int]:
    for j, t in enumerate(ids):
        if not _is_token_id(t):
            hint = " (call .tolist() on a tensor or array)" if hasattr(t, "tolist") else ""
            raise ValueError(f"{where} must be a list of integer token ids, but {where}[{j}] is "
                             f"{_describe(t)}{hint}")
    return [int(t) for t in ids]


def _is_token_id(t: Any) -> bool:
    # numpy integers are Integral and become ints; True would silently be token 1.
    return isinstance(t, Integral) and not isinstance(t, bool)


def _reject_non_prompt(value: Any, where: str) -> None:
    """The shapes that iterate into something plausible but wrong, each with its fix."""
    shapes = _SHAPES if where == "prompts" else _ONE
    if value is None:
        raise ValueError(f"{where} is None: give {shapes}")
    if isinstance(value, bool):
        raise ValueError(f"{where} is a bool ({value!r}): give {shapes}")
    if isinstance(value, Integral):
        raise ValueError(f"{where} is a single integer ({value!r}): one token id is a prompt of one token, "
                         f"[{int(value)}]")
    if isinstance(value, float):
        raise ValueError(f"{where} is a float ({value!r}): token ids are integers")
    if isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{where} is {type(value).__name__}, not text: decode it to a str first "
                         f"(e.g. data.decode('utf-8'))")
    if hasattr(value, "tolist") and not isinstance(value, (list, tuple, str, Mapping)):
        raise ValueError(f"{where} is a {type(value).__module__}.{type(value).__name__}: pass a list of token "
                         f"ids, e.g. ids.tolist() (a 1-D tensor of ids) or ids.tolist() per row")


def _describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


# -- chat ------------------------------------------------------------------------------

def parse_messages(messages: Any) -> list[list[dict[str, str]]]:
    """One conversation or a list of them -> a list of conversations, each message a
    fresh ``{"role": ..., "content": ...}`` dict.

    The chat template would otherwise fail deep inside jinja2 on a missing or non-str
    ``content``, or render an unknown role the model never saw in training.
    """
    if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], (list, tuple)):
        for i, conv in enumerate(messages):
            if not isinstance(conv, (list, tuple)):
                raise ValueError(f"messages[{i}] is {_describe(conv)}, but messages[0] is a conversation: give "
                                 f"a list of conversations (each a list of message dicts), or one conversation")
        return [parse_conversation(conv, f"messages[{i}]") for i, conv in enumerate(messages)]
    return [parse_conversation(messages, "messages")]


def parse_conversation(messages: Any, where: str = "messages") -> list[dict[str, str]]:
    """One conversation: a non-empty list of ``{"role": ..., "content": str}`` dicts."""
    example = "[{'role': 'user', 'content': 'Hello!'}]"
    if isinstance(messages, str):
        raise ValueError(f"{where} is a str: a conversation is a list of message dicts such as {example} "
                         f"(for plain text without the chat template use generate())")
    if isinstance(messages, Mapping):
        raise ValueError(f"{where} is a single message dict: wrap it in a list, e.g. {example}")
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"{where} must be a list of message dicts such as {example}; got {_describe(messages)}")
    if not messages:
        raise ValueError(f"{where} is empty: a conversation needs at least one message, e.g. {example}")
    out = []
    for j, m in enumerate(messages):
        at = f"{where}[{j}]"
        if not isinstance(m, Mapping):
            raise ValueError(f"{at} must be a message dict such as {{'role': 'user', 'content': 'Hello!'}}; "
                             f"got {_describe(m)}")
        unknown = [k for k in m if k not in MESSAGE_KEYS]
        if unknown:
            raise ValueError(f"{at} has unsupported key(s) {', '.join(map(repr, unknown))}: a message has only "
                             f"'role' and 'content'")
        for key in MESSAGE_KEYS:
            if key not in m:
                raise ValueError(f"{at} has no {key!r}: a message is {{'role': ..., 'content': str}}")
        role, content = m["role"], m["content"]
        if not isinstance(role, str) or role not in VALID_ROLES:
            raise ValueError(f"{at}['role'] must be one of {', '.join(map(repr, VALID_ROLES))}; got {role!r}")
        if not isinstance(content, str):
            hint = (" (a list of content parts is not supported: join their text into one str)"
                    if isinstance(content, (list, tuple)) else "")
            raise ValueError(f"{at}['content'] must be a str, got {_describe(content)}{hint}")
        out.append({"role": role, "content": content})
    return out


__all__ = ["parse_prompts", "parse_messages", "parse_conversation", "PROMPT_KEYS", "VALID_ROLES", "MESSAGE_KEYS"]
