"""The capstone on the real model: the reference pieces pass, the stubs are listed as missing,
and a leaking allocator is caught."""
from __future__ import annotations

import pytest

from minillm.course import capstone

pytestmark = pytest.mark.slow


def _leaky_free(free_list, ref_counts, block_ids):
    """Forgets to give back the last block of every free."""
    from solutions.ch03_paged_attention import free_blocks

    free_blocks(free_list, ref_counts, list(block_ids)[:-1])


@pytest.fixture(scope="module")
def solutions_results():
    return capstone.run("solutions", progress=False)


def test_the_reference_pieces_run_the_engine_exactly(solutions_results):
    table = capstone.format_table(solutions_results)
    assert [r.piece.name for r in solutions_results] == [p.name for p in capstone.PIECES]
    assert all(r.status == "ok" for r in solutions_results), table
    assert all(r.tokens_identical for r in solutions_results), table
    assert all(r.schedule_identical and r.blocks_free for r in solutions_results if r.piece.engine), table


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
    [result] = capstone.run("solutions", [piece], progress=False, override={piece: {"free_blocks": _leaky_free}})
    assert result.status == "differs" and result.blocks_free is False, capstone.format_table([result])
    assert "KV blocks" in capstone.format_table([result])


def test_bad_piece_name_is_a_clear_error():
    with pytest.raises(ValueError, match="no piece matches"):
        capstone.run("solutions", ["ch09"], progress=False)
