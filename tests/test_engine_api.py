"""The vLLM-shaped facade: outputs, chat, stop rules, seeded sampling, bad input."""
import pytest

from minillm import LLM, SamplingParams
from minillm.request import FinishReason
from tests.prompts import SHORT

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def test_generate_accepts_text_token_ids_and_lists(real_llm, tokenizer):
    one = real_llm.generate(SHORT[0], GREEDY)
    ids = tokenizer(SHORT[0]).input_ids
    by_ids = real_llm.generate(ids, GREEDY)
    both = real_llm.generate([SHORT[0], ids], [GREEDY, GREEDY])
    assert len(one) == len(by_ids) == 1 and len(both) == 2
    assert one[0].token_ids == by_ids[0].token_ids == both[0].token_ids == both[1].token_ids
    out = one[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.prompt == SHORT[0] and out.prompt_token_ids == ids
    assert out.finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    m = out.metrics
    assert m.ttft > 0 and m.e2e >= m.ttft and len(m.token_times) == len(out.token_ids)


def test_chat_answers_paris(real_llm):
    out = real_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=20))[0]
    assert "Paris" in out.text
    assert out.finish_reason == FinishReason.STOP  # it ends its turn with <|im_end|>


def test_max_tokens_stop_token_ids_and_stop_strings(real_llm, tokenizer):
    base = real_llm.generate(SHORT[2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(base.token_ids) == 20 and base.finish_reason == FinishReason.LENGTH
    # Stop on the 5th generated token: output ends with it.
    t = base.token_ids[4]
    first = base.token_ids.index(t)
    out = real_llm.generate(SHORT[2], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[t]))[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == FinishReason.STOP
    # A stop string cuts the text before it.
    word = base.text.strip().split()[3]
    out = real_llm.generate(SHORT[2], SamplingParams(temperature=0, max_tokens=20, stop=[word]))[0]
    assert word not in out.text and base.text.startswith(out.text)
    assert out.finish_reason == FinishReason.STOP


def test_seeded_sampling_is_reproducible(real_llm):
    p = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = real_llm.generate(SHORT[1], p)[0].token_ids
    b = real_llm.generate([SHORT[3], SHORT[1]], [SamplingParams(temperature=0.7, max_tokens=8), p])[1].token_ids
    assert a == b


@pytest.mark.parametrize("call, match", [
    (lambda llm: llm.generate("", GREEDY), "empty"),
    (lambda llm: llm.generate([], GREEDY), "empty"),
    (lambda llm: llm.generate([[1, 2, 49152]], GREEDY), r"\[0, 49152\)"),
    (lambda llm: llm.generate([[5, -1]], GREEDY), "token ids"),
    (lambda llm: llm.generate([[7] * 2048], GREEDY), "max_model_len"),
    (lambda llm: llm.generate(["a", "b"], [GREEDY] * 3), "one per prompt"),
    (lambda llm: llm.generate("hi", {"temperature": 0}), "SamplingParams"),
    (lambda llm: llm.chat([{"content": "no role"}]), "role"),
])
def test_bad_input_is_a_value_error_and_the_engine_stays_usable(real_llm, call, match):
    with pytest.raises(ValueError, match=match):
        call(real_llm)
    assert not real_llm.engine.has_unfinished()
    assert real_llm.generate(SHORT[0], SamplingParams(temperature=0, max_tokens=2))[0].token_ids


def test_unknown_keyword_argument_lists_valid_ones():
    with pytest.raises(ValueError, match="valid options"):
        LLM(max_batch=4)


def test_generation_stops_at_max_model_len(tokenizer):
    llm = LLM(max_model_len=40)
    ids = tokenizer(SHORT[0]).input_ids
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(ids) + len(out.token_ids) == 40 and out.finish_reason == FinishReason.LENGTH
