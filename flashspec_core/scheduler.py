"""Iteration-level scheduling: requests join the running batch between steps and leave it when done.

One thread owns the device. Each turn it admits waiting requests into free slots (the one whose
cache shares the longest prefix with the prompt; a longer one another row holds is copied), feeds
a piece of each new prompt (`pieces.py`), steps every prefilled row (`step.Stepper`), hands each
request's new text to its handle and retires rows that finished, were cancelled or ran out of
time. Callers submit a `Request` and read its `RequestHandle`; a full queue refuses with
`EngineBusy` at once. Failure policy (docs/design.md): whatever raises, every request ends (a
result or an error) and the loop serves on; a row that fails alone ends its own request.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque

from flashspec_core.backends.base import TargetRunner
from flashspec_core.drafts.base import DraftSource
from flashspec_core.flusher import Flusher
from flashspec_core.handle import EngineFault, RequestCancelled
from flashspec_core.pieces import PREFILL_CHUNK, Pieces, fed_rows
from flashspec_core.request import Request, Row
from flashspec_core.results import GenerationResult, StreamChunk
from flashspec_core.routing.base import Router
from flashspec_core.routing.store_writer import FLUSH_EVERY
from flashspec_core.step import Stepper

logger = logging.getLogger(__name__)

MAX_ROWS = 8  # rows decoded together by default on a CPU (the engine's `max_batch`)
GPU_MAX_ROWS = 64  # and on a GPU, where a step of 64 rows costs little more than a step of one
MAX_QUEUE = 256  # requests waiting for a slot before `submit` refuses
IDLE_EXIT = 2.0  # seconds without work after which the loop's thread ends (a new request starts it again)


class EngineBusy(RuntimeError):
    """The engine's queue of waiting requests is full: retry later, or raise its `max_queue`."""


class EngineClosed(RuntimeError):
    """The engine was closed: it takes no more requests."""


class Scheduler:
    """The loop that owns the device: admits, prefills, steps and retires rows (see the module doc)."""

    def __init__(self, stepper: Stepper, runner: TargetRunner, drafts: dict[str, DraftSource], router: Router,
                 max_rows: int = MAX_ROWS, max_queue: int = MAX_QUEUE,
                 prefill_chunk: int | None = PREFILL_CHUNK) -> None:
        if max_rows < 1 or max_queue < 1:
            raise ValueError(f"max_batch and max_queue must be >= 1; got {max_rows} and {max_queue}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 or None; got {prefill_chunk}")
        self.stepper, self.runner, self.drafts, self.router = stepper, runner, drafts, router
        self.max_rows, self.max_queue, self.prefill_chunk = max_rows, max_queue, prefill_chunk
        self._waiting: deque[Row] = deque()  # rows waiting for a slot, in arrival order
        self._cond = threading.Condition()
        self._slots: list[Row | None] = [None]  # the runner's rows; None: free
        self._warm: set[int] = set()  # free slots whose cache holds a finished row's tokens
        self._thread: threading.Thread | None = None
        self._closed = False
        self._admissions = 0  # rows admitted so far (Row.admitted)
        self.steps = 0  # decode steps run (for benchmarks and tests)
        self._flusher = Flusher(lambda: self.router.flush(), IDLE_EXIT)  # the router's writes, off this thread

    # ------------------------------------------------------------------ callers' side

    def submit(self, rows: list[Row]) -> None:
        """Queue a request's rows; each joins the running batch as a slot frees up."""
        with self._cond:
            if self._closed:
                raise EngineClosed("the engine was closed; create a new one")
            self._drop_dead(time.monotonic())  # cancelled or expired requests hold no place
            waiting = len({id(r.request) for r in self._waiting})
            if waiting >= self.max_queue:
                raise EngineBusy(f"{waiting} requests are waiting for a slot (max_queue={self.max_queue}); "
                                 "retry later or raise max_queue")
            self._waiting.extend(rows)
            request = rows[0].request
            request.handle.on_cancel(lambda: self._cancel_waiting(request))
            self._cond.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="flashspec-scheduler", daemon=True)
                self._thread.start()

    def close(self) -> None:
        """Stop taking requests; waiting and running ones fail with EngineClosed."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def running(self) -> int:
        """Rows in the batch now."""
        return sum(r is not None for r in self._slots)

    @property
    def queued(self) -> int:
        """Requests waiting for a slot now."""
        with self._cond:
            return len({id(r.request) for r in self._waiting})

    def _cancel_waiting(self, request: Request) -> None:
        """`request` was cancelled (from its caller's thread): its rows still queued leave now,
        and if none of its rows runs it ends now; a running row ends at the next step boundary."""
        with self._cond:
            queued = [r for r in self._waiting if r.request is request]
            if not queued:
                return
            self._waiting = deque(r for r in self._waiting if r.request is not request)
            if not any(r.request is request for r in self._rows()):
                request.handle.fail(self._ended(request, time.monotonic()))
            self._cond.notify_all()

    def _drop_dead(self, now: float) -> None:
        """Under the lock: end the queued requests that were cancelled or ran out of time, and
        drop the queued rows of requests that ended otherwise (a row of theirs failed)."""
        dead = [r for r in self._waiting if r.request.handle.done or r.request.handle.cancelled
                or r.request.expired(now)]
        if not dead:
            return
        gone = {id(r) for r in dead}
        self._waiting = deque(r for r in self._waiting if id(r) not in gone)
        for row in dead:
            row.request.handle.fail(self._ended(row.request, now))  # kept as it was if it had ended

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        """The device thread: turns until idle or closed. What a turn raises ends the requests it
        concerned, never the thread; should it end anyway, it lets go of the engine, so that the
        next `submit` starts another."""
        try:
            while True:
                with self._cond:
                    if not self._cond.wait_for(lambda: self._closed or self._waiting or self.running, IDLE_EXIT):
                        self._thread = None  # idle: the thread ends (and with it its hold on the engine)
                        return
                    if self._closed:
                        self._shut_down()
                        return
                    admitted = self._take_waiting()
                try:
                    self._admit(admitted)
                    self._turn()
                except Exception as exc:  # a bug must not leave callers waiting forever
                    self._recover(exc, admitted)
        finally:
            with self._cond:
                if self._thread is threading.current_thread():
                    self._thread = None

    def _take_waiting(self) -> list[Row]:
        """Under the lock: the waiting rows that fit in the free slots now (in arrival order),
        after the dead ones left the queue."""
        self._drop_dead(time.monotonic())
        free = self.max_rows - self.running
        taken = []
        while self._waiting and free:
            taken.append(self._waiting.popleft())
            free -= 1
        return taken

    def _admit(self, rows: list[Row]) -> None:
        """Give each new row a slot: the free one whose cache shares most with its prompt, else a new
        one; then what any row's cache holds of its prompt (`_share`)."""
        rows = [r for r in rows if not r.request.handle.done]  # cancelled since it was taken from the queue
        self._fit(len(rows))
        free = [s for s, r in enumerate(self._slots) if r is None]
        for row in rows:
            if row.request.handle.done:  # another row of its request failed at admission
                continue
            reuse = {s: self.runner.prefix_len(s, row.prompt) for s in self._warm}
            warm = max(reuse, key=lambda s: (reuse[s], -s), default=None)  # longest reuse, then lowest
            best = warm if warm is not None and reuse[warm] > 0 else free[0]
            free.remove(best)
            self._warm.discard(best)
            row.slot = best
            # what the slot's cache, or another row's, already holds of the prompt is reused (the
            # last token is fed again: its logits score the first position)
            if not self._share(row):
                continue
            row.admitted = self._admissions
            self._admissions += 1
            self._slots[best] = row
            for name, draft in self.drafts.items():
                try:
                    draft.begin([row.prompt])
                except Exception as exc:  # the row's request ends; the others go on
                    self._end_request(row.request, EngineFault.of(f"draft {name!r} (begin)", exc))
                    break

    def _share(self, row: Row) -> bool:
        """Give a row whose prompt is not all fed what any row's cache holds of it (an agent's
        steps and questions over one document share long prefixes): less to feed. False when the
        copy failed: the row's request has ended (the others go on)."""
        try:
            held = min(self.runner.share_prefix(row.slot, row.prompt), len(row.prompt) - 1)
        except Exception as exc:
            self._end_request(row.request, EngineFault.of("copying a cached prefix", exc))
            return False
        if held > row.prefilled:
            row.stats.cached_prompt_tokens += held - row.prefilled
            row.prefilled = held
        return True

    def _fit(self, admitting: int) -> None:
        """Size the batch for the rows running and `admitting` more: grown in steps of `buckets`
        (no resize per row), and, when the batch has drained, shrunk back to the bucket of the
        rows admitted now (see the module doc)."""
        needed = self.running + admitting
        if not (needed > len(self._slots) or (admitting and not self.running)):
            return
        size = min(b for b in buckets(self.max_rows) if b >= needed)
        if size == len(self._slots):
            return
        self._slots = self._slots[:size] + [None] * (size - len(self._slots))
        self._warm = {s for s in self._warm if s < size}
        self.runner.resize(size)

    def _turn(self) -> None:
        """One turn: end what must end, feed a piece of each new prompt, step the decoding rows."""
        now = time.monotonic()
        ending = {id(r.request): r.request for r in self._rows()
                  if r.request.handle.cancelled or r.request.expired(now)}
        for request in ending.values():
            self._end_request(request, self._ended(request, now))
        slots = len(self._slots)
        ready = [r for r in self._rows() if r.processors is not None and not r.finished]
        piece = self.prefill_chunk  # prompt tokens a turn feeds
        waiting = [r for r in self._rows() if r.processors is None]
        for row in waiting:  # a prefix another row computed since this one's admission
            if self._slots[row.slot] is row:  # not ended with another row of its request
                self._share(row)
        waiting = [r for r in waiting if self._slots[r.slot] is r]
        feeding = fed_rows(waiting, piece, self.runner.use_graphs)
        beside = bool(feeding and ready) and not self.runner.use_graphs  # one ragged pass feeds and steps
        if feeding and not beside:
            self._prefill(feeding, slots, piece)
            ready = [r for r in self._rows() if r.processors is not None and not r.finished]
        if not ready:
            return
        before = [len(r.output.token_ids) for r in ready]
        try:
            self.stepper.step(ready, slots, Pieces.of(feeding, slots, piece) if beside else None)
        except Exception as exc:  # find the row that fails; the others go on
            logger.warning("a step of %d rows failed (%r); stepping them one at a time", len(ready), exc)
            self.runner.reset(slots)
            if beside:
                self._prefill(feeding, slots, piece)
            self._isolate(ready, slots)
        else:
            self.steps += 1
            if self.steps % FLUSH_EVERY == 0:
                self._flusher.request()
        faults, self.stepper.faults = self.stepper.faults, []
        for row, fault in faults:  # the router could not learn a step of theirs
            if not row.request.handle.done:
                self._end_request(row.request, fault)
        for row, start in zip(ready, before):
            if self._slots[row.slot] is not row:
                continue
            try:
                self._deliver(row, row.output.token_ids[start:])
            except Exception as exc:  # this row's request ends; the others go on
                self._end_request(row.request, EngineFault.of("handing the row's output to its request", exc))

    def _prefill(self, feeding: list[Row], slots: int, piece: int | None) -> None:
        """Feed the rows' next prompt pieces in one forward; if it fails, row by row, and a row that
        fails alone ends its request."""
        try:
            self.stepper.prefill(feeding, slots, piece)
        except Exception:  # find the request whose input fails; the others go on
            self.runner.reset(slots)  # a failed forward may leave half a step in the cache
            for row in feeding:
                if self._slots[row.slot] is not row:
                    continue
                try:
                    self.stepper.prefill([row], slots, piece)
                except Exception as exc:
                    self.runner.reset(slots)
                    self._end_request(row.request, exc)

    def _isolate(self, rows: list[Row], slots: int) -> None:
        """After a failed step: step alone each row that did not finish in it; a row that fails
        alone ends its request. A row that finished in the failed step (it got its tokens before
        the failure) is not stepped again: what it emitted is final, and it emits nothing more."""
        for row in rows:
            if self._slots[row.slot] is not row or row.finished:
                continue
            try:
                self.stepper.step([row], slots)
            except Exception as exc:
                self.runner.reset(slots)
                self._end_request(row.request, exc)

    @staticmethod
    def _ended(request: Request, now: float) -> BaseException:
        """Why a cancelled or expired request ends."""
        if request.handle.cancelled:
            return RequestCancelled("the request was cancelled")
        return TimeoutError("the request ran past its timeout; raise timeout or lower max_new_tokens")

    def _rows(self) -> list[Row]:
        return [r for r in self._slots if r is not None]

    # ------------------------------------------------------------------ output

    def _deliver(self, row: Row, tokens: list[int]) -> None:
        """Post a row's new tokens and text to its handle; retire it when it finished, and hand
        its request the result once the router's statistics of its steps are written."""
        handle, output = row.request.handle, row.output
        delta = output.take_delta() if handle.stream else ""
        if not output.finished:
            if delta or tokens:
                handle.post(StreamChunk(delta, tokens))
            return
        fault = self._retire(row)
        if fault is not None:
            self._end_request(row.request, fault)
            return
        stats, index = row.stats, row.index
        chunk = StreamChunk(delta, tokens, output.finish_reason, stats)
        result = GenerationResult(output.text, list(output.token_ids), output.finish_reason or "length", stats,
                                  prompt_tokens=stats.prompt_tokens)

        def answer() -> None:
            handle.post(chunk)
            handle.finish(index, result)

        self._flusher.request(answer)

    def _retire(self, row: Row) -> EngineFault | None:
        """Take the row out of the batch (its slot's cache stays for a later prompt sharing its
        prefix), tell the drafts its output and the router its steps not learned yet. The row is
        out either way; the first of these that failed is returned, named."""
        self._slots[row.slot] = None
        self._warm.add(row.slot)
        faults: list[EngineFault | None] = []
        for name, draft in self.drafts.items():
            try:
                draft.end([row.prompt], [row.output.token_ids])
            except Exception as exc:
                faults.append(EngineFault.of(f"draft {name!r} (end)", exc))
        faults.append(self.stepper.learn_row(row))
        return next((f for f in faults if f is not None), None)

    def _end_request(self, request: Request, error: BaseException) -> None:
        """End every row of `request` now; its readers get `error` (what else fails while its
        rows retire is secondary: the request already ends with an error)."""
        for row in self._rows():
            if row.request is request:
                self._retire(row)
        request.handle.fail(error)
        self._flusher.request()

    def _recover(self, error: Exception, admitted: list[Row]) -> None:
        """A turn raised outside the guards of its parts (a bug, or a runner that cannot reset):
        end the running requests and those being admitted (their rows' state is unknown), with an
        error naming the turn, drop every cache, and serve the queue on. Never raises."""
        logger.error("a scheduler turn failed; ending the requests it was running", exc_info=error)
        fault = EngineFault.of("the scheduler's turn", error)
        requests = {id(r.request): r.request for r in [*self._rows(), *admitted]}
        for request in requests.values():
            try:
                self._end_request(request, fault)
            except Exception:
                request.handle.fail(fault)
        self._slots = [None] * len(self._slots)
        self._warm.clear()
        try:
            self.runner.reset(len(self._slots))
        except Exception:  # the next turn's forward fails, and ends its own rows
            logger.exception("resetting the runner after a failed turn failed too")

    def _shut_down(self) -> None:
        """Under the lock: fail everything still waiting or running."""
        error = EngineClosed("the engine was closed while this request was running")
        for row in [*self._rows(), *self._waiting]:
            row.request.handle.fail(error)
        self._slots = [None] * len(self._slots)
        self._waiting.clear()


def buckets(max_rows: int) -> list[int]:
    """The row counts the batch grows through: powers of two, then `max_rows`. A runner on CUDA
    graphs captures each at start-up, so no batch size is met for the first time mid-request."""
    sizes = [1 << k for k in range(max_rows.bit_length()) if 1 << k < max_rows]
    return sizes + [max_rows]
