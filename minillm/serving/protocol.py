"""The OpenAI request bodies the server accepts, and how one is parsed and checked.

``parse_body(data, model, model_name)``: a decoded JSON object -> a ``CompletionRequest`` or
``ChatCompletionRequest``, or a ``RequestError``: 400 naming the field (unknown fields,
wrong types and out-of-range values alike; a typo is never ignored), 404 for a model this
server does not serve (OpenAI's and vLLM's answer).
"""
from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .guards import BadRequest, RequestError, clip, quote

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

Number = Union[StrictFloat, StrictInt]  # JSON numbers; "1.0" (a string) or true is not a number


# -- request bodies -------------------------------------------------------------------------

class _Body(BaseModel):
    """Fields common to both endpoints. Unknown fields are an error (a typo is never ignored)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    temperature: Number = Field(1.0, ge=0)  # 0 = greedy
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: StrictInt = -1  # extension (vLLM's): -1 = off
    seed: StrictInt | None = Field(None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: "StreamOptions | None" = None
    ignore_eos: StrictBool = False  # extension: generate exactly max_tokens tokens
    priority: StrictInt | StrictStr | None = None  # extension: a priority class or level, where the engine has them
    user: StrictStr | None = None  # accepted and ignored, as an id for the caller's own logs
    # OpenAI options this engine does not implement: accepted only at their neutral value.
    frequency_penalty: Number = 0.0
    presence_penalty: Number = 0.0
    logit_bias: dict[str, Number] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class CompletionRequest(_Body):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[ContentPart]
    name: StrictStr | None = None


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)  # None: up to the end of the context
    max_completion_tokens: StrictInt | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None


_Body.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()



def _unsupported(body: _Body) -> None:
    """Reject OpenAI options that are accepted by the schema but not implemented."""
    checks = [("n", body.n != 1, "only n=1 is supported: send n separate requests"),
              ("frequency_penalty", body.frequency_penalty != 0, "frequency_penalty is not supported (use 0)"),
              ("presence_penalty", body.presence_penalty != 0, "presence_penalty is not supported (use 0)"),
              ("logit_bias", bool(body.logit_bias), "logit_bias is not supported")]
    if isinstance(body, CompletionRequest):
        checks += [("echo", body.echo, "echo is not supported"),
                   ("logprobs", body.logprobs not in (None, 0), "logprobs is not supported"),
                   ("best_of", body.best_of not in (None, 1), "best_of is not supported (use 1)"),
                   ("suffix", body.suffix is not None, "suffix is not supported")]
    else:
        checks += [("logprobs", body.logprobs, "logprobs is not supported"),
                   ("top_logprobs", body.top_logprobs is not None, "top_logprobs is not supported")]
    for param, bad, message in checks:
        if bad:
            raise BadRequest(message, param, "unsupported_parameter")



def parse_body(data: Any, model: type[_Body], model_name: str) -> _Body:
    """Validate a decoded body against ``model``; check ``model`` names the served model."""
    if not isinstance(data, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        param = clip(str(err["loc"][0]), 120) if err["loc"] else None  # the top-level field
        msg = "unsupported field" if err["type"] == "extra_forbidden" else clip(err["msg"], 300)
        raise BadRequest(f"{param}: {msg}" if param else msg, param, err["type"]) from None
    if body.model is not None and body.model != model_name:
        raise RequestError(f"the model {quote(body.model)} does not exist; this server serves {model_name!r}",
                           "model", "model_not_found", status=404)
    _unsupported(body)
    return body


def one_prompt(prompt: Any) -> str | list[int]:
    """OpenAI's prompt shapes, one prompt only: "text", [ids], ["text"] or [[ids]]."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise BadRequest(f"got {len(prompt)} prompts: this server takes one prompt per request "
                             "(send several requests; they are batched by the engine)", "prompt")
        return prompt[0]
    return prompt


__all__ = ["DEFAULT_MODEL_NAME", "CompletionRequest", "ChatCompletionRequest", "ChatMessage", "ContentPart", "StreamOptions",
           "parse_body", "one_prompt"]
