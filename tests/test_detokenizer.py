"""IncrementalDetokenizer against the obvious, quadratic way of building the text.

The oracle re-decodes every output token after each new one, stops at the first token
where a stop string appears in that text, and cuts there. The incremental detokenizer
must agree with it exactly: same stopping token, same final text, while decoding only a
small window per token. Two tokenizers: a tiny byte-level fake (always available,
easy to steer into split characters and garbage bytes) and SmolLM2's real one (skipped
when the model file is not installed).
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minillm.detokenizer import IncrementalDetokenizer


def params(stop=(), stop_token_ids=(), include=False):
    return SimpleNamespace(stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=False,
                           include_stop_str_in_output=include)


# -- a byte-level fake tokenizer ---------------------------------------------------------
class ByteTokenizer:
    """Ids 0..255 are single bytes; then a few multi-byte pieces (some split characters);
    then two special tokens. decode = join the bytes, UTF-8 with replacement, specials
    skipped: the way a byte-level BPE decodes."""

    PIECES = [b"Hello", b" wor", b"ld", b" Paris", b".", b" It", b" is", b"ab", b"cd", b"cde", b"ef",
              "🙂".encode()[:2], "🙂".encode()[2:], "世".encode()[:1], "世".encode()[1:],
              b"\xe2\x82", b"\xac ", b" ", "é".encode(), b"\n", b""]

    def __init__(self):
        self.vocab = [bytes([b]) for b in range(256)] + list(self.PIECES)
        self.eos_token_id = len(self.vocab)
        self.all_special_ids = [self.eos_token_id, self.eos_token_id + 1]

    def __len__(self):
        return len(self.vocab) + 2

    def id(self, piece: bytes | str) -> int:
        return self.vocab.index(piece.encode() if isinstance(piece, str) else piece)

    def decode(self, ids, skip_special_tokens=True):
        assert skip_special_tokens
        return b"".join(self.vocab[i] for i in ids if i < len(self.vocab)).decode("utf-8", "replace")


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode call."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[int] = []
        self.all_special_ids = inner.all_special_ids
        self.added_tokens_decoder = getattr(inner, "added_tokens_decoder", {})

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


FAKE = ByteTokenizer()


@pytest.fixture(scope="module")
def real_tok():
    from minillm import loader

    try:
        return loader.load_tokenizer()
    except loader.ModelFileNotFound:
        pytest.skip("the SmolLM2 model file is not installed")


# -- the oracle --------------------------------------------------------------------------
def naive(tok, ids, stop, include=False):
    """(number of tokens consumed, final text): re-decode everything after each token."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=True)
        present = [(text.find(s), len(s)) for s in stop if s in text]
        if present:
            start, length = min(present)  # earliest start; at a tie the shorter one
            return k, text[:start + (length if include else 0)]
    return len(ids), tok.decode(ids, skip_special_tokens=True)


def run(tok, ids, stop=(), include=False, stop_token_ids=()):
    """Feed ids until a stop; check the streaming invariants on the way. Returns
    (tokens consumed, final text, detokenizer)."""
    d = IncrementalDetokenizer(tok, [1, 2, 3], params(stop, stop_token_ids, include))
    shown, streamed, k = [], "", 0
    for t in ids:
        k += 1
        stopped = d.add_token(t)
        streamed += d.new_text()
        assert streamed == d.text
        shown.append(d.text)
        if stopped or t in stop_token_ids:
            break
    last_is_stop = bool(ids) and ids[k - 1] in stop_token_ids
    final = d.finish("stop", last_is_stop)
    assert final == d.text == streamed + d.new_text()
    for s in shown:  # nothing shown is ever taken back
        assert final.startswith(s)
    return k, final, d


# -- strategies ---------------------------------------------------------------------------
CORPUS = [
    "The capital of France is Paris. It is known for the Eiffel Tower.",
    "héllo naïve café, Straße; Ελληνικά и русский текст.",
    "世界日本語のテキスト、中文字符和한국어 문장。",
    "emoji: 🙂🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "def f(x):\n    return x  # tabs\tand   spaces   \n\n",
    "   leading and trailing spaces   ",
    "numbers 12345 and symbols €£¥ ∑∫√ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


def token_sequences(tok, vocab_size, special_ids, fragment_ids):
    """Slices of real tokenisations, random ids, split-character fragments and specials."""
    encoded = [tok_encode(tok, s) for s in CORPUS]
    real_slice = st.sampled_from(encoded).flatmap(
        lambda ids: st.tuples(st.integers(0, len(ids)), st.integers(0, len(ids))).map(
            lambda ab: ids[min(ab):max(ab)]))
    segment = st.one_of(
        real_slice, real_slice,
        st.lists(st.integers(0, vocab_size - 1), max_size=6),
        st.lists(st.sampled_from(fragment_ids), max_size=5),
        st.lists(st.sampled_from(special_ids), max_size=2),
    )
    return st.lists(segment, max_size=6).map(lambda parts: [t for p in parts for t in p])


def tok_encode(tok, text):
    if isinstance(tok, ByteTokenizer):
        return [tok.id(bytes([b])) for b in text.encode()]
    return tok.encode(text, add_special_tokens=False)


def fragment_ids(tok):
    """Ids whose text alone ends in an unfinished character."""
    return [i for i in range(len(tok)) if tok.decode([i], skip_special_tokens=True).endswith("\ufffd")][:400]


@pytest.fixture(scope="module", params=["fake", "real"])
def tok_and_seqs(request):
    tok = FAKE if request.param == "fake" else request.getfixturevalue("real_tok")
    specials = sorted({*tok.all_special_ids, *getattr(tok, "added_tokens_decoder", {})})
    return tok, token_sequences(tok, len(tok), specials, fragment_ids(tok))


SETTINGS = settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))


# -- property tests -----------------------------------------------------------------------
@SETTINGS
@given(data=st.data())
def test_text_without_stops_equals_full_decode(tok_and_seqs, data):
    tok, seqs = tok_and_seqs
    ids = data.draw(seqs)
    k, final, _ = run(tok, ids)
    assert k == len(ids)
    assert final == tok.decode(ids, skip_special_tokens=True)


@SETTINGS
@given(data=st.data())
def test_stop_strings_agree_with_the_naive_oracle(tok_and_seqs, data):
    tok, seqs = tok_and_seqs
    ids = data.draw(seqs)
    full = tok.decode(ids, skip_special_tokens=True)
    substring = st.tuples(st.integers(0, len(full)), st.integers(1, 6)).map(lambda ij: full[ij[0]:ij[0] + ij[1]])
    stop = data.draw(st.lists(st.one_of(substring, st.text("ab .\n\ufffd世🙂", min_size=1, max_size=3)),
                              max_size=3).map(lambda ss: [s for s in ss if s]))
    include = data.draw(st.booleans())
    assert run(tok, ids, stop, include)[:2] == naive(tok, ids, stop, include)


# -- cases, on the fake tokenizer ---------------------------------------------------------
def ids_of(*pieces):
    return [FAKE.id(p) for p in pieces]


def test_stop_string_spanning_two_tokens():
    ids = ids_of("Hello", " wor", "ld", " ", "Hello")
    k, final, d = run(FAKE, ids, stop=["o world"])
    assert (k, final, d.stop_str) == (3, "Hell", "o world")


def test_stop_string_at_the_very_start():
    assert run(FAKE, ids_of("Hello", " wor"), stop=["He"])[:2] == (1, "")
    assert run(FAKE, ids_of("Hello", " wor"), stop=["He"], include=True)[:2] == (1, "He")


def test_the_first_completed_stop_ends_the_request_and_the_earliest_start_cuts():
    # "abcx" would start earlier, but "c" completes first: it ends the request.
    assert run(FAKE, ids_of("ab", "cd", "ef"), stop=["abcx", "c"])[:2] == (2, "ab")
    # Both complete at the same token: the cut is at the earliest start ("bcd" at 1, not "de").
    assert run(FAKE, ids_of("ab", "cde"), stop=["de", "bcd"])[:2] == (2, "a")
    # With include_stop_str_in_output the cut is after that same earliest match.
    assert run(FAKE, ids_of("ab", "cde"), stop=["de", "bcd"], include=True)[:2] == (2, "abcd")
    # Same start: the shorter one, which ended first.
    assert run(FAKE, ids_of("ab", "cde"), stop=["bcde", "bc"], include=True)[:2] == (2, "abc")


def test_include_stop_str_in_output_keeps_it_and_cuts_after_it():
    ids = ids_of(" Paris", ".", " It", " is")
    assert run(FAKE, ids, stop=["."])[1] == " Paris"
    assert run(FAKE, ids, stop=["."], include=True)[1] == " Paris."
    assert run(FAKE, ids, stop=["s. I"], include=True)[1] == " Paris. I"


def test_text_that_may_begin_a_stop_string_is_held_back():
    d = IncrementalDetokenizer(FAKE, [], params(stop=["world"]))
    assert not d.add_token(FAKE.id("Hello"))
    assert d.text == "Hello"
    assert not d.add_token(FAKE.id(" wor"))
    assert d.text == "Hello "  # "wor" may become "world"
    assert d.add_token(FAKE.id("ld"))
    assert d.finish("stop", False) == "Hello "
    # The same text, resolved the other way: "wor" is released once it cannot match.
    d = IncrementalDetokenizer(FAKE, [], params(stop=["world"]))
    for t in ids_of("Hello", " wor", "cd"):
        assert not d.add_token(t)
    assert d.text == "Hello worcd"
    # An abort (or a length limit) releases what was still held back.
    d = IncrementalDetokenizer(FAKE, [], params(stop=["world"]))
    d.add_token(FAKE.id(" wor"))
    assert d.text == " "
    assert d.finish("abort", False) == " wor"


def test_a_split_character_is_shown_only_when_complete():
    d = IncrementalDetokenizer(FAKE, [], params())
    d.add_token(FAKE.id("Hello"))
    d.add_token(FAKE.id("🙂".encode()[:2]))
    assert d.text == "Hello"
    d.add_token(FAKE.id("🙂".encode()[2:]))
    assert d.text == "Hello🙂"
    # Never completed: the replacement character appears at the end, as in a full decode.
    d.add_token(FAKE.id("世".encode()[:1]))
    assert d.text == "Hello🙂"
    assert d.finish("length", False) == "Hello🙂\ufffd"


def test_stop_token_text_is_left_out_unless_included():
    dot = FAKE.id(".")
    ids = ids_of(" Paris", ".", " It")
    k, final, _ = run(FAKE, ids, stop_token_ids=[dot])
    assert (k, final) == (2, " Paris")
    # Its text is never shown before the end either (run checks nothing is taken back).
    assert run(FAKE, ids, stop_token_ids=[dot], include=True)[:2] == (2, " Paris.")
    # Stop strings still apply to the text before the stop token.
    assert run(FAKE, ids, stop=["ri"], stop_token_ids=[dot])[:2] == (1, " Pa")
    # If the request ended for another reason on that token (a length limit), its text stays.
    d = IncrementalDetokenizer(FAKE, [], params(stop_token_ids=[dot]))
    d.add_token(FAKE.id(" Paris"))
    d.add_token(dot)
    assert d.text == " Paris"
    assert d.finish("length", False) == " Paris."
    # EOS is a special token: it decodes to nothing.
    d = IncrementalDetokenizer(FAKE, [], params(stop_token_ids=[FAKE.eos_token_id]))
    d.add_token(FAKE.id(" Paris"))
    d.add_token(FAKE.eos_token_id)
    assert d.finish("stop", True) == " Paris"


def test_no_tokenizer_means_no_text_and_no_stop():
    d = IncrementalDetokenizer(None, [1, 2], params(stop=["a"]))
    assert not any(d.add_token(t) for t in range(50))
    assert d.text == d.new_text() == "" == d.finish("length", False)


def test_real_sampling_params_without_include_field():
    from minillm.sampling_params import SamplingParams

    d = IncrementalDetokenizer(FAKE, [], SamplingParams(stop=["."]))
    for t in ids_of(" Paris", ".", " It"):
        if d.add_token(t):
            break
    assert d.finish("stop", False) == " Paris"


def test_a_split_is_decided_only_by_the_bytes_after_it():
    # A long unfinished run makes the detokenizer commit part of its window. The split
    # before an (odd) token with no bytes is not yet decided: the next byte may continue
    # the character before it. The split is made earlier, and the euro sign survives.
    orphan, lead, empty = FAKE.id(b"\x80"), FAKE.id(b"\xe2"), FAKE.id(b"")
    ids = [orphan] * 3 + [lead, empty] + ids_of(b"\x82", b"\xac ")
    assert run(FAKE, ids)[1] == FAKE.decode(ids) == "\ufffd" * 3 + "€ "


# -- cost: a bounded window per token -----------------------------------------------------
def check_bounded_cost(tok, ids, stop=(), max_calls_per_token=3, max_window=12):
    counting = CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, [], params(stop))
    counting.calls.clear()  # the constructor probes the special tokens once
    for t in ids:
        assert not d.add_token(t)
    final = d.finish("length", False)
    assert final == tok.decode(ids, skip_special_tokens=True)
    assert len(counting.calls) <= max_calls_per_token * len(ids)
    assert max(counting.calls) <= max_window
    assert sum(counting.calls) <= max_calls_per_token * max_window * len(ids)  # linear, not n^2 / 2


def test_decoding_4000_tokens_costs_a_bounded_window_per_token(real_tok):
    text = " ".join(CORPUS)
    ids = []
    while len(ids) < 4000:
        ids += real_tok.encode(text, add_special_tokens=False)
    check_bounded_cost(real_tok, ids[:4000], stop=["<never>", "zzzq"])


def test_garbage_bytes_and_special_runs_do_not_grow_the_window():
    orphan = FAKE.id(b"\x80")  # a continuation byte with no start: never a character
    lead = FAKE.id(b"\xe2")  # the start of a 3-byte character
    check_bounded_cost(FAKE, [orphan] * 4000, stop=["zz"], max_calls_per_token=25)
    check_bounded_cost(FAKE, [lead] + [FAKE.eos_token_id] * 4000 + ids_of(b"\x82", b"\xac "))
    check_bounded_cost(FAKE, ([lead, FAKE.eos_token_id, orphan] * 1400)[:4000], max_calls_per_token=25)
