"""``make gpu-check`` on a machine without CUDA: a dry run that says so and exits 0."""
from __future__ import annotations

import json

import pytest
import torch

from minillm.bench import gpu_check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what a CPU machine does")


def test_dry_run_benchmarks_a_tiny_model(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path), "--skip", "tests"]) == 0
    assert "no CUDA GPU found" in capsys.readouterr().out
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["cuda"] is False and "notebooks" not in report
    runs = report["bench"]["runs"]
    assert [r["engine"] for r in runs] == ["paged", "hf-generate"]
    assert all(r["output_tokens"] == 16 and r["output_tokens_per_s"] > 0 for r in runs)
    assert report["bench"]["same_tokens"] is True


@pytest.mark.slow
def test_dry_run_collects_the_gpu_tests(tmp_path):
    assert gpu_check.main(["--out", str(tmp_path), "--skip", "bench"]) == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["tests"]["rc"] == 0 and "collected" in report["tests"]["last_line"]
