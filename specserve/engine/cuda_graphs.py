"""The target's uniform decode and verify steps replayed from CUDA graphs, padded up to a captured batch size.

A 135M model's decode step on a GPU is a few hundred kernel launches and little math: the host's launch
time is the step. vLLM captures the decode forward once per batch size (1, 2, 4, then multiples of 8) over
static input buffers and replays it; a step of n sequences runs the graph of the next captured size, the
extra rows padding that write nowhere and whose logits are dropped. This does the same for the decode
step (one query token per sequence) and, with speculation, for each verify length k + 1.

It lives in engine/ beside the runner that owns it: what it pads and copies are the runner's inputs
(ForwardEntry, block tables, slots of the KV pool), and of the model it only calls `forward` and `logits`.

The padded static forward runs uncaptured too (`capture=False`): the same buffers and code, run eagerly at
every step. That is how a CPU checks it against the unpadded forward; on CUDA the graph replays it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.engine.config import EngineConfig
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.models.llama import AttentionInputs, LlamaModel

log = logging.getLogger(__name__)

# vLLM's default ceiling: above it a step's math outweighs its launches and a graph saves little.
MAX_CAPTURE_SIZE = 256


def capture_sizes(max_num_seqs: int, cap: int = MAX_CAPTURE_SIZE) -> tuple[int, ...]:
    """Batch sizes to capture: vLLM's 1, 2, 4, then multiples of 8, up to the first that holds
    max_num_seqs (so every batch the scheduler can make has a graph), none above `cap`."""
    ladder = (1, 2, 4, *range(8, cap + 1, 8))
    below = tuple(s for s in ladder if s < max_num_seqs)
    return below + tuple(s for s in ladder if s >= max_num_seqs)[:1]


def query_lengths(num_speculative_tokens: int) -> tuple[int, ...]:
    """Query lengths to capture: 1 (decode) and each verify length k + 1 for k up to the most drafts a
    sequence may carry (0: speculation off). An adaptive k makes every length occur."""
    return tuple(range(1, num_speculative_tokens + 2))


def padded_size(sizes: tuple[int, ...], n: int) -> int | None:
    """The captured size a batch of n runs at: the smallest that holds it (None: above them all)."""
    return next((s for s in sizes if s >= n), None)


@dataclass(frozen=True)
class SetupFacts:
    """What decides whether graphs may be used at all, read once at engine start."""

    capture: bool  # False: the padded static path runs uncaptured (CPU tests)
    enforce_eager: bool
    device_type: str
    tensor_parallel_size: int
    moe: bool
    batch_invariant: bool
    backend: str
    quantized: bool

    @classmethod
    def of(
        cls, model: LlamaModel, enforce_eager: bool, tensor_parallel_size: int, capture: bool
    ) -> SetupFacts:
        return cls(
            capture,
            enforce_eager,
            model.device.type,
            tensor_parallel_size,
            any(layer.router is not None for layer in model.layers),
            model.batch_invariant,
            model.backend.name,
            model.quantized,
        )


# Ordered: the first that holds is the reason given. Each is a reason the captured forward would be wrong
# or could not be captured, not a guess at speed.
SETUP_RULES: tuple[tuple[str, Callable[[SetupFacts], bool]], ...] = (
    ("--enforce-eager", lambda f: f.enforce_eager),
    ("not a CUDA device", lambda f: f.capture and f.device_type != "cuda"),
    # the ranks' all-reduce runs in other processes the graph cannot hold
    ("tensor parallelism", lambda f: f.tensor_parallel_size > 1),
    # the router's per-expert counts are read on the host (LlamaModel._moe)
    ("MoE layers", lambda f: f.moe),
    # its point is one product form per row whatever the step; padding changes the step
    ("batch-invariant mode", lambda f: f.batch_invariant),
    # Triton reads its launch shape from tensor shapes, never the host; the torch reference plans on the
    # host (uncaptured only) and skips negative slots as padding needs; the C++ kernels do neither
    (
        "not the Triton attention backend",
        lambda f: f.backend != "triton" if f.capture else f.backend not in ("triton", "torch"),
    ),
    # the packed-int kernels choose their form per step size on the host
    ("quantized weights", lambda f: f.quantized),
)


def setup_refusal(facts: SetupFacts) -> str | None:
    return next((why for why, holds in SETUP_RULES if holds(facts)), None)


@dataclass(frozen=True)
class StepShape:
    """What the step rules read of a step, and of the captured set."""

    num_seqs: int
    query_lens: frozenset[int]
    all_logits: bool  # every entry wants the logits of each of its tokens
    capture: bool  # some entry hands back hidden states
    widest_table: int
    captured_query_lens: tuple[int, ...]
    largest_size: int
    table_width: int
    tree: bool = False  # some entry verifies a draft tree (graphs hold causal attention and positions)


STEP_RULES: tuple[tuple[str, Callable[[StepShape], bool]], ...] = (
    ("empty step", lambda s: s.num_seqs == 0),
    ("hidden states captured", lambda s: s.capture),
    ("draft tree", lambda s: s.tree),
    ("query lengths differ", lambda s: len(s.query_lens) > 1),
    ("query length not captured", lambda s: not s.query_lens <= set(s.captured_query_lens)),
    ("logits not wanted for every token", lambda s: not s.all_logits),
    ("batch above the largest captured size", lambda s: s.num_seqs > s.largest_size),
    ("block table wider than max_model_len's", lambda s: s.widest_table > s.table_width),
)


def step_refusal(shape: StepShape) -> str | None:
    return next((why for why, holds in STEP_RULES if holds(shape)), None)


class CudaGraphs:
    """Captured forwards of the target's uniform steps, keyed by (padded batch size, query length).

    Owned by the target's ModelRunner (`runner.graphs`), which asks `run` first and runs the step eagerly
    where it answers None.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        max_model_len: int,
        sizes: tuple[int, ...],
        query_lens: tuple[int, ...],
        max_num_batched_tokens: int,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.capture = capture
        # every table padded to the widest a sequence can have: one graph serves every context length
        self.table_width = -(-max_model_len // block_size)
        # a bound on every position, so the forward never reads one off the device (and the rope cache is
        # grown to it by the first run, before any capture)
        self.max_position = max_model_len - 1
        # the scheduler never makes a step of more tokens, so a larger graph would only hold memory
        self.shapes = [(b, q) for q in query_lens for b in sizes if b * q <= max_num_batched_tokens]
        self.sizes = tuple(sorted({b for b, _ in self.shapes}))
        self.query_lens = tuple(sorted({q for _, q in self.shapes}))
        self.last_refusal: str | None = None  # why the last step ran eagerly (None: it ran here)
        self.steps_run: Counter[tuple[int, int]] = Counter()  # steps served per (padded size, query length)
        most_tokens = max((b * q for b, q in self.shapes), default=0)
        most_seqs = max(self.sizes, default=0)
        device = model.device
        self._input_ids = torch.zeros(most_tokens, dtype=torch.long, device=device)
        self._positions = torch.zeros(most_tokens, dtype=torch.long, device=device)
        self._slots = torch.full((most_tokens,), -1, dtype=torch.long, device=device)
        self._block_tables = torch.zeros(most_seqs, self.table_width, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(most_seqs, dtype=torch.int32, device=device)
        self._query_start_loc = torch.zeros(most_seqs + 1, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, b: int, q: int) -> torch.Tensor:
        """The padded step over the static buffers: float32 logits of all its b * q rows."""
        n = b * q
        attn = AttentionInputs(
            slot_mapping=self._slots[:n],
            block_tables=self._block_tables[:b],
            seq_lens=self._seq_lens[:b],
            query_start_loc=self._query_start_loc[: b + 1],
        )
        hidden = self.model.forward(
            self._input_ids[:n], self._positions[:n], self.kv_caches, attn, self.max_position
        )
        return self.model.logits(hidden)

    def _fill(self, entries: list[ForwardEntry], b: int, q: int) -> None:
        """Copy the step into the static buffers, padded to b sequences. A padding row writes to slot -1
        (skipped by write_kv) and attends to its own q positions in block 0: finite values that no real
        row reads (a context of 1 under q > 1 queries would leave rows with nothing to attend to)."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        bs, width = self.block_size, self.table_width
        for e in entries:
            table = e.block_table
            end = e.start_pos + q
            ids.extend(e.token_ids)
            positions.extend(range(e.start_pos, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(e.start_pos, end))
            tables.append(table + [0] * (width - len(table)))
            seq_lens.append(end)
        pad = b - len(entries)
        ids.extend([0] * (pad * q))
        positions.extend(list(range(q)) * pad)
        slots.extend([-1] * (pad * q))
        tables.extend([[0] * width] * pad)
        seq_lens.extend([q] * pad)
        n = b * q
        self._input_ids[:n].copy_(torch.tensor(ids, dtype=torch.long))
        self._positions[:n].copy_(torch.tensor(positions, dtype=torch.long))
        self._slots[:n].copy_(torch.tensor(slots, dtype=torch.long))
        self._block_tables[:b].copy_(torch.tensor(tables, dtype=torch.int32))
        self._seq_lens[:b].copy_(torch.tensor(seq_lens, dtype=torch.int32))
        qsl = torch.arange(0, (b + 1) * q, q, dtype=torch.int32)
        self._query_start_loc[: b + 1].copy_(qsl)

    def refusal(self, entries: list[ForwardEntry]) -> str | None:
        """Why this step must run eagerly, or None where a graph serves it."""
        shape = StepShape(
            len(entries),
            frozenset(len(e.token_ids) for e in entries),
            all(e.num_logits == len(e.token_ids) for e in entries),
            any(e.capture for e in entries),
            max((len(e.block_table) for e in entries), default=0),
            self.query_lens,
            max(self.sizes, default=0),
            self.table_width,
            any(e.tree is not None for e in entries),
        )
        why = step_refusal(shape)
        if why is None:  # the batch fits a size, but not every size was captured for every length
            q = len(entries[0].token_ids)
            b = padded_size(self.sizes, len(entries))
            if (b, q) not in self.shapes:
                why = "no graph of this size for this query length"
        return why

    def run(self, entries: list[ForwardEntry]) -> torch.Tensor | None:
        """ModelRunner.run's logits for a step a graph serves (float32 [rows, vocab] on the CPU), or None
        where the step must run eagerly (`last_refusal` says why)."""
        why = self.last_refusal = self.refusal(entries)
        if why is not None:
            log.debug("step of %d sequences runs eagerly: %s", len(entries), why)
            return None
        q = len(entries[0].token_ids)
        b = padded_size(self.sizes, len(entries))
        assert b is not None  # refusal checked it
        self._fill(entries, b, q)
        self.steps_run[(b, q)] += 1
        if self.capture:
            graph, out = self._graphs[(b, q)]
            graph.replay()
        else:
            out = self._forward(b, q)
        return out[: len(entries) * q].cpu()

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every shape, largest first into one shared memory pool (vLLM's order: the smaller graphs
        reuse the largest one's blocks), each after a warm-up run: Triton compiles a kernel on its first
        launch, which a capture cannot hold. With capture off, only the warm-up runs."""
        started = time.perf_counter()
        device = self.model.device
        pool = torch.cuda.graph_pool_handle() if self.capture else None
        before = torch.cuda.memory_reserved(device) if self.capture else 0
        for b, q in sorted(self.shapes, key=lambda s: (-s[0] * s[1], -s[0])):
            self._fill([], b, q)  # every row padding: nothing is written to the KV cache
            self._forward(b, q)
            if not self.capture:
                continue
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(b, q)
            self._graphs[(b, q)] = (graph, out)
        if self.capture:
            torch.cuda.synchronize(device)
        pool_bytes = torch.cuda.memory_reserved(device) - before if self.capture else 0
        log.info(
            "CUDA graphs %s: batch sizes %s, query lengths %s, %d graphs in %.1f s, %.0f MiB",
            "captured" if self.capture else "warmed up (uncaptured)",
            list(self.sizes),
            list(self.query_lens),
            len(self._graphs),
            time.perf_counter() - started,
            pool_bytes / 2**20,
        )


def build(runner: ModelRunner, config: EngineConfig, max_model_len: int, capture: bool) -> CudaGraphs:
    """The target runner's graphs for the engine's shapes, captured (or, with capture off, warmed up)."""
    spec = config.speculative_config
    assert not isinstance(spec, dict)  # EngineConfig made it a SpeculativeConfig
    graphs = CudaGraphs(
        runner.model,
        runner.kv_caches,
        runner.block_size,
        max_model_len,
        capture_sizes(config.max_num_seqs),
        query_lengths(spec.num_speculative_tokens if spec is not None else 0),
        config.max_num_batched_tokens,
        capture,
    )
    graphs.capture_all()
    return graphs
