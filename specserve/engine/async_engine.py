"""The engine behind an asyncio service: steps run in a dedicated thread (torch releases the GIL), so the
event loop's Redis and HTTP I/O never waits on a forward pass.

Requests and aborts reach the step thread through a lock-guarded inbox; deltas come back to each request's
asyncio.Queue through loop.call_soon_threadsafe.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import AsyncIterator, Callable
from queue import SimpleQueue
from typing import Any

from specserve.engine.config import EngineConfig
from specserve.engine.llm_engine import EngineStats, LLMEngine, Prepared
from specserve.engine.outputs import StepDelta
from specserve.engine.sampling_params import SamplingParams
from specserve.spec.suffix import FleetTree

SWITCH_INTERVAL_S = 0.0005


class EngineThread:
    """One daemon thread that runs what it is given, in order: the engine's load, then its step loop.

    torch's OpenMP pool belongs to the thread that opens a parallel region, and libgomp cuts its workers'
    spin-wait from ~3 ms to 100 iterations once it manages more threads than there are CPUs. A model loaded
    on another thread that stays alive (asyncio.to_thread's pool) leaves a second team behind: on two cores
    every region then woke a sleeping worker, ~50 % slower for small ops (torch.exp of 256 x 1024 and a
    sum: 118-131 us against 187), and `serve` ran at 0.79-0.82x vLLM's throughput where the same engine in
    one thread ran level with it.
    """

    def __init__(self) -> None:
        self._jobs: SimpleQueue[tuple[Callable[[], Any], asyncio.Future, asyncio.AbstractEventLoop] | None]
        self._jobs = SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="specserve-engine", daemon=True)
        self._thread.start()

    def run(self, fn: Callable[[], Any]) -> asyncio.Future:
        """fn() on the thread; its result or exception in the returned future of the running loop."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((fn, future, loop))
        return future

    def close(self) -> None:
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future, loop = job
            try:
                outcome: tuple[Any, BaseException | None] = (fn(), None)
            except BaseException as exc:  # the caller's to handle, as an awaited exception
                outcome = (None, exc)
            try:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            except RuntimeError:  # the loop closed meanwhile: nobody is waiting
                pass


def _settle(future: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, thread: EngineThread | None = None) -> None:
        self.engine = engine
        self._engine_thread = thread  # the thread that loaded the engine, if `load` did
        self._stepping: asyncio.Future | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[str, SamplingParams, bool, int, Prepared]] = []
        self._aborts: list[str] = []
        self._queues: dict[str, asyncio.Queue[StepDelta]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self.error: BaseException | None = None

    @classmethod
    def from_args(cls, **kwargs: Any) -> AsyncLLMEngine:
        """Built on the calling thread; `load` builds it on the thread that will step it."""
        return cls(LLMEngine(EngineConfig.from_kwargs(**kwargs)))

    @classmethod
    async def load(cls, **kwargs: Any) -> AsyncLLMEngine:
        """Built on its own step thread, off the event loop (see EngineThread for why the same thread)."""
        thread = EngineThread()
        try:
            engine = await thread.run(lambda: LLMEngine(EngineConfig.from_kwargs(**kwargs)))
        except BaseException:
            thread.close()
            raise
        return cls(engine, thread)

    # ---- what the service sees ------------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def has_chat_template(self) -> bool:
        return self.engine.tokenizer.chat_template is not None

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        return self.engine.encode_chat(messages, chat_template_kwargs, tools)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        # The step thread holds the GIL between torch ops; when the event loop takes it (Redis, HTTP), the
        # step thread waits up to the switch interval (5 ms by default) to get it back, every time. A short
        # interval keeps the forward pass from stalling behind the loop's Python.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        if self._engine_thread is None:
            self._engine_thread = EngineThread()
        self._stepping = self._engine_thread.run(self._run)

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._stepping is not None:
            await asyncio.wait({self._stepping})
            if not self._stepping.cancelled():
                self._stepping.exception()  # a failure is in self.error, and was told to every waiter
        if self._engine_thread is not None:
            self._engine_thread.close()
            self._engine_thread = None

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        stream: bool = True,
        priority: int = 0,
        prepared: Prepared | None = None,
    ) -> AsyncIterator[StepDelta]:
        """Queue a request; iterate the result for its deltas. Bad prompts raise here, in the caller.

        stream=False yields one delta, the final one with every token: no per-step wake-ups of the event loop
        for a caller that only wants the whole result (vLLM's FINAL_ONLY output kind). `prepared`: what
        engine.prepare made of it off the loop (the service's way, engine/prepare.py); without it the
        preparation runs here, in the caller.
        """
        if self.error is not None:
            raise RuntimeError("the engine thread has failed") from self.error
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        if prepared is None:  # here, not on the step thread, where a bad prompt would fail the engine
            prepared = self.engine.prepare(prompt, params)
        queue: asyncio.Queue[StepDelta] = asyncio.Queue()
        self._queues[request_id] = queue
        with self._lock:
            self._inbox.append((request_id, params, stream, priority, prepared))
        self._wake.set()
        return self._stream(request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue[StepDelta]) -> AsyncIterator[StepDelta]:
        finished = False
        try:
            while not finished:
                delta = await queue.get()
                finished = delta.finished
                yield delta
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self.abort(request_id)  # the consumer walked away: stop spending steps on it

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    @property
    def max_num_seqs(self) -> int:
        return self.engine.scheduler.max_num_seqs

    @property
    def by_priority(self) -> bool:
        """The engine orders by priority (scheduling_policy="priority"), and preempts for it."""
        return self.engine.scheduler.by_priority

    def fleet_tree(self) -> FleetTree | None:
        """The suffix proposer's tree for other workers' outputs (None: the engine drafts with no suffix
        tree): its feed runs on the caller's loop and its builder on a thread of its own, never the step's."""
        spec = self.engine.spec
        return None if spec is None else spec.fleet_tree()

    def free_capacity(self) -> int:
        """Requests to pull now: free sequence slots, and none while admissions are stuck on KV blocks."""
        sched = self.engine.scheduler
        with self._lock:
            pending = len(self._inbox)
        slots = sched.max_num_seqs - len(sched.running) - len(sched.waiting) - pending
        if (
            sched.waiting
            and self.engine.block_manager.num_free_blocks < self.engine.block_manager.num_blocks // 20
        ):
            return 0
        return max(0, slots)

    def num_unfinished(self) -> int:
        with self._lock:
            pending = len(self._inbox)
        return self.engine.num_unfinished() + pending

    def stats(self) -> EngineStats:
        return self.engine.stats()

    # ---- the step thread ------------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                with self._lock:
                    inbox, self._inbox = self._inbox, []
                    aborts, self._aborts = self._aborts, []
                for request_id, params, stream, priority, prepared in inbox:
                    engine.add_request(request_id, prepared.prompt_ids, params, stream, priority, prepared)
                for request_id in aborts:
                    engine.abort(request_id)
                if not engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                deltas = engine.step()
                if deltas:
                    self._loop.call_soon_threadsafe(self._deliver, deltas)
        except BaseException as exc:  # surface a dying engine to every waiter instead of hanging them
            self.error = exc
            self._loop.call_soon_threadsafe(self._fail_all)
            raise

    def _deliver(self, deltas: list[StepDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is not None:
                queue.put_nowait(delta)

    def _fail_all(self) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(StepDelta(request_id, 0, [], "", finished=True, finish_reason="error"))
