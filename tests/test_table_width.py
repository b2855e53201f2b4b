"""Block-table widths of the CUDA-graph decode: geometric buckets of `table_step` blocks."""

from __future__ import annotations

import pytest

from sparseserve_hf.graph import table_width


@pytest.mark.core
def test_widths_are_step_times_powers_of_two_and_their_halfway_points():
    assert [table_width(blocks, 1) for blocks in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert table_width(0, 128) == table_width(1, 128) == 128
    assert [table_width(blocks, 128) for blocks in (129, 385, 513, 1025, 1537)] == [256, 512, 768, 1536, 2048]


@pytest.mark.core
@pytest.mark.parametrize("step", [1, 4, 10, 128])
def test_a_width_holds_the_blocks_within_one_and_a_half_times_the_step_rounded_need(step):
    widths = [table_width(blocks, step) for blocks in range(1, 5000)]
    for blocks, width in enumerate(widths, start=1):
        rounded = -(-blocks // step) * step
        assert width % step == 0 and rounded <= width < 1.5 * rounded
    assert widths == sorted(widths)  # a growing context never narrows its table


@pytest.mark.core
def test_serving_contexts_need_six_widths_not_fourteen():
    """The serving trace's prompts (9.5K-63K tokens, block_size 32, step 128) plus their outputs."""
    blocks = range(9500 // 32 + 1, (63232 + 128) // 32 + 2)
    assert sorted({table_width(b, 128) for b in blocks}) == [384, 512, 768, 1024, 1536, 2048]
    assert len({-(-b // 128) * 128 for b in blocks}) == 14
