"""parse_prompts / parse_messages: every prompt shape vLLM accepts, and clear errors for the rest (no model)."""
import numpy as np
import pytest
import torch

from minillm.inputs import VALID_ROLES, parse_conversation, parse_messages, parse_prompts


@pytest.mark.parametrize("prompts, expected", [
    ("hi", ["hi"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ((1, 2, 3), [[1, 2, 3]]),
    ({"prompt": "hi"}, ["hi"]),
    ({"prompt_token_ids": [5, 6]}, [[5, 6]]),
    ({"prompt_token_ids": (5, 6)}, [[5, 6]]),
    (["a", "b"], ["a", "b"]),
    ([[1, 2], [3]], [[1, 2], [3]]),
    (["a", [1, 2], {"prompt": "b"}, {"prompt_token_ids": [3]}], ["a", [1, 2], "b", [3]]),
    ((p for p in ["a", "b"]), ["a", "b"]),  # any ordered iterable of prompts
    ([np.int64(7), np.int32(8)], [[7, 8]]),  # numpy integers are token ids
])
def test_vllm_prompt_shapes_are_accepted(prompts, expected):
    out = parse_prompts(prompts)
    assert out == expected
    assert all(type(t) is int for p in out if isinstance(p, list) for t in p)


def test_a_prompt_dict_is_its_value_not_its_key():
    # Before: list({"prompt": "hi"}) == ["prompt"], and the engine generated from the word "prompt".
    assert parse_prompts({"prompt": "The capital of France is"}) == ["The capital of France is"]
    assert parse_prompts([{"prompt_token_ids": [1, 2]}, {"prompt": "x"}]) == [[1, 2], "x"]


def test_parse_prompts_copies_token_lists():
    ids = [1, 2]
    out = parse_prompts([ids])
    out[0].append(3)
    assert ids == [1, 2]


@pytest.mark.parametrize("prompts, needle", [
    (None, "prompts is None"),
    (5, r"single integer \(5\).*\[5\]"),
    (True, "bool"),
    (2.5, "float"),
    (b"hi", r"bytes.*decode"),
    (bytearray(b"hi"), r"bytearray.*decode"),
    ([], "prompts is empty"),
    ({"a", "b"}, "set, which has no order"),
    (torch.tensor([1, 2, 3]), r"\.tolist\(\)"),
    (np.array([1, 2, 3]), r"\.tolist\(\)"),
    ([torch.tensor([1, 2])], r"prompts\[0\].*\.tolist\(\)"),
    (["a", None], r"prompts\[1\] is None"),
    ([[1, None]], r"prompts\[0\]\[1\] is NoneType"),
    ([[1, 2.0]], r"prompts\[0\]\[1\] is float"),
    ([[1, True]], r"prompts\[0\]\[1\] is bool"),
    ([True, False], "bool"),
    ([1, 2.0], r"mixes token ids.*prompts\[1\] is float"),
    ([1, "a"], r"mixes token ids.*prompts\[1\]"),
    (["a", b"b"], r"prompts\[1\] is bytes"),
    (["a", 3.5], r"prompts\[1\] is a float"),
    ([object()], r"prompts\[0\] must be"),
    ({"promt": "hi"}, r"unsupported key\(s\) 'promt'"),
    ({"prompt": "hi", "multi_modal_data": {}}, "unsupported key"),
    ({"prompt": "hi", "prompt_token_ids": [1]}, "exactly one of.*got both"),
    ({}, "exactly one of.*got neither"),
    ({"prompt": [1, 2]}, r"prompts\['prompt'\] must be a str.*prompt_token_ids"),
    ({"prompt": None}, r"prompts\['prompt'\] must be a str"),
    ({"prompt_token_ids": "hi"}, r"prompts\['prompt_token_ids'\] must be a list.*'prompt'"),
    ({"prompt_token_ids": 5}, r"prompts\['prompt_token_ids'\] is a single integer"),
    ({"prompt_token_ids": [1, "2"]}, r"prompts\['prompt_token_ids'\]\[1\] is str"),
    ({"prompt_token_ids": torch.tensor([1])}, r"\.tolist\(\)"),
    ([{"prompt": 3}], r"prompts\[0\]\['prompt'\] must be a str"),
])
def test_bad_prompts_say_where_and_what_to_pass(prompts, needle):
    with pytest.raises(ValueError, match=needle):
        parse_prompts(prompts)


# -- chat ---------------------------------------------------------------------------------

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_one_conversation_or_a_list_of_them():
    assert parse_messages(CONV) == [CONV]
    assert parse_messages([CONV, CONV[1:]]) == [CONV, CONV[1:]]
    assert parse_messages((tuple(CONV),)) == [CONV]
    out = parse_messages(CONV)
    out[0][0]["content"] = "changed"
    assert CONV[0]["content"] == "Be brief."  # fresh dicts: the caller's messages are untouched
    assert parse_conversation([{"role": "assistant", "content": ""}]) == [{"role": "assistant", "content": ""}]
    assert set(VALID_ROLES) == {"system", "user", "assistant"}


@pytest.mark.parametrize("messages, needle", [
    ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str, got NoneType"),
    ([{"role": "system", "content": "x"}, {"role": "user", "content": 5}], r"messages\[1\]\['content'\]"),
    ([CONV, [{"role": "user", "content": None}]], r"messages\[1\]\[0\]\['content'\]"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "content parts is not supported"),
    ([{"role": "user"}], r"messages\[0\] has no 'content'"),
    ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
    ([{"role": "human", "content": "hi"}], r"messages\[0\]\['role'\] must be one of 'system', 'user', 'assistant'"),
    ([{"role": None, "content": "hi"}], r"\['role'\] must be one of"),
    ([{"role": "user", "content": "hi", "name": "bob"}], r"unsupported key\(s\) 'name'"),
    ([], "messages is empty"),
    ([CONV, []], r"messages\[1\] is empty"),
    ([CONV, CONV[0]], r"messages\[1\] is dict.*list of conversations"),
    ([CONV[0], CONV], r"messages\[1\] must be a message dict"),
    (["hi"], r"messages\[0\] must be a message dict"),
    ("hi", r"messages is a str.*generate\(\)"),
    ({"role": "user", "content": "hi"}, "single message dict: wrap it in a list"),
    (None, "messages must be a list"),
])
def test_bad_messages_name_the_field_and_index(messages, needle):
    with pytest.raises(ValueError, match=needle):
        parse_messages(messages)
