"""The chapter questions: answers are checked by digest, normalised the way the questions say."""
from __future__ import annotations

import inspect

import pytest

from minillm.course import quiz


def test_every_chapter_has_three_to_five_questions():
    for chapter, qs in quiz.QUIZZES.items():
        assert 3 <= len(qs) <= 5, chapter
        assert len({q.qid for q in qs}) == len(qs), f"{chapter}: question ids repeat"
        assert len({q.digest for q in qs}) == len(qs), f"{chapter}: two questions share a digest"


def test_the_answers_are_not_in_the_module_in_plain_text():
    src = inspect.getsource(quiz)
    assert "46080" not in src and "0.85" not in src, "numeric answers must be stored only as digests"


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
