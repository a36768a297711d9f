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


def test_system_without_chat_is_an_error():
    # Before: --system was dropped without a word (there is no template to put it in).
    r = run("generate", "hi", "--system", "Answer in French.", "--max-tokens", "2")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--system" in lines[0] and "--chat" in lines[0], r.stderr
    assert r.stdout == ""


def _bench_fails_before_running(argv, monkeypatch, capsys):
    from minillm.bench import compare

    def must_not_run(*args, **kwargs):
        raise AssertionError("the benchmark ran before its arguments were checked")

    monkeypatch.setattr(compare, "run_benchmark", must_not_run)
    with pytest.raises(SystemExit) as e:
        compare.main(argv + ["--dummy-weights", "--num-requests", "2"])
    assert e.value.code == 2
    return capsys.readouterr().err


def test_bench_json_path_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    err = _bench_fails_before_running(["--json", str(tmp_path)], monkeypatch, capsys)
    assert "--json" in err and "is a directory" in err
    err = _bench_fails_before_running(["--json", str(tmp_path / "missing" / "out.json")], monkeypatch, capsys)
    assert "--json" in err and "does not exist" in err


@pytest.mark.parametrize("value", ["0", "2.5", "abc"])
def test_bench_workload_param_error_names_the_param(value, monkeypatch, capsys):
    err = _bench_fails_before_running(["--workload", "uniform", "--workload-param", f"prompt_len={value}"],
                                      monkeypatch, capsys)
    assert "prompt_len must be an integer >= 4" in err


def test_generate_rejects_a_prompt_that_is_not_utf8_in_one_line():
    """Bytes that are not UTF-8 reach Python as lone surrogates; before, the tokenizer raised
    a TypeError and the command printed a traceback."""
    r = subprocess.run([sys.executable, "-m", "minillm", "generate", b"\xed\xa0\x80", "--max-tokens", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "UTF-8" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.slow
def test_generate_rejects_max_tokens_past_the_context_as_the_server_does():
    """Before: --max-tokens 100000 ran on silently (to the end of the context) where the
    server answers the same request with a 400."""
    r = run("generate", "hi", "--max-tokens", "100000")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "max_tokens is 100000" in lines[0] and "maximum context length" in lines[0], r.stderr
    assert r.stdout == ""
