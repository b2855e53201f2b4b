"""Working-set-aware admission (the paper's Algorithm 1): pure-Python bookkeeping, no tensors.

Every iteration the Generator lists the requests that could run, oldest first: decoding
requests with their estimated working set, prefilling ones with their exact prefill working
set, and waiting ones with their prefill working set and lifetime DRAM need. `schedule` walks
that list in order and takes a request only while the bytes taken so far plus its own fit in
M_avl (the HBM block cache). A request that does not fit sits out this iteration with its state
intact; being older than everything admitted after it, it is considered first again next time,
so nothing starves. It answers "no" by leaving requests out, never by raising.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECODE, PREFILL, WAITING = "decode", "prefill", "waiting"


@dataclass(frozen=True, slots=True)
class Candidate:
    """A request that could take part in this iteration.

    Attributes:
        request_id: the request.
        kind: "decode" (prefilled), "prefill" (a prefill in progress) or "waiting" (not started).
        working_set_bytes: M_req, HBM bytes it needs this iteration.
        dram_blocks: head-blocks it may hold in DRAM over its whole life (reserved when a waiting
            request is admitted, so a decode step can never run out of DRAM mid-forward).
        decode_bytes: the HBM bytes of its decode working set (for a request not decoding yet,
            the first estimate), what `Limits.reserve_decode` counts.
    """

    request_id: int
    kind: str
    working_set_bytes: int
    dram_blocks: int = 0
    decode_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds one iteration.

    Attributes:
        max_batch: R_max, requests in flight (prefilling or decoding) and per iteration.
        max_decode_rows: hard cap on decoding rows: one layer's selection for all of them must fit
            in the HBM block cache's slots (else the cache cannot serve the step at all).
        hbm_bytes: M_avl, HBM block-cache bytes; None = unlimited.
        admission: False turns the working-set check off (the ablation); hard caps still hold.
        dram_free_blocks: DRAM head-blocks not yet reserved by requests in flight; None = unlimited.
        reserve_decode: a waiting request starts only while the requests in flight leave it a
            decode row (max_decode_rows) and their decode bytes plus its own fit in M_avl (the
            bytes with admission on and M_avl set).
    """

    max_batch: int
    max_decode_rows: int
    hbm_bytes: int | None
    admission: bool = True
    dram_free_blocks: int | None = None
    reserve_decode: bool = False


@dataclass(slots=True)
class Plan:
    """Who runs this iteration, in FCFS order."""

    decode: list[int] = field(default_factory=list)
    prefill: list[int] = field(default_factory=list)  # in-progress prefills that continue
    start: list[int] = field(default_factory=list)  # waiting requests admitted now
    used_bytes: int = 0  # M_used after admission


def schedule(candidates: list[Candidate], limits: Limits) -> Plan:
    """Algorithm 1 over `candidates` (oldest first). Returns the iteration's plan.

    A request is taken while: the batch has room (max_batch), decode rows stay within the hard
    cap, a waiting request's DRAM need fits the unreserved DRAM (and, with `reserve_decode`, it
    could decode beside every request in flight: a row and its bytes), and (admission on) M_used +
    M_req <= M_avl. The first request of an otherwise empty batch is taken even past M_avl, so a
    request whose working set outgrew the cache still runs (alone) instead of waiting forever.
    """
    plan = Plan()
    in_flight = sum(c.kind != WAITING for c in candidates)
    reserved = sum(c.decode_bytes for c in candidates if c.kind != WAITING)
    dram_free = limits.dram_free_blocks
    taken = 0
    for cand in candidates:
        if taken >= limits.max_batch:
            break
        if cand.kind == DECODE and len(plan.decode) >= limits.max_decode_rows:
            continue
        if cand.kind == WAITING and (
            in_flight >= limits.max_batch
            or (dram_free is not None and cand.dram_blocks > dram_free)
            or (limits.reserve_decode and in_flight and not _decode_fits(in_flight, reserved, cand, limits))
        ):
            continue
        if not _fits(plan.used_bytes, cand.working_set_bytes, limits) and taken:
            continue  # sits out; first in line next time
        taken += 1
        plan.used_bytes += cand.working_set_bytes
        if cand.kind == DECODE:
            plan.decode.append(cand.request_id)
        elif cand.kind == PREFILL:
            plan.prefill.append(cand.request_id)
        else:
            plan.start.append(cand.request_id)
            in_flight += 1
            reserved += cand.decode_bytes
            if dram_free is not None:
                dram_free -= cand.dram_blocks
    return plan


def _decode_fits(in_flight: int, reserved: int, cand: Candidate, limits: Limits) -> bool:
    """`reserve_decode`: whether `cand` could decode beside the `in_flight` requests, whose decode
    working sets take `reserved` bytes: a decode row and its bytes both left for it."""
    return in_flight < limits.max_decode_rows and _fits(reserved, cand.decode_bytes, limits)


def _fits(used: int, needed: int, limits: Limits) -> bool:
    if not limits.admission or limits.hbm_bytes is None:
        return True
    return used + needed <= limits.hbm_bytes
