"""Output text as vLLM returns it: stop strings and stop tokens left out, partial text kept on abort."""
import pytest

from minillm import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_stop_token_text_is_left_out_by_default(real_llm, tokenizer):
    free = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    # stop on the token that follows " Paris" in the free run
    i = next(j for j, t in enumerate(free.token_ids) if "Paris" in tokenizer.decode(free.token_ids[:j + 1]))
    stop = free.token_ids[i + 1]
    out = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop]))[0]
    assert out.token_ids == free.token_ids[:i + 2], "the stop token is the last token id"
    assert out.finish_reason == "stop"
    assert out.text == tokenizer.decode(free.token_ids[:i + 1], skip_special_tokens=True)
    assert out.text.endswith("Paris")
    kept = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop],
                                                    include_stop_str_in_output=True))[0]
    assert kept.text == tokenizer.decode(free.token_ids[:i + 2], skip_special_tokens=True)


def test_stop_string_cut_unless_included(real_llm):
    out = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=["Paris"]))[0]
    assert out.finish_reason == "stop" and "Paris" not in out.text
    kept = real_llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop=["Paris"],
                                                    include_stop_str_in_output=True))[0]
    assert kept.text.endswith("Paris") and kept.text[:-len("Paris")] == out.text


def test_aborted_request_keeps_its_partial_text(real_llm, tokenizer):
    engine = real_llm.engine
    req = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=32))
    for _ in range(5):
        engine.step()
    engine.abort(req)
    out = engine.output(req)
    assert out.finish_reason == "abort" and len(out.token_ids) == 5
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True) != ""
    assert not engine.has_unfinished()
