"""Generator: continuous batching over one shared tiered KV store, with working-set admission.

Each `step()` is one iteration (the paper's Algorithm 1 around an iteration-level scheduler):
1. `scheduler.schedule` walks the requests oldest first and picks this iteration's decoding
   rows, continuing prefills and newly started prefills, while their working sets fit in
   `hbm_cache_bytes` (when admission is on);
2. one batched decode forward over the picked rows, each at its own length and position;
3. prefill work (`BudgetedPrefill`) for the picked prefills, within the iteration's
   token-layer budget; a prompt that finishes prefill samples its first token.

Decode drives the decoder layers through `DecoderStack` rather than `model(...)`: rows sit at
different positions, so RoPE needs per-row `position_ids` (B, 1), and a one-token query needs no
mask (each row's sparse decode attends exactly its own blocks and tail: rows hold no padding).
`DecoderStack` builds what the model's forward would (no mask for q_len 1, HF's rotary per row)
without the forward's shared `cache_position` bookkeeping, and prefill already runs through it.

Every request's KV lives in one `TieredBlockStore` (one DRAM pool, one HBM LRU block cache),
so `hbm_cache_bytes` bounds the whole engine. A prefilling or sitting-out request keeps its
own one-row `SparseServeCache` over that store. A decoding request holds a slot of the batch
cache from the step it joins until it ends or sits out (`place_rows` / `take_rows`): the other
rows never move, so a batch whose requests change keeps its tensors and its captured step, and
a vacant slot rides along in the step doing nothing. A finished row's blocks are freed.
"""

from __future__ import annotations

import dataclasses
from typing import IO, Any

import torch

from ..cache import SparseServeCache
from ..cache.plain import plain_tensors
from ..cache.store import TieredBlockStore
from ..config import SparseServeConfig
from ..graph import StaticDecoder, can_capture
from ..ops import get_ops
from .frontend import Prompt, RequestFrontend
from .in_flight import InFlightStep
from .inputs import check_engine_arguments, metrics_sink, prompt_token_ids
from .lockstep import agree_on_budget, agree_on_candidates, shared_seed, tensor_parallel_size
from .metrics import MetricsRecorder
from .outputs import RequestOutput, StreamEvent
from .pacing import PrefillPacer
from .params import SamplingParams
from .prefill import BudgetedPrefill, DecoderStack
from .prefix import PrefixCache
from .request import PREFILLING, RUNNING, WAITING, Request
from .sampling import make_generator, sample_next
from .scheduler import DECODE, PREFILL, Candidate, Limits, Plan, schedule
from .sizing import EngineSizes
from .working_set import WorkingSetTracker, initial_working_set


class Generator(RequestFrontend):
    """A batching engine over a model loaded with `attn_implementation="sparseserve"`.

    Args:
        model: a stock HF causal LM (Llama, Mistral, Qwen2/3 shapes: every layer full attention).
        tokenizer: needed for string prompts, text output and stop strings; may be None.
        config: the SparseServeConfig (block sizes, budget, `hbm_cache_bytes`, `dram_bytes`,
            `max_batch`, `max_batch_tokens`, `working_set_window`, `admission`,
            `prefill_mode`, `max_inject_tokens`, and the ablation switches `offload`, `transfer`,
            `save_path`, which the engine's one store is built from).
        metrics_file: a path (str or path-like, in an existing folder) or text handle that gets
            one JSON line per finished request.

    Raises:
        TypeError: `model` is not a transformers model, `tokenizer` is not a tokenizer (e.g. the
            config given in its place: the config is the third argument, or `config=`), `config`
            is not a SparseServeConfig, `metrics_file` is not a path or text handle.
        ValueError / NotImplementedError: a model or config the engine cannot serve.

    Example:
        >>> gen = Generator(model, tokenizer, SparseServeConfig(token_budget=2048, hbm_cache_bytes=40 << 30))
        >>> outs = gen.generate(["Hello", "Tell me"], SamplingParams(max_new_tokens=32))
        >>> outs[0].text, outs[0].finish_reason, gen.metrics()["totals"]["tokens_per_s"]
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        config: SparseServeConfig | None = None,
        *,
        metrics_file: str | IO[str] | None = None,
    ) -> None:
        check_engine_arguments(model, tokenizer, config)
        metrics_file = metrics_sink(metrics_file)
        self.config = config if config is not None else SparseServeConfig()
        _check_model(model, self.config)
        self.model, self.tokenizer = model, tokenizer
        self.stack = DecoderStack(model)
        self.prefill = BudgetedPrefill.from_config(self.stack, self.config)
        device, dtype = self.stack.device, model.dtype
        self.tp_size = tensor_parallel_size(model)  # > 1: one rank of a tensor-parallel engine (see `lockstep`)
        self.sizes = EngineSizes(model.config, self.config, dtype, self.tp_size)
        ops = get_ops(self.config.backend, device)
        self.store = TieredBlockStore(self.config, ops, self.sizes.head_dim, dtype, device, self.sizes.hbm_partitions)
        self.batch = SparseServeCache(model.config, self.config, store=self.store)  # checks one row fits
        self.prefixes = PrefixCache(self.store, self.config.block_size) if self.config.prefix_caching else None
        self.slots: list[int | None] = []  # request id in each batch-cache row (None: vacant), to the last held
        self.tracker = WorkingSetTracker(self.config.working_set_window, device)
        self.recorder = MetricsRecorder(metrics_file)
        self.eos_ids = _eos_ids(model, tokenizer)
        self._requests: dict[int, Request] = {}  # in flight and waiting, in arrival (FCFS) order
        self._pending: list[StreamEvent] = []  # events produced between steps (cancel) or set aside
        self._next_id = 0
        self._hbm_peak: torch.Tensor | None = None  # () on the device, see `_track_hbm_peak`
        target = self.config.target_tbt_ms
        self.pacer = None if target is None else PrefillPacer(target / 1e3)  # prefill work beside decoding rows
        # Every decode step is the decoder's: replayed where it captures, else the same step eagerly.
        self._decoder = StaticDecoder(model, self.batch, capture=self._captures(model))
        self._decoder_slots: tuple[int | None, ...] | None = None  # the batch's slots the decoder last started on
        self._ahead: InFlightStep | None = None  # a decode step launched before the last one was read (`decode_ahead`)
        self._ahead_error: BaseException | None = None  # why launching it failed, reported after the last one

    # ---- engine-level API ------------------------------------------------------------------

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, prompt_index: int | None = None) -> int:
        """Queue one request; returns its id. Nothing changes when it raises.

        Args:
            prompt: a str (needs the tokenizer; tokenized as is), a flat list/tuple of int token
                ids, or an integer tensor (T,) or (1, T).
            params: its SamplingParams; None = the defaults.
            prompt_index: reported on its events and output (an int >= 0, or None).

        Raises:
            ValueError: a request that can never run (empty prompt, ids outside the vocabulary, a
                prompt with no room left in the model's context, one that cannot fit alone in
                `hbm_cache_bytes` / `dram_bytes`, stop strings without a tokenizer,
                `stop_token_ids` outside the vocabulary), a negative `prompt_index`.
            TypeError: `prompt` is not a prompt (None, an int, bools, floats, nested lists, a
                non-integer tensor), `params` is not a SamplingParams, `prompt_index` not an int.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        _check_prompt_index(prompt_index)
        ids = self._prompt_ids(prompt, params)
        if not params.greedy and params.seed is None and self.tp_size > 1:
            params = dataclasses.replace(params, seed=shared_seed(self.tp_size, self.stack.device))
        request_id, self._next_id = self._next_id, self._next_id + 1
        request = Request(
            request_id,
            ids,
            params,
            make_generator(params, self.stack.device),
            prompt_index,
            dram_blocks=self.sizes.lifetime_dram_blocks(len(ids) + params.max_new_tokens),
            prefill_bytes=self.sizes.prefill_bytes(len(ids)),
        )
        self._requests[request_id] = request
        self.recorder.arrive(request_id, len(ids))
        return request_id

    @plain_tensors  # in any grad / inference mode: the engine's tables stay plain tensors
    def step(self) -> list[StreamEvent]:
        """Run one iteration; returns the events it produced (and any left from `cancel`).

        A failure while serving a request (its forward, sampling or block transfers) does not
        raise: it ends that request, or the decode batch it was in, with finish_reason "error"
        and the message, frees its blocks, and the engine carries on with the others. Works the
        same inside and outside `torch.inference_mode`, alternately.
        """
        events, self._pending = self._pending, []
        started = self.recorder.now()
        if self._ahead is not None and not any(self._requests.get(r.request_id) is r for _, r in self._ahead.held):
            self._ahead.wait()  # every row of the step launched ahead has ended since: nothing to read
            self._ahead = None
        if self._ahead is not None:  # this iteration's decode step was launched by the last one
            self._stepping = True
            try:
                rows, used, sat_out = self._decode_ahead(events)
            finally:
                self._stepping = False
            self.recorder.iteration(rows, used, sat_out, self.recorder.now() - started, 0)
            return events
        candidates = agree_on_candidates(self._candidates(), self.tp_size, self.stack.device)
        plan = schedule(candidates, self._limits())
        sat_out = sum(c.kind == DECODE for c in candidates) - len(plan.decode)
        self._stepping = True
        try:
            if plan.decode:
                self._decode(plan.decode, events, ahead=not (plan.prefill or plan.start))
                if self.pacer is not None:
                    self.pacer.decode_seconds(self.recorder.now() - started)
            prefilled = self._run_prefills(plan, events)
            if prefilled or not plan.decode:
                self._track_hbm_peak()
        finally:
            self._stepping = False
        seconds = self.recorder.now() - started
        self.recorder.iteration(len(plan.decode), plan.used_bytes, sat_out, seconds, prefilled)
        return events

    @plain_tensors
    def cancel(self, request_id: int) -> bool:
        """Stop a request now and free its blocks; False when it is unknown or already finished.

        Its final event (finish_reason "cancelled") comes with the next `step()`.

        Raises:
            TypeError: `request_id` is not an int (a bool would otherwise pass for the ids 0 and 1).
        """
        if not isinstance(request_id, int) or isinstance(request_id, bool):
            raise TypeError(f"request_id must be an int returned by submit, got {type(request_id).__name__}")
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._pending.append(self._finish(request, "cancelled"))
        return True

    _stepping = False  # True while `step()` runs (see `_abandon`)

    @plain_tensors
    def _abandon(self, request_ids: set[int]) -> None:
        """End the requests of a stream closed before they finished: nobody will read their
        events, so they free their blocks now (finish_reason "cancelled", no event). A stream the
        garbage collector closes in the middle of a `step()` leaves them to run on instead:
        ending them there would change that step's rows under it."""
        if self._stepping:
            return
        for request_id in request_ids:
            request = self._requests.get(request_id)
            if request is not None:
                self._finish(request, "cancelled")

    @property
    def has_unfinished(self) -> bool:
        """True while any request is waiting or in flight, or a final event still waits for `step()`.

        So `while gen.has_unfinished: gen.step()` delivers every event, a cancelled request's too.
        """
        return bool(self._requests or self._pending)

    # ---- reporting ------------------------------------------------------------------------------

    def hbm_bytes_in_use(self) -> int:
        """Device bytes held for KV: resident blocks, block metadata and every row's tail block."""
        return self.store.block_cache_bytes() + self._host_known_hbm_bytes()

    def _host_known_hbm_bytes(self) -> int:
        """The part of `hbm_bytes_in_use` the host knows without reading the device: metadata and tails."""
        caches = [self.batch] + [r.cache for r in self._requests.values() if r.cache is not None]
        tails = sum(
            layer.tail.numel() * layer.tail.element_size() for c in caches for layer in c.layers if layer.is_initialized
        )
        return self.store.metadata_bytes() + tails

    def _track_hbm_peak(self) -> None:
        """Running max of `hbm_bytes_in_use` without a host sync per iteration (a prefill-only
        iteration has none otherwise): the HBM cache's resident count stays on the device, in a
        device-side max that `metrics()` reads back."""
        host_known = self._host_known_hbm_bytes()
        if not self.config.offload:  # the pool is the device's block memory; the host knows its use
            self.recorder.memory(self.store.block_cache_bytes() + host_known)
            return
        now = self.store.hbm.resident_count() * self.store.block_bytes + host_known  # () on the device
        self._hbm_peak = now if self._hbm_peak is None else torch.maximum(self._hbm_peak, now)

    def committed_hbm_bytes(self) -> int:
        """HBM block-cache bytes this engine's requests ask of the next iteration: the admission
        numbers (working sets of decoding requests, prefill working sets of the others), summed.
        What a router compares engines by: `config.hbm_cache_bytes` minus this is room left."""
        return sum(candidate.working_set_bytes for candidate in self._candidates())

    def request_times(self, request_id: int) -> dict[str, Any] | None:
        """The timings `metrics()["requests"]` reports for one request (arrival, first token,
        finish...), or None for an id this engine never saw."""
        times = self.recorder.requests.get(request_id)
        return None if times is None else times.as_dict(request_id)

    def dram_bytes_in_use(self) -> int:
        """Host bytes of live KV blocks (0 with offload=False: they are in `hbm_bytes_in_use`)."""
        return self.store.dram_bytes()

    def metrics(self) -> dict[str, Any]:
        """{"requests": {id: per-request dict}, "totals": engine totals}; see `MetricsRecorder`."""
        for request in self._requests.values():
            self._record_working_set(request)
        if self._hbm_peak is not None:
            self.recorder.memory(int(self._hbm_peak))
        stats = self.store.read_stats()
        looked_up = stats.hits + stats.misses
        totals = (
            self.recorder.totals()
            | {
                "hits": stats.hits,
                "misses": stats.misses,
                "hit_rate": stats.hits / looked_up if looked_up else 0.0,
                "h2d_bytes": stats.h2d_bytes,
                "hbm_bytes_in_use": self.hbm_bytes_in_use(),
                "dram_bytes_in_use": self.dram_bytes_in_use(),
                "hbm_cache_bytes": self.config.hbm_cache_bytes,
                "graph_captures": self._decoder.num_captures,
                "graph_capture_s": self._decoder.capture_s,
            }
            | self.store.load_summary()
            | (self.prefixes.totals() if self.prefixes is not None else {})
            | (self.pacer.totals() if self.pacer is not None else {})
        )
        if torch.cuda.is_available() and self.stack.device.type == "cuda":
            totals["cuda_peak_bytes"] = torch.cuda.max_memory_allocated(self.stack.device)
        requests = {rid: times.as_dict(rid) for rid, times in self.recorder.requests.items()}
        return {"requests": requests, "totals": totals}

    # ---- one iteration --------------------------------------------------------------------------

    def _candidates(self) -> list[Candidate]:
        out = []
        for request in self._requests.values():
            if request.state == RUNNING:
                ws = self._working_set_blocks(request) * self.store.block_bytes
                out.append(Candidate(request.request_id, DECODE, ws, decode_bytes=ws))
            else:  # the first decode estimate only where admission reserves it
                decode = self._working_set_blocks(request) * self.store.block_bytes if self.config.reserve_decode else 0
                kind = PREFILL if request.state == PREFILLING else WAITING
                out.append(Candidate(request.request_id, kind, request.prefill_bytes, request.dram_blocks, decode))
        return out

    def _limits(self) -> Limits:
        dram_free = None
        if self.config.dram_bytes is not None:
            reserved = sum(r.dram_blocks for r in self._requests.values() if r.state != WAITING)
            shared = 0 if self.prefixes is None else self.prefixes.index.pinned_blocks()  # each shared block once
            dram_free = self.store.dram.capacity - reserved - shared
        return Limits(
            max_batch=self.config.max_batch,
            max_decode_rows=self.sizes.max_decode_rows,
            hbm_bytes=self.config.hbm_cache_bytes,
            admission=self.config.admission,
            dram_free_blocks=dram_free,
            reserve_decode=self.config.reserve_decode,
        )

    def _decode(self, request_ids: list[int], events: list[StreamEvent], ahead: bool = False) -> None:
        """One token for every request in `request_ids`, in one batched forward.

        No row's host state changes until the step is complete. A failure anywhere from arranging
        the rows to reading the step back ends the whole batch with "error": the layers may
        already hold the step's K/V, so a row that went on would feed its last token again at the
        same position. A row whose logits are not finite ends alone: the others' step is exact.
        `ahead`: no prefill runs this iteration, so the next decode step may be launched before
        this one is read back (`_launch_ahead`).
        """
        try:
            self._arrange_batch(request_ids)
            step = self._launch_decode(self._host_inputs())
            if ahead and self.config.decode_ahead:
                self._launch_ahead(step)
            tokens, blocks = step.read()
        except BaseException as exc:  # the rows' layers may be half-advanced
            self._fail_batch(f"decode step failed: {_describe(exc)}", events, request_ids)
            if not isinstance(exc, Exception):
                raise  # an interrupt (KeyboardInterrupt...): its batch is ended cleanly first
            return
        self._apply_decode(step, tokens, blocks, events)

    def _decode_ahead(self, events: list[StreamEvent]) -> tuple[int, int, int]:
        """Read back the decode step the last iteration launched ahead (launching the next one first
        where it may); returns its rows still running, admitted bytes and rows left out. Rows that
        ended since it was launched (a token of the last step ended them, or a cancel) are skipped."""
        step, self._ahead = self._ahead, None
        live = sum(self._requests.get(r.request_id) is r for _, r in step.held)
        try:
            self._launch_ahead(step)
            tokens, blocks = step.read()
        except BaseException as exc:
            self._fail_batch(f"decode step failed: {_describe(exc)}", events, [r.request_id for _, r in step.held])
            if not isinstance(exc, Exception):
                raise
        else:
            self._apply_decode(step, tokens, blocks, events)
        return live, step.admitted_bytes, step.sat_out

    def _apply_decode(
        self, step: InFlightStep, tokens: list[int], blocks: list[int], events: list[StreamEvent]
    ) -> None:
        """Record a read-back step's tokens and working sets for its rows still running, then report
        a failure to launch the step after it (its rows may be half-advanced: the batch ends)."""
        good: list[tuple[Request, int]] = []
        for (_, row), token, size in zip(step.held, tokens, blocks):
            if self._requests.get(row.request_id) is not row:
                continue  # ended while the step ran
            row.decode_steps, row.working_set_blocks = row.decode_steps + 1, size
            if token < 0:
                events.append(self._finish(row, "error", "decode step gave non-finite logits (NaN or inf)"))
            else:
                good.append((row, token))
        self._emit_tokens([row for row, _ in good], [token for _, token in good], events)
        if self._ahead_error is not None:
            exc, self._ahead_error = self._ahead_error, None
            self._fail_batch(f"decode step failed: {_describe(exc)}", events, [r.request_id for _, r in step.held])

    def _host_inputs(self) -> tuple[list[tuple[int, Request]], tuple[torch.Tensor, ...]]:
        """The held rows and their step inputs (tokens, positions, decode steps (rows,), held slots
        (B,)), sent to the device in one copy. Vacant slots ride along with token 0 at position 0."""
        held = [(slot, self._requests[rid]) for slot, rid in enumerate(self.slots) if rid is not None]
        tokens, positions, steps = ([0] * self.batch.num_rows for _ in range(3))
        for slot, request in held:
            tokens[slot], positions[slot] = request.output[-1], request.position
            steps[slot] = request.decode_steps + 1  # this step included
        # Every input in one copy to the device, before the step is launched (a copy after it would wait for it).
        rows_count = len(tokens)
        inputs = torch.tensor([*tokens, *positions, *steps, *(slot for slot, _ in held)], device=self.stack.device)
        tokens_in, positions_in, steps_in = inputs[: 3 * rows_count].view(3, rows_count)  # (rows,) each
        return held, (tokens_in, positions_in, steps_in, inputs[3 * rows_count :])

    def _launch_decode(self, held_inputs: tuple[list[tuple[int, Request]], tuple[torch.Tensor, ...]]) -> InFlightStep:
        """Launch the batch's forward, working sets and sampling for `held_inputs` (`_host_inputs`);
        the result is read back by `InFlightStep.read` (the step's one host sync)."""
        held, inputs = held_inputs
        tokens_in, positions_in, steps_in, at = inputs
        logits = self._decoder_step(tokens_in[:, None], positions_in[:, None])  # (rows, V)
        working_sets = self.tracker.observe(self.batch, steps_in)  # (rows,) on the device
        rows = [request for _, request in held]
        chosen = sample_next(logits[at], [r.params for r in rows], [r.generator for r in rows])  # (B,)
        self._track_hbm_peak()  # its host work while the device still runs the step
        return InFlightStep.launched(held, chosen, working_sets.to(chosen.device)[at], inputs)

    def _launch_ahead(self, step: InFlightStep) -> None:
        """Launch the decode step after `step` before `step` is read back, where the next iteration
        would decode the same rows anyway (`_plan_ahead`). A failure to launch it is reported after
        `step`'s tokens, as the failure of the batch."""
        planned = self._plan_ahead(step)
        if planned is None:
            return
        plan, sat_out = planned
        try:
            self._ahead = self._launch_decode((step.held, step.next_inputs()))
        except Exception as exc:  # noqa: BLE001  reported once `step`'s own tokens are recorded
            self._ahead, self._ahead_error = None, exc
            return
        self._ahead.admitted_bytes, self._ahead.sat_out = plan.used_bytes, sat_out

    def _plan_ahead(self, step: InFlightStep) -> tuple[Plan, int] | None:
        """The next iteration's plan and the decoding requests it leaves out, where it decodes `step`'s
        rows and nothing else; else None. That is: the switch is on, one process, no prefix cache,
        the batch's slots are unchanged, no row can end by length with `step`'s
        token (one ended by a stop token decodes one token more, dropped), and the scheduler, on the
        working sets read back so far (one step old), decodes exactly these rows and starts or
        continues no prefill (requests it leaves out wait on, as they would)."""
        config = self.config
        if not config.decode_ahead or self.tp_size > 1 or self.prefixes is not None:
            return None
        if tuple(self.slots) != self._decoder_slots:
            return None
        positions = self.stack.positions
        if not all(
            self._requests.get(r.request_id) is r
            and r.state == RUNNING
            and len(r.output) + 1 < r.params.max_new_tokens
            and positions.has(r.position + 2)
            for _, r in step.held
        ):
            return None
        candidates = self._candidates()
        plan = schedule(candidates, self._limits())
        if plan.prefill or plan.start or sorted(plan.decode) != sorted(r.request_id for _, r in step.held):
            return None
        return plan, sum(c.kind == DECODE for c in candidates) - len(plan.decode)

    def _captures(self, model: torch.nn.Module) -> bool:
        """Whether the decode decoder captures CUDA graphs: `cuda_graphs` on a CUDA model (on CPU True
        runs the step a graph would capture, eagerly), for None wherever a graph can capture the
        step, never on a tensor-parallel rank (its collectives are not captured; see the config)."""
        if self.config.cuda_graphs is None:
            return self.tp_size == 1 and can_capture(model, self.batch)
        return self.config.cuda_graphs and self.stack.device.type == "cuda"

    def _decoder_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """(B, V) logits of the step through `StaticDecoder` (a CUDA-graph replay where it captures).

        The decoder restarts (reads the rows' lengths back once) whenever a slot changes hands (a
        request joined, left or sat out); it captures only a (rows, table width) it has not seen.
        """
        slots = tuple(self.slots)
        if self._decoder_slots != slots:
            self._decoder.start(tokens, positions)
            self._decoder_slots = slots
        self._decoder.step(tokens)
        return self._decoder.logits

    def _run_prefills(self, plan: Plan, events: list[StreamEvent]) -> int:
        """Start the newly admitted prefills, then advance all picked ones within the budget;
        returns the token-layers of prefill run."""
        if not (plan.start or plan.prefill):
            return 0
        for request_id in plan.start:
            self._start_prefill(self._requests[request_id], events)
        budget = self._prefill_budget(len(plan.decode))
        paced = self.pacer is not None and bool(plan.decode)  # decoding rows wait for this prefill work
        started, ran = self.recorder.now(), 0
        for request_id in plan.prefill + plan.start:
            request = self._requests.get(request_id)
            if request is None or request.state != PREFILLING:
                continue  # failed at start
            if budget is not None and budget <= 0:
                break
            used = self._advance_prefill(request, budget, events, paced, forced=not paced or ran == 0)
            budget, ran = None if budget is None else budget - used, ran + used
        if self.pacer is not None and ran:
            if self.stack.device.type == "cuda":  # the work's end on the device, not its launch
                torch.cuda.synchronize(self.stack.device)
            self.pacer.prefill_seconds(self.recorder.now() - started, ran)
        return ran

    def _prefill_budget(self, decode_rows: int) -> int | None:
        """Token-layers of prefill this iteration: the engine's caps (`EngineSizes.prefill_budget`) and,
        with `target_tbt_ms`, what fits the target beside `decode_rows` decoding rows. None = no cap."""
        budgets = [self.sizes.prefill_budget(decode_rows, self.stack.num_layers)]
        if self.pacer is not None:  # from this rank's timings: tensor-parallel ranks take the smallest
            budgets.append(agree_on_budget(self.pacer.budget(decode_rows), self.tp_size, self.stack.device))
        budgets = [budget for budget in budgets if budget is not None]
        return min(budgets) if budgets else None

    def _advance_prefill(
        self,
        request: Request,
        budget: int | None,
        events: list[StreamEvent],
        paced: bool = False,
        forced: bool = True,
    ) -> int:
        """Run `request`'s prefill within `budget` token-layers and, once the prompt is in, pick its
        first token; returns the token-layers run. `paced`: the budget is the pacer's, and a layer
        too long for it is split to fit (`BudgetedPrefill.advance`'s `split_to_budget`). `forced`:
        at least one unit runs even past the budget (a paced iteration forces only its first prefill
        work, so that the prompts after it cannot push the iteration past its target).

        The request turns RUNNING only with its first token recorded. One that fails on the way
        (its forward, its transfers, its logits or sampling) ends with "error": only its own
        cache was touched, and freeing it releases every block it saved.
        """
        used = 0
        try:
            if self.prefixes is not None and request.job.token_layers_done == 0 and request.job.past_length == 0:
                self._adopt_prefix(request)  # nothing in its cache yet (a paced prompt may wait iterations)
            used = self.prefill.advance(request.job, budget, split_to_budget=paced, at_least_one_unit=forced)
            if not request.job.done:
                return used
            logits = self.prefill.logits(request.job)  # (1, V)
            token = int(sample_next(logits, [request.params], [request.generator])[0])
            if self.prefixes is not None:  # the prompt's blocks, for the next request over the same text
                self.prefixes.remember(list(request.prompt), request.cache)
        except BaseException as exc:  # only this request's own cache was touched
            events.append(self._finish(request, "error", f"prefill failed: {_describe(exc)}"))
            if not isinstance(exc, Exception):
                raise  # an interrupt: this request is ended cleanly first
            return used
        if token < 0:
            events.append(self._finish(request, "error", "prefill gave non-finite logits (NaN or inf)"))
            return used
        request.job, request.state = None, RUNNING
        self._emit_tokens([request], [token], events)
        return used

    def _start_prefill(self, request: Request, events: list[StreamEvent]) -> None:
        """Give an admitted request its own cache and prefill job; one that cannot start ends with "error"."""
        try:
            request.cache = SparseServeCache(self.model.config, self.config, store=self.store)
            request.job = self.prefill.start(torch.tensor(request.prompt), request.cache)
        except Exception as exc:  # noqa: BLE001  nothing else was touched
            message = str(exc) if isinstance(exc, ValueError) else f"prefill failed: {_describe(exc)}"
            events.append(self._finish(request, "error", message))
            return
        request.state = PREFILLING
        self.recorder.admit(request.request_id)

    def _adopt_prefix(self, request: Request) -> None:
        """Before the first prefill work: the longest cached prefix of the prompt goes into the
        request's (still empty) cache and the job covers only the rest. Looked up now, not at
        admission, so that a prompt admitted beside the one that computes its prefix still finds it;
        a paced prompt that gets no work this iteration looks again at its next one, unless it
        adopted a prefix (its job then starts after it)."""
        reused, adopted_blocks = self.prefixes.adopt(request.request_id, request.prompt, request.cache)
        if reused:
            request.job = self.prefill.start(torch.tensor(request.prompt[reused:]), request.cache)
            # It will never allocate the blocks it adopted: they count once, as the index's pinned blocks.
            request.dram_blocks -= adopted_blocks

    def _emit_tokens(self, rows: list[Request], tokens: list[int], events: list[StreamEvent]) -> None:
        """Record each row's new token and build its event; a request whose tokenizer raises on
        its output ends alone with "error"."""
        now = self.recorder.now()
        for request, token in zip(rows, tokens):
            self.recorder.token(request.request_id, now)
            try:
                reason = request.add_token(token, self.eos_ids, self.tokenizer, self.stack.positions)
                text = request.text_delta(self.tokenizer, finished=False) if reason is None else None
            except Exception as exc:  # noqa: BLE001  e.g. an id the tokenizer does not know
                events.append(self._finish(request, "error", f"detokenizing failed: {_describe(exc)}", token=token))
                continue
            if reason is None:
                events.append(StreamEvent(request.request_id, token, text, None, request.prompt_index))
            else:
                events.append(self._finish(request, reason, token=token))

    # ---- batch rows -----------------------------------------------------------------------------

    def _arrange_batch(self, request_ids: list[int]) -> None:
        """Make the batch cache's held slots exactly `request_ids`: a request that sits out this
        iteration leaves its slot (its row moves to its own cache), one that joins takes the
        lowest vacant slot. The rows that stay do not move."""
        wanted = set(request_ids)
        for slot, request_id in list(enumerate(self.slots)):  # `_leave_slot` trims the list
            if request_id is not None and request_id not in wanted:  # sits out: keeps its own cache
                self._requests[request_id].cache = self._leave_slot(slot)
        for request_id in request_ids:
            if request_id not in self.slots:
                request = self._requests[request_id]
                slot = self.slots.index(None) if None in self.slots else len(self.slots)
                self.batch.place_rows(request.cache, [slot], max_rows=self.sizes.max_decode_rows)
                request.cache = None
                self.slots += [None] * (slot + 1 - len(self.slots))
                self.slots[slot] = request_id

    def _leave_slot(self, slot: int) -> SparseServeCache:
        """Move the row in `slot` out of the batch into a one-row cache; the slot turns vacant."""
        cache = self.batch.take_rows([slot])
        self.slots[slot] = None  # only once the row has left: a failed move keeps it in the batch
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        return cache

    def _finish(self, request: Request, reason: str, error: str | None = None, token: int | None = None) -> StreamEvent:
        """End a request in any state: free every block it holds, record it, build its last event.

        Called once per request (it leaves `_requests` here). A tokenizer that raises on the
        final text turns the outcome into "error" rather than losing the event.
        """
        self._release(request, remember=reason != "error")
        del self._requests[request.request_id]
        self._record_working_set(request)
        try:
            text = request.text_delta(self.tokenizer, finished=True)
            output = request.to_output(self.tokenizer, reason, error)
        except Exception as exc:  # noqa: BLE001  the request still ends, without text
            reason, error, text = "error", f"detokenizing failed: {_describe(exc)}", None
            output = RequestOutput(request.request_id, request.prompt, tuple(request.output), None, reason, error)
        self.recorder.finish(request.request_id, reason)
        return StreamEvent(request.request_id, token, text, output, request.prompt_index)

    def _release(self, request: Request, remember: bool = False) -> None:
        """Free the request's blocks; `remember`: first index them for prefix reuse (its cache holds
        the KV of its prompt and of every output token but the last, which was never fed back).
        A decode step launched ahead over the request's row may still read them: it ends first."""
        if self._ahead is not None and any(row is request for _, row in self._ahead.held):
            self._ahead.wait()
        if request.request_id in self.slots:
            request.cache = self._leave_slot(self.slots.index(request.request_id))
        if request.cache is not None:
            if self.prefixes is not None and remember and request.job is None:
                self.prefixes.remember(list(request.prompt) + request.output[:-1], request.cache)
            self.tracker.forget(request.cache)
            request.cache.reset()  # drops the row's references: its blocks leave DRAM and HBM
        if self.prefixes is not None:
            self.prefixes.forget(request.request_id)
        request.cache = request.job = None

    def _fail_batch(self, message: str, events: list[StreamEvent], request_ids: list[int]) -> None:
        """End a failed decode step's requests with "error": every row of the batch cache, whose
        layers may be half-advanced, and every request picked for the step (one whose rows were
        moving when the step failed may be half in the batch). All their blocks are freed, a step
        launched ahead over them ends first and is dropped."""
        if self._ahead is not None:
            self._ahead.wait()
            self._ahead = None
        self._ahead_error = None  # a failed launch ahead over this batch: this failure ends it
        self.tracker.forget(self.batch)
        self.batch.reset()  # also clears a half-done step's staged keys
        failed = [rid for rid in self.slots if rid is not None]
        self.slots, self._decoder_slots = [], None
        failed = failed + [rid for rid in request_ids if rid not in failed and rid in self._requests]
        for request_id in failed:
            events.append(self._finish(self._requests[request_id], "error", message))

    # ---- sizes and checks -----------------------------------------------------------------------

    def _working_set_blocks(self, request: Request) -> int:
        """Measured union of the last w steps once the request has decoded, else the budget estimate."""
        if request.decode_steps == 0:
            tokens = len(request.prompt) + len(request.output)
            return initial_working_set(self.config, self.model.config, tokens, self.tp_size)
        return request.working_set_blocks

    def _record_working_set(self, request: Request) -> None:
        times = self.recorder.requests[request.request_id]
        if request.state == RUNNING:
            times.working_set_blocks = self._working_set_blocks(request)
            times.working_set_bytes = times.working_set_blocks * self.store.block_bytes

    def _prompt_ids(self, prompt: Prompt, params: SamplingParams) -> tuple[int, ...]:
        """The prompt's token ids once it and `params` pass every check that needs the engine."""
        ids = prompt_token_ids(prompt, self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (use stop_token_ids without one)")
        vocab = self.sizes.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):  # the model can never produce such an id
            raise ValueError(f"stop_token_ids {params.stop_token_ids} reach past the model's vocabulary [0, {vocab})")
        self.sizes.check_prompt(ids, params.max_new_tokens)
        return ids

    def _rejected(self, prompt: Prompt, index: int, message: str) -> StreamEvent:
        """The one event of a prompt `submit` refused (it never gets an id that runs)."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        try:  # a prompt refused for its length or ids still reports them; a malformed one reports ()
            ids = prompt_token_ids(prompt, self.tokenizer)
        except (TypeError, ValueError):
            ids = ()
        output = RequestOutput(request_id, ids, (), "" if self.tokenizer is not None else None, "error", message)
        return StreamEvent(request_id, None, output.text, output, index)


def _check_model(model: torch.nn.Module, config: SparseServeConfig) -> None:
    implementation = getattr(model.config, "_attn_implementation", None)
    if implementation != "sparseserve":
        raise ValueError(
            f"Generator needs a model loaded with attn_implementation='sparseserve' (import sparseserve_hf "
            f"first), got {implementation!r}"
        )
    if config.dense_layers:
        raise NotImplementedError("Generator batches rows of different lengths: dense_layers are not supported yet")
    types = getattr(model.config.get_text_config(), "layer_types", None) or []
    if any(kind != "full_attention" for kind in types) or getattr(model.config, "sliding_window", None):
        raise NotImplementedError("Generator supports models whose layers are all full attention (no sliding window)")


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    generation = getattr(model, "generation_config", None)
    for value in (getattr(generation, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _check_prompt_index(prompt_index: object) -> None:
    if prompt_index is None:
        return
    if not isinstance(prompt_index, int) or isinstance(prompt_index, bool):
        raise TypeError(f"prompt_index must be an int or None, got {type(prompt_index).__name__}")
    if prompt_index < 0:
        raise ValueError(f"prompt_index must be >= 0, got {prompt_index}")


def _describe(exc: BaseException) -> str:
    """An exception as an output's error message: its type and text."""
    return f"{type(exc).__name__}: {exc}"
