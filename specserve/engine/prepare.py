"""Request preparation off the event loop and the step thread, bounded in workers and in time per request.

    GrammarPool       the API's grammar check: constraints are built by xgrammar in child processes, so
                      the API process never imports xgrammar (which imports torch), a build that runs past
                      its budget is stopped by killing its process (a thread cannot be stopped), and a
                      build never holds the API's GIL
    PreparePool       the worker's preparation (tokenizing, bad-words ids): a few threads, since the
                      tokenizer runs in native code; a field past its budget refuses the request naming
                      the field
    GrammarCompilers  the worker's grammar compiles for its tokenizer, in child processes like the API's
                      checks: a compile past its budget is killed with its process, so a refused grammar
                      stops costing CPU at once (a thread would compile on in the background)

Every child here builds at the lowest CPU priority (lowest_priority, nice 19), after starting at a lowered
one (SETUP_NICE). The preparation threads are not lowered: they share the engine's GIL, and a lowered thread
holding it while a neighbour process takes its core stalls the step thread until the scheduler runs it.

A budget is CPU time spent by the thread or child doing the work (Spend), not time waited for a core: on a
node shared with busy neighbours, a prompt that tokenizes in a millisecond waited seconds for a core and was
refused. Waiting is bounded too, at WALL_FACTOR times the budget, so work the node never runs still ends.
Both refuse an over-budget request as InvalidParameter naming the field: a 400 at the API, `failed` with
`error_field` on the wire. Neither module-level nor here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import threading
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
# A child starts (imports torch and xgrammar: 1-2 s of CPU) this much lower than the engine, not at the
# lowest: beside two busy loops on a 2-core Zen 4 an API's child importing at SCHED_IDLE was not ready after
# 120 s (tests/chaos/test_stall.py), while at nice 10 it still leaves the engine ~90 % of a shared core.
SETUP_NICE = 10
# how many times its CPU budget a field may wait in all: a node that gives the work less than this share of
# a core for that long does not serve it
WALL_FACTOR = 30.0
# how often a budget is looked at while the work runs
POLL_S = 0.25


class GrammarUnavailable(RuntimeError):
    """A grammar child did not start, or died: no fault of the request, which is worth sending again (a 503
    at the API)."""


def setup_priority() -> None:
    """Lower the calling process by SETUP_NICE, for a child's start."""
    with contextlib.suppress(OSError):
        os.nice(SETUP_NICE)


def lowest_priority() -> None:
    """Lower the calling process to nice 19. A CPU worker's engine threads want every core, and a grammar
    compile at their priority took one: a concurrent 8-token request ran 1.70x as slow beside a regex
    `[a-z]{1,60000}` being compiled (`cd bench && python stall.py`, quiet 2-core Xeon). Not SCHED_IDLE,
    which yields more readily on a quiet node (that regex held the short request 1.07x, 1.01x, 1.47x, 1.00x
    against 2.21x, 1.12x, 1.75x, 0.98x at nice 19, the same bench, quiet 2-core Zen 4) but starves beside
    busy neighbours: with two busy loops on that machine a JSON schema's compile at SCHED_IDLE kept its
    request past a 60 s client timeout (tests/test_structured_api.py), and at nice 19 it was served."""
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, 19)


def thread_cpu_clock() -> Callable[[], float | None]:
    """A reader of the calling thread's CPU seconds, callable from any thread; it reads None where the clock
    cannot be read."""
    try:
        clock = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return lambda: None

    def read() -> float | None:
        try:
            return time.clock_gettime(clock)
        except OSError:
            return None

    return read


def process_cpu_s(pid: int | None) -> float | None:
    """CPU seconds process `pid` has run (Linux's scheduler statistics); None where they cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Spend:
    """One piece of work against its budget: CPU seconds read from `cpu` (wall seconds where it reads None),
    and at most WALL_FACTOR times the budget waited in all."""

    def __init__(self, budget_s: float, cpu: Callable[[], float | None]) -> None:
        self.budget_s = budget_s
        self._cpu = cpu
        self._wall0 = time.monotonic()
        self._cpu0 = cpu()

    def left(self) -> float:
        """Seconds before the budget can be spent, at the fastest (one core); <= 0 once it is."""
        wall = time.monotonic() - self._wall0
        now = self._cpu()
        used = wall if now is None or self._cpu0 is None else now - self._cpu0
        return min(self.budget_s - used, self.budget_s * WALL_FACTOR - wall)

    def wait_s(self) -> float:
        """How long to wait before looking again."""
        return max(0.0, min(self.left(), POLL_S))


def over_budget(field: str, budget_s: float) -> InvalidParameter:
    return InvalidParameter(
        field, f"took more than {budget_s:g} s of CPU time to prepare; make it smaller or simpler"
    )


def _serve(conn: Connection) -> None:
    """A child's loop: build each constraint of a job, telling the parent which one it is on, then the first
    error (field, message) or None. Ends when the parent's end of the pipe closes."""
    setup_priority()  # loading torch at the engine's priority took a core from its threads
    import xgrammar  # noqa: F401  (loaded before "ready": a job's budget is not spent importing torch)

    from specserve.engine.grammar import grammar_error

    lowest_priority()
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


def _compile(conn: Connection) -> None:
    """A worker child's loop: first the tokenizer's tables (xgrammar's TokenizerInfo as JSON), then each
    (kind, text) answered ("ok", the compiled grammar as JSON) or ("error", why it does not build). Ends when
    the parent's end of the pipe closes."""
    setup_priority()  # loading torch and the tokenizer's tables at the engine's priority took a core from it
    import xgrammar as xgr

    from specserve.engine.grammar import build_grammar, grammar_error

    info = xgr.TokenizerInfo.deserialize_json(conn.recv())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    lowest_priority()
    conn.send(("ready", None))
    while True:
        try:
            kind, text = conn.recv()
        except (EOFError, OSError):
            return
        error = grammar_error(kind, text)
        if error is not None:
            conn.send(("error", error))
        else:
            conn.send(("ok", compiler.compile_grammar(build_grammar(kind, text)).serialize_json()))


class _Child:
    def __init__(self, ctx: Any, target: Callable[[Connection], None] = _serve) -> None:
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=target, args=(theirs,), name="specserve-grammar", daemon=True)
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

    def pids(self) -> list[int]:
        """The idle children's process ids."""
        return [c.process.pid for c in self._idle if c.process.pid is not None]

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
            try:
                await _receive(child.conn, READY_TIMEOUT_S)
            except (TimeoutError, EOFError, OSError) as e:
                raise GrammarUnavailable(
                    f"a grammar checker did not start within {READY_TIMEOUT_S:g} s"
                ) from e
            child.ready = True
        child.conn.send(job)
        field = job[0][0]
        pid = child.process.pid
        spend = Spend(self.budget_s, lambda: process_cpu_s(pid))
        while True:
            try:
                kind, value = await _receive(child.conn, spend.wait_s())
            except TimeoutError:
                if spend.left() <= 0:
                    raise over_budget(field, self.budget_s) from None
                continue
            if kind == "done":
                return value
            field = job[value][0]


class GrammarCompilers:
    """The worker's grammar compiles for its tokenizer: at most `workers` at once, each in a child process
    (started on first use, kept between compiles) within `budget_s`. Called from a PreparePool thread, which
    waits on the pipe; a child past the budget is killed, so the compile stops with the refusal."""

    def __init__(self, workers: int, budget_s: float) -> None:
        self.workers = workers
        self.budget_s = budget_s
        self._ctx = multiprocessing.get_context("spawn")  # a clean child: the worker's threads are not copied
        self._lock = threading.Lock()
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._info_json: str | None = None
        self._closed = False

    def compile(self, info: Any, kind: str, text: str, mark: Callable[[str | None], None], field: str) -> str:
        """The compiled grammar (xgrammar's JSON) of (kind, text) for the tokenizer `info` (xgrammar's
        TokenizerInfo); InvalidParameter naming `field` if it does not build or runs past the budget. Calls
        mark(None) while a child starts (the process's cost) and mark(field) when the compile begins."""
        child = self._take(info, mark)
        mark(field)
        try:
            child.conn.send((kind, text))
            pid = child.process.pid
            spend = Spend(self.budget_s, lambda: process_cpu_s(pid))
            while not child.conn.poll(spend.wait_s()):
                if spend.left() <= 0:
                    raise over_budget(field, self.budget_s)
            status, value = child.conn.recv()
        except BaseException:
            self._drop(child)
            raise
        self._give_back(child)
        if status == "error":
            raise InvalidParameter(field, value)
        return value

    def _take(self, info: Any, mark: Callable[[str | None], None]) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compilers are closed")
            child = self._idle.pop() if self._idle else None
            if child is not None:
                self._busy.add(child)
                return child
            if self._info_json is None:
                self._info_json = info.serialize_json()
            child = _Child(self._ctx, _compile)
            self._busy.add(child)
        mark(None)
        try:
            child.conn.send(self._info_json)
            if not child.conn.poll(READY_TIMEOUT_S):
                raise GrammarUnavailable(f"a grammar compiler did not start within {READY_TIMEOUT_S:g} s")
            child.conn.recv()
        except BaseException:
            self._drop(child)
            raise
        child.ready = True
        return child

    def _give_back(self, child: _Child) -> None:
        with self._lock:
            self._busy.discard(child)
            if self._closed:
                child.kill()
            else:
                self._idle.append(child)

    def _drop(self, child: _Child) -> None:
        with self._lock:
            self._busy.discard(child)
        child.kill()

    def pids(self) -> list[int]:
        """The children's process ids, idle and busy."""
        with self._lock:
            return [c.process.pid for c in [*self._idle, *self._busy] if c.process.pid is not None]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            children, self._idle = [*self._idle, *self._busy], []
            self._busy.clear()
        for child in children:
            child.kill()


class PreparePool:
    """The worker's preparation: `run(work)` calls work(mark) on one of `workers` threads, where work calls
    mark(field) as it starts on each field, and mark(None) before work that is the process's, not the
    request's (loading the grammar engine and the tokenizer's tables, once). Each field gets `budget_s` of
    its thread's CPU time from its mark; past it the request is refused naming that field. Grammar compiles
    go to `compilers` (child processes, stopped at the budget); the rest finishes its call in the background
    (a thread cannot be stopped), costing one pool thread for a while, never the step thread or the loop."""

    def __init__(self, workers: int, budget_s: float) -> None:
        self.compilers = GrammarCompilers(workers, budget_s)
        self.budget_s = budget_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="specserve-prepare")

    @property
    def budget_s(self) -> float:
        return self._budget_s

    @budget_s.setter
    def budget_s(self, value: float) -> None:  # one budget for a field, compiled or not
        self._budget_s = value
        self.compilers.budget_s = value

    async def run(self, work: Callable[[Callable[[str | None], None]], T], first_field: str) -> T:
        loop = asyncio.get_running_loop()
        # (field or None, its spending), appended by the worker thread: the loop reads the last
        at: list[tuple[str | None, Spend]] = []
        budget_s = self.budget_s

        def call() -> T:
            clock = thread_cpu_clock()

            def mark(field: str | None) -> None:
                at.append((field, Spend(budget_s, clock)))

            mark(first_field)
            return work(mark)

        # the budget runs from when a thread takes the work: waiting behind other requests is not this one's
        future = loop.run_in_executor(self._pool, call)
        while True:
            field, spend = at[-1] if at else (None, None)
            if field is not None and spend is not None and spend.left() <= 0:
                # the thread ends on its own (a compile with the refusal it raised too): its outcome is
                # taken here so that asyncio does not log it as never retrieved
                future.add_done_callback(lambda f: f.cancelled() or f.exception())
                raise over_budget(field, budget_s)
            wait = spend.wait_s() if field is not None and spend is not None else 0.05
            done, _ = await asyncio.wait({future}, timeout=wait)
            if done:
                return future.result()

    def close(self) -> None:
        self.compilers.close()
        with contextlib.suppress(RuntimeError):
            self._pool.shutdown(wait=False, cancel_futures=True)
