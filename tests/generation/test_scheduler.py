"""Admission (Algorithm 1) as pure bookkeeping: exact picks for hand-made candidate lists."""

from __future__ import annotations

import pytest

from sparseserve_hf.generation.scheduler import DECODE, PREFILL, WAITING, Candidate, Limits, schedule


def limits(**overrides) -> Limits:
    return Limits(**(dict(max_batch=8, max_decode_rows=8, hbm_bytes=100) | overrides))


@pytest.mark.core
def test_fcfs_first_fit_leaves_out_what_does_not_fit():
    cands = [Candidate(0, DECODE, 40), Candidate(1, DECODE, 70), Candidate(2, DECODE, 30), Candidate(3, PREFILL, 40)]
    plan = schedule(cands, limits())
    assert plan.decode == [0, 2] and plan.prefill == [] and plan.used_bytes == 70  # 1 sits out; 3 no longer fits
    plan = schedule(cands, limits(admission=False))
    assert plan.decode == [0, 1, 2] and plan.prefill == [3] and plan.used_bytes == 180


@pytest.mark.core
def test_a_request_that_sat_out_goes_first_when_older_ones_are_gone():
    waiting = [Candidate(1, DECODE, 70), Candidate(2, DECODE, 30), Candidate(5, WAITING, 10, dram_blocks=1)]
    assert schedule([Candidate(0, DECODE, 40)] + waiting, limits()).decode == [0, 2]
    assert schedule(waiting, limits()).decode == [1, 2]  # request 0 finished: 1 runs, in order


def test_head_of_line_runs_alone_even_past_the_cache():
    plan = schedule([Candidate(0, DECODE, 500), Candidate(1, DECODE, 10)], limits())
    assert plan.decode == [0] and plan.used_bytes == 500  # never starves; the next one waits


def test_new_requests_need_room_in_the_batch_and_in_dram():
    cands = [Candidate(0, DECODE, 10), Candidate(1, WAITING, 10, 6), Candidate(2, WAITING, 10, 3)]
    assert schedule(cands, limits(dram_free_blocks=5)).start == [2]
    assert schedule(cands, limits(dram_free_blocks=9)).start == [1, 2]
    assert schedule(cands, limits(dram_free_blocks=8)).start == [1]  # reservations add up
    assert schedule(cands, limits(max_batch=2)).start == [1]  # one decoding + one new = R_max
    assert schedule(cands, limits(hbm_bytes=25)).start == [1]


def test_hard_decode_row_cap_holds_without_admission():
    cands = [Candidate(i, DECODE, 1) for i in range(6)]
    assert schedule(cands, limits(max_decode_rows=4, admission=False)).decode == [0, 1, 2, 3]
    assert schedule(cands, limits(max_batch=3, hbm_bytes=None)).decode == [0, 1, 2]


@pytest.mark.core
def test_reserving_decode_starts_a_request_only_where_its_decode_fits_beside_those_in_flight():
    in_flight = [Candidate(0, DECODE, 40, decode_bytes=40), Candidate(1, PREFILL, 5, 1, decode_bytes=40)]
    waiting = [Candidate(2, WAITING, 5, 1, decode_bytes=30), Candidate(3, WAITING, 5, 1, decode_bytes=15)]
    assert schedule(in_flight + waiting, limits()).start == [2, 3]  # the paper's rule: prefill bytes fit
    plan = schedule(in_flight + waiting, limits(reserve_decode=True))
    assert plan.decode == [0] and plan.prefill == [1] and plan.start == [3]  # 40 + 40 + 30 > 100; + 15 fits
    sat_out = [Candidate(0, DECODE, 60, decode_bytes=60), Candidate(1, DECODE, 60, decode_bytes=60)]
    plan = schedule(sat_out + waiting, limits(reserve_decode=True))
    assert plan.decode == [0] and plan.start == []  # a row sitting out still holds its reservation
    assert schedule(waiting, limits(reserve_decode=True, hbm_bytes=10)).start == [2]  # the first always starts
    assert schedule(in_flight + waiting, limits(reserve_decode=True, admission=False)).start == [2, 3]
    assert schedule(in_flight + waiting, limits(reserve_decode=True, max_decode_rows=3)).start == [3]  # one row left
    assert schedule(in_flight + waiting, limits(reserve_decode=True, max_decode_rows=2)).start == []
