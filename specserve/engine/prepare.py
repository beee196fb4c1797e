"""Request preparation off the event loop and the step thread, bounded in workers and in time per request.

    GrammarPool       the API's grammar check: constraints are built by xgrammar in child processes, so
                      the API process never imports xgrammar (which imports torch), a build that runs past
                      its budget is stopped by killing its process (a thread cannot be stopped), and a
                      build never holds the API's GIL
    PreparePool       the worker's preparation (tokenizing, bad-words ids, compiling a grammar for the
                      tokenizer): a few threads, since the tokenizer and xgrammar's compiler run in native
                      code; a field past its budget refuses the request naming the field

Both refuse an over-budget request as InvalidParameter naming the field: a 400 at the API, `failed` with
`error_field` on the wire. Neither module-level nor here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from specserve.engine.errors import InvalidParameter

T = TypeVar("T")
# (field to name, kind, text): one constraint to build, as engine/grammar.py constraint_key gives it
Check = tuple[str, str, str]
# a child importing xgrammar (and torch) on a loaded machine; not the request's budget
READY_TIMEOUT_S = 120.0


def over_budget(field: str, budget_s: float) -> InvalidParameter:
    return InvalidParameter(field, f"took more than {budget_s:g} s to prepare; make it smaller or simpler")


def _serve(conn: Connection) -> None:
    """A child's loop: build each constraint of a job, telling the parent which one it is on, then the first
    error (field, message) or None. Ends when the parent's end of the pipe closes."""
    import xgrammar  # noqa: F401  (loaded before "ready": a job's budget is not spent importing torch)

    from specserve.engine.grammar import grammar_error

    conn.send(("ready", None))
    while True:
        try:
            job: list[Check] = conn.recv()
        except (EOFError, OSError):
            return
        error = None
        for i, (field, kind, text) in enumerate(job):
            conn.send(("at", i))
            message = grammar_error(kind, text)
            if message is not None:
                error = (field, message)
                break
        conn.send(("done", error))


class _Child:
    def __init__(self, ctx: Any) -> None:
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(theirs,), name="specserve-grammar", daemon=True)
        self.process.start()
        theirs.close()
        self.ready = False

    def kill(self) -> None:
        self.process.kill()
        self.conn.close()
        self.process.join(timeout=5)


async def _receive(conn: Connection, timeout: float | None) -> tuple[str, Any]:
    """One message from a child, without blocking the loop; TimeoutError past `timeout`."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future[tuple[str, Any]] = loop.create_future()

    def readable() -> None:
        if got.done():
            return
        try:
            got.set_result(conn.recv())
        except (EOFError, OSError) as e:
            got.set_exception(e)

    fd = conn.fileno()
    loop.add_reader(fd, readable)
    try:
        return await asyncio.wait_for(got, timeout)
    finally:
        loop.remove_reader(fd)


class GrammarPool:
    """At most `workers` grammar builds at once, each job within `budget_s`; children start on first use
    (or `start`) and are kept between jobs. A child that overruns is killed and replaced."""

    def __init__(self, workers: int, budget_s: float) -> None:
        self.workers = workers
        self.budget_s = budget_s
        self._ctx = multiprocessing.get_context("spawn")  # a clean child: the API's threads are not copied
        self._idle: list[_Child] = []
        self._slots: asyncio.Semaphore | None = None

    def start(self) -> None:
        """Start the children now, so the first constrained request does not wait for xgrammar's import."""
        while len(self._idle) < self.workers:
            self._idle.append(_Child(self._ctx))

    def close(self) -> None:
        while self._idle:
            self._idle.pop().kill()

    async def check(self, job: list[Check]) -> None:
        """Build every constraint of the job; the first that fails or overruns is an InvalidParameter."""
        if not job:
            return
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            child = self._idle.pop() if self._idle else _Child(self._ctx)
            try:
                error = await self._run(child, job)
            except BaseException:
                child.kill()
                raise
            self._idle.append(child)
        if error is not None:
            raise InvalidParameter(*error)

    async def _run(self, child: _Child, job: list[Check]) -> tuple[str, str] | None:
        if not child.ready:
            await _receive(child.conn, READY_TIMEOUT_S)
            child.ready = True
        child.conn.send(job)
        field = job[0][0]
        end = time.monotonic() + self.budget_s
        while True:
            try:
                kind, value = await _receive(child.conn, max(0.0, end - time.monotonic()))
            except TimeoutError:
                raise over_budget(field, self.budget_s) from None
            if kind == "done":
                return value
            field = job[value][0]


class PreparePool:
    """The worker's preparation: `run(work)` calls work(mark) on one of `workers` threads, where work calls
    mark(field) as it starts on each field, and mark(None) before work that is the process's, not the
    request's (loading the grammar engine and the tokenizer's tables, once). Each field gets `budget_s`
    from its mark; past it the request is refused naming that field. The thread finishes its call in the
    background (a thread cannot be stopped), so a raw producer's pathological grammar costs one pool thread
    for a while, never the step thread or the loop."""

    def __init__(self, workers: int, budget_s: float) -> None:
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="specserve-prepare")

    async def run(self, work: Callable[[Callable[[str | None], None]], T], first_field: str) -> T:
        loop = asyncio.get_running_loop()
        # (field or None, when it began), replaced whole by the worker thread: the loop reads one tuple
        at: list[tuple[str | None, float]] = []

        def mark(field: str | None) -> None:
            at.append((field, time.monotonic()))

        def call() -> T:
            mark(first_field)
            return work(mark)

        # the budget runs from when a thread takes the work: waiting behind other requests is not this one's
        future = loop.run_in_executor(self._pool, call)
        while True:
            field, since = at[-1] if at else (None, time.monotonic())
            left = None if field is None else since + self.budget_s - time.monotonic()
            if left is not None and left <= 0:
                raise over_budget(field, self.budget_s)
            done, _ = await asyncio.wait({future}, timeout=min(left, 0.5) if left is not None else 0.05)
            if done:
                return future.result()

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self._pool.shutdown(wait=False, cancel_futures=True)
