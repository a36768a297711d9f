"""python -m minillm: streams a completion; bad input is one line and a non-zero exit."""
import subprocess
import sys

import pytest


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_generate_chat_answers_paris():
    r = run("generate", "What is the capital of France?", "--chat", "--max-tokens", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


@pytest.mark.parametrize("args, field", [
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "", "--max-tokens", "2"], "empty"),
])
def test_bad_input_is_one_line_without_traceback(args, field):
    r = run(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and field in lines[0] and "Traceback" not in r.stderr, r.stderr


def test_help_lists_the_options():
    r = run("generate", "--help")
    assert r.returncode == 0
    for opt in ("--chat", "--max-tokens", "--temperature", "--top-p", "--seed"):
        assert opt in r.stdout
    assert run().returncode != 0 and "generate" in run("--help").stdout
