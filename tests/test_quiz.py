"""The chapter questions: answers are checked by digest, normalised the way the questions say."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from minillm.course import quiz


def test_every_chapter_has_three_to_five_questions():
    for chapter, qs in quiz.QUIZZES.items():
        assert 3 <= len(qs) <= 5, chapter
        assert len({q.qid for q in qs}) == len(qs), f"{chapter}: question ids repeat"
        assert len({q.digest for q in qs}) == len(qs), f"{chapter}: two questions share a digest"


def test_the_answers_are_not_in_the_module_in_plain_text():
    src = inspect.getsource(quiz)
    assert "24576" not in src and "0.85" not in src, "numeric answers must be stored only as digests"


def test_numeric_answers_are_rounded_to_the_questions_decimals():
    assert quiz.check("ch00", "q1", 10.0)[0]
    assert quiz.check("ch00", "q1", 9.96)[0], "9.96 rounds to 10.0 at one decimal"
    assert not quiz.check("ch00", "q1", 9.9)[0]
    assert quiz.check("ch03", "q3", 1 - 300 / 2048)[0] and quiz.check("ch03", "q3", 0.85)[0]
    ok, why = quiz.check("ch03", "q3", 0.86)
    assert not ok and "0.86" in why


def test_choice_answers_take_one_letter_in_any_case():
    assert quiz.check("ch00", "q2", "b")[0] and quiz.check("ch00", "q2", " (B) ")[0]
    assert not quiz.check("ch00", "q2", "a")[0]
    ok, why = quiz.check("ch00", "q2", "z")
    assert not ok and "one of a, b, c, d" in why
    ok, why = quiz.check("ch00", "q2", 2)
    assert not ok and "letter" in why


def test_missing_and_wrongly_typed_answers_say_what_to_do():
    ok, why = quiz.check("ch01", "q1", None)
    assert not ok and "not answered" in why
    for bad in (True, "60", float("nan")):
        ok, why = quiz.check("ch01", "q1", bad)
        assert not ok and "number" in why


def test_unknown_chapter_or_question_is_a_clear_error():
    with pytest.raises(ValueError, match="no questions for chapter"):
        quiz.questions("ch99")
    with pytest.raises(ValueError, match="has no question 'q9'"):
        quiz.check("ch00", "q9", 1)


def test_show_lists_every_question_with_its_choices(capsys):
    text = quiz.show("ch05_speculative_sampling")
    assert text == capsys.readouterr().out.rstrip()
    assert all(f"{q.qid}." in text for q in quiz.questions("ch05"))
    assert "(d)" in text and "[a number, 2 decimals]" in text


# ---------------------------------------------------------------- no answer in plain text

ROOT = Path(__file__).resolve().parents[1]
# What a learner reads before answering: the chapters (text and saved outputs), the exercise
# files, the reference answers, the docs, and the library (for answers written as answers).
LEARNER_READS = ["README.md", "docs/*.md", "exercises/*.py", "solutions/*.py", "chapters/*.ipynb", "minillm/**/*.py"]
NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:[,_]\d{3})+|\d+)(?:\.\d+)?(?:[eE]-?\d+)?(?![\w])")
# An answer written as one, e.g. `"q2": "b"`, `q1: 60` or `q3 = 0.32`: checked whatever its size.
ANSWER = re.compile(r"""\bq(\d)\b['"]?\s*[:=]\s*\(?['"]?(-?[\d_,.]+(?:[eE]-?\d+)?|[a-h])\b""")


def _specific(value: float) -> bool:
    """A number that gives an answer away wherever it appears. Small integers and one-decimal
    numbers turn up everywhere (a "4" or a "0.7" in a chapter is not the answer 4 or 0.7);
    46080 or 0.32 do not."""
    return abs(value) >= 100 or round(value, 1) != value


def _texts():
    for pattern in LEARNER_READS:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text(encoding="utf-8")
            if path.suffix == ".ipynb":
                cells = json.loads(text)["cells"]
                text = "\n".join("".join(c.get("source", [])) + "\n" + "\n".join(
                    "".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", ""))
                    for o in c.get("outputs", [])) for c in cells)
            yield path.relative_to(ROOT), text


def _chapters_of(path: Path) -> list[str]:
    m = re.match(r"(?:ch)?(\d\d)_", path.name)
    key = f"ch{m.group(1)}" if m else None
    return [key] if key in quiz.QUIZZES else list(quiz.QUIZZES)


def _giveaways(path: Path, text: str) -> list[str]:
    found = []
    # Bare numbers count in a chapter's own files (its notebook, exercise and solution); the
    # library's numbers are its constants, and a doc's "0.32" is not chapter 1's answer.
    own = re.match(r"(?:ch)?\d\d_", path.name) is not None
    numbers = {float(t.replace(",", "").replace("_", "")) for t in NUMBER.findall(text)} if own else set()
    for chapter in _chapters_of(path):
        for q in quiz.questions(chapter):
            if q.kind != "numeric":
                continue
            for v in numbers:  # written at the question's precision, e.g. 0.32 and not 0.3187
                if _specific(v) and v == round(v, q.decimals or 0) and quiz.check(chapter, q.qid, v)[0]:
                    found.append(f"{path}: {v:g} is the answer to {chapter} {q.qid}")
        for qn, value in ANSWER.findall(text):
            qid = f"q{qn}"
            if not any(q.qid == qid for q in quiz.questions(chapter)):
                continue
            answer = value if value.isalpha() else float(value.replace(",", "").replace("_", "").rstrip("."))
            if quiz.check(chapter, qid, answer)[0]:
                found.append(f"{path}: '{qid}: {value}' is the answer to {chapter} {qid}")
    return found


def test_no_right_answer_is_written_anywhere_a_learner_reads():
    found = [g for path, text in _texts() for g in _giveaways(path, text)]
    assert not found, "quiz answers in plain text:\n" + "\n".join(found)


def test_the_search_finds_an_answer_written_as_the_solutions_once_wrote_them():
    assert len(_giveaways(Path("solutions/ch00_the_model.py"), 'return {"q1": 10.0, "q2": "b", "q3": 24576}')) == 4
    assert _giveaways(Path("solutions/ch10_x.py"), "q1 = 6_912_000")
    assert _giveaways(Path("chapters/00_x.ipynb"), "that model's token takes 24,576 bytes of KV")
    assert not _giveaways(Path("chapters/00_x.ipynb"), "one token takes 24,577 bytes of KV; q2: a")


def test_the_reference_answers_are_sealed_and_graded_right():
    for chapter in quiz.QUIZZES:
        answers = quiz.sealed(chapter)
        assert all(isinstance(a, quiz.Sealed) for a in answers.values())
        assert all(quiz.check(chapter, qid, a)[0] for qid, a in answers.items())
    ok, why = quiz.check("ch00", "q1", quiz.sealed("ch01")["q1"])
    assert not ok and "not this question's" in why
