"""The capstone on the real model: the reference pieces pass, piece by piece and all in one
engine; the stubs are listed as missing; wrong pieces are caught and the first difference named."""
from __future__ import annotations

import pytest

from minillm import seams
from minillm.course import capstone, one_engine

pytestmark = pytest.mark.slow


def _leaky_free(free_list, ref_counts, block_ids):
    """Forgets to give back the last block of every free."""
    from solutions.ch03_paged_attention import free_blocks

    free_blocks(free_list, ref_counts, list(block_ids)[:-1])


@pytest.fixture(scope="module")
def solutions_results():
    return capstone.run("solutions", progress=False, repeats=1)


def test_the_reference_pieces_run_the_engine_exactly(solutions_results):
    table = capstone.format_table(solutions_results)
    assert [r.piece.name for r in solutions_results] == [p.name for p in capstone.PIECES]
    assert all(r.status == "ok" for r in solutions_results), table
    assert all(r.tokens_identical for r in solutions_results), table
    assert all(r.schedule_identical and r.blocks_free for r in solutions_results if r.piece.engine), table


def test_every_seam_is_a_piece_of_the_capstone():
    in_pieces = {name for p in capstone.PIECES for name in p.functions}
    assert set(seams.SEAMS) <= in_pieces, sorted(set(seams.SEAMS) - in_pieces)


def test_the_stubs_are_listed_as_missing_by_name(capsys):
    code = capstone.main(["--impl", "exercises", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    for piece in capstone.PIECES:
        assert f"{piece.name}: still to write in exercises/{piece.chapter}.py" in out
        for name in piece.functions:
            assert name in out


def test_a_leaking_allocator_is_caught():
    # The other two deliberately wrong pieces (a scheduler that waits for the batch to drain,
    # a verifier that accepts every draft) are caught on a tiny model in tests/test_seams.py.
    piece = "blocks, slots, preemption"
    [result] = capstone.run("solutions", [piece], progress=False, repeats=1,
                            override={piece: {"free_blocks": _leaky_free}})
    # The engine checks a plugged free_blocks at the call and stops at the first free that would leak.
    assert result.status == "differs" and "freeing drops one reference" in result.detail, \
        capstone.format_table([result])
    assert "seam free_blocks" in capstone.format_table([result])


def test_bad_piece_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no piece matches"):
        capstone.run("solutions", ["ch99"], progress=False)


def test_the_throughput_column_names_no_noise_as_a_result():
    assert capstone.speed_verdict([1.0, 1.1, 1.2], [2.0, 2.1, 2.2]) == pytest.approx(1.1 / 2.1)
    assert capstone.speed_verdict([1.0, 1.3, 1.2], [1.1, 1.2, 1.4]) is None  # the ranges overlap
    assert capstone.speed_verdict([1.00, 1.01, 1.02], [1.03, 1.04, 1.05]) is None  # apart, but within 5%
    assert capstone.speed_verdict([1.0], [2.0]) is None  # one run a side cannot tell


# -- every piece in one engine (--all) -----------------------------------------------------

@pytest.fixture(scope="module")
def lab():
    from minillm.course.notebook import Lab

    return Lab()


@pytest.fixture(scope="module")
def library_run(lab):
    return one_engine.run_assembled(lab, None)


def test_the_assembled_engine_exercises_every_mechanism(library_run):
    # Preemption, prefix hits, the controller moving the budget both ways, speculation.
    assert library_run.preemptions > 0 and library_run.prefix_hit_tokens > 0
    budgets = [b for _, b in library_run.budgets]
    assert any(b < a for a, b in zip(budgets, budgets[1:])) and any(b > a for a, b in zip(budgets, budgets[1:]))
    assert library_run.blocks_free and library_run.server_text and 0 < library_run.server_tokens <= one_engine.SERVER_MAX_TOKENS


def test_all_reference_pieces_serve_in_one_engine_exactly(lab, library_run):
    fns, missing = one_engine.collect("solutions")
    assert not missing
    assert set(fns) == set(seams.SEAMS) - set(one_engine.OTHER_ENGINES)
    yours = one_engine.run_assembled(lab, fns)
    checks = one_engine.compare(yours, library_run)
    report = one_engine.format_report(yours, library_run, checks, missing)
    assert all(c.same for c in checks), report
    assert set(yours.calls) == set(fns), f"never called: {sorted(set(fns) - set(yours.calls))}"


def test_a_wrong_piece_in_the_assembled_engine_is_named_at_its_first_step(lab, library_run):
    def fcfs(waiting, now, timeouts):  # ignores classes and timeouts: queue order
        return [rid for rid, _, arrival in waiting if arrival <= now]

    yours = one_engine.run_assembled(lab, {"admission_order": fcfs})
    checks = {c.what.split(" (")[0]: c for c in one_engine.compare(yours, library_run)}
    sched = next(c for w, c in checks.items() if w.startswith("step schedule"))
    assert not sched.same and sched.detail.startswith("first different step:"), sched
    assert "yours" in sched.detail and "library" in sched.detail
    assert yours.blocks_free


def test_capstone_all_with_stubs_names_every_missing_function(capsys):
    code = capstone.main(["--impl", "exercises", "--all", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    for name in set(seams.SEAMS) - set(one_engine.OTHER_ENGINES):
        assert name in out
