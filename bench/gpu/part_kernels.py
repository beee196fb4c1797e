"""The GPU report's kernel part: the Triton kernels against the torch reference on the same device, then
decode attention's effective bandwidth against the device's measured copy rate.

Exactness: every case draws fresh random inputs on the device, poisons what no sequence owns (spare blocks,
the tail of each last block, blocks wholly before a sliding window) and the output with NaN, runs
triton_attention, and compares with reference.paged_attention on the same inputs upcast to float64:
||out - ref|| / ||ref|| under a bound per dtype, NaN never passing. The cases are built so that few kernel
variants compile (Triton compiles once per constexpr combination and per integer specialisation): each
dtype x head size, with the GQA group rotating, runs decode, verify, prefill and mixed batches at its two
tile heights, the block size swapped between them; block tables are padded to a width that is a multiple of
16 so that their stride never changes the specialisation. 38 variants by design; the run reports the count
Triton compiled. Split-K, window, soft-cap and write_kv cases run first: few cases, many variants.

Bandwidth: one decode query per sequence over a bf16 cache, timed with CUDA events (common.median_ms) around
each launch, and again from the replays of a CUDA graph of several steps, which is how the engine runs a
decode step: the launches' host time drops out, and what remains is the kernels' own. The bytes counted
are the K/V the kernel must read (seq_len x kv heads x head_dim x 2 x 2 bytes per sequence) plus q, out,
the block tables, seq_lens and query_start_loc; the split-K partials are not counted (they are the kernel's
own overhead). Cache sets rotate when one set would sit in L2.

With ctx.smoke the same code runs a few tiny cases of each kind (the driver sets TRITON_INTERPRET=1 on a
CPU) and times one tiny cell, which checks the script, not the kernels' speed.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from bench.gpu.common import Context, Part, median_ms, rel_err, table

# ||out - ref|| / ||ref|| against float64: float32 with "ieee" dots errs at rounding level only; bf16 / fp16
# operands (and P rounded to the input dtype for the tensor cores) land between 1e-3 and 1e-2.
THRESHOLDS = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (16, 32)
GROUPS = (1, 3, 4, 8)
KV_HEADS = {1: 4, 3: 3, 4: 2, 8: 1}  # q heads 4, 9, 8, 8: small, so the float64 reference stays cheap
SPARE_BLOCKS = 3  # unowned (NaN) blocks in every cache, block 0 among them
TABLE_ALIGN = 16
# Time kept for the bandwidth table when the matrix runs long: a share of what is left at the start.
BANDWIDTH_SHARE = 0.4
BANDWIDTH_GOAL = 0.7
SEQS = (16, 64, 256)
CONTEXTS = (1024, 4096, 8192)
BANDWIDTH_BLOCK_SIZE = 16
MAX_CELL_BYTES = 10 << 30  # one cache set's K/V: 256 x 8k at head size 128 is 8.6 GB
ROTATE_BYTES = 256 << 20  # cache sets rotate until together they hold this much: several times an H100's L2
MAX_SETS = 16
GRAPH_MIN_STEPS = 4  # decode steps in one timed graph, rounded up to whole turns of the cache sets
COPY_BYTES = 1 << 30


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class AttentionCase:
    family: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]  # tokens cached before the new ones
    group: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_splits: int | None = 1  # None: the kernel's own choice (by SM count on CUDA)
    window: int | None = None
    softcap: float | None = None
    # Pass max_query_len as a caller may: verify batches then take the short tile when it fits.
    query_hint: bool = False

    @property
    def num_kv_heads(self) -> int:
        return KV_HEADS[self.group]

    @property
    def name(self) -> str:
        extra = "".join(
            [
                f"-s{self.num_splits if self.num_splits is not None else 'auto'}"
                if self.num_splits != 1
                else "",
                f"-w{self.window}" if self.window else "",
                f"-cap{self.softcap:g}" if self.softcap else "",
            ]
        )
        return (
            f"{self.family}-{_name(self.dtype)}-d{self.head_dim}-b{self.block_size}-g{self.group}{extra}"
            f"-q{'.'.join(map(str, self.query_lens))}-c{'.'.join(map(str, self.context_lens))}"
        )

    def variant(self) -> tuple:
        """What selects a compiled attention kernel, as the launch derives it (short tile for <= 16 rows)."""
        if self.query_hint:
            max_q = max(self.query_lens)
        else:
            max_q = sum(self.query_lens) - len(self.query_lens) + 1
        tall = max_q * self.group > 16
        return (
            "attention",
            self.dtype,
            self.head_dim,
            self.block_size,
            self.group,
            tall,
            self.num_splits,
            bool(self.window),
            bool(self.softcap),
        )


@dataclass(frozen=True)
class WriteCase:
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype  # key / value
    cache_dtype: torch.dtype
    slot_dtype: torch.dtype
    family: str = "write_kv"

    @property
    def name(self) -> str:
        return (
            f"write_kv-{_name(self.dtype)}-into-{_name(self.cache_dtype)}-h{self.num_kv_heads}-d{self.head_dim}"
            f"-b{self.block_size}-{_name(self.slot_dtype)}-t{self.num_tokens}"
        )

    def variant(self) -> tuple:
        return (
            "write_kv",
            self.dtype,
            self.cache_dtype,
            self.slot_dtype,
            self.num_kv_heads,
            self.head_dim,
            self.block_size,
        )


Case = AttentionCase | WriteCase


def _sized(draft: AttentionCase, short_bs: int, tall_bs: int) -> AttentionCase:
    """The block size that goes with the case's tile height (see _core_cases)."""
    tall = draft.variant()[5]
    return dataclasses.replace(draft, block_size=tall_bs if tall else short_bs)


def _core_cases(smoke: bool, rng: random.Random) -> list[AttentionCase]:
    """Every dtype x head size, the group rotating, each at both tile heights (short: decode and small
    verify; tall: larger verify, prefill, mixed steps) with the block size swapped between the two, so that
    every dtype x head size x block size appears while each combination compiles two variants, not four."""
    long_ctx, chunk, reps = (60, 40, 1) if smoke else (700, 300, 2)
    combos = list(itertools.product(DTYPES, HEAD_DIMS))
    if smoke:
        combos = [combos[0], combos[4], combos[8]]  # f32 d64, bf16 d128, f16 d256
    verifies = ((2, 3, 4, 5), (6, 7, 8, 9))  # k + 1 = 2..9: with GQA groups the longer take the tall tile
    cases = []
    for i, (dtype, head_dim) in enumerate(combos):
        group = GROUPS[i % len(GROUPS)]
        sizes = (BLOCK_SIZES[i % 2], BLOCK_SIZES[1 - i % 2])
        batches: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for _ in range(reps):
            # lengths off and on block boundaries (either block size), a 1-token prompt
            ctx = (0, 32 * rng.randint(1, 3), 32 * rng.randint(1, 3) + rng.randint(1, 15))
            batches.append(("decode", (1,) * 5, (*ctx, rng.randint(33, long_ctx), rng.randint(1, long_ctx))))
        for verify_q in verifies if not smoke else verifies[i % 2 : i % 2 + 1]:
            batches.append(("verify", verify_q, tuple(rng.randint(1, long_ctx) for _ in verify_q)))
        for _ in range(reps):
            # chunked prefill: a fresh prompt, a chunk after cached context mid-block, one after whole blocks
            prefill_q = (rng.randint(17, chunk), rng.randint(17, chunk), 17)
            batches.append(("prefill", prefill_q, (0, rng.randint(1, long_ctx), 32 * rng.randint(1, 4))))
        # one engine step: decodes, a verify and a prefill chunk together
        mixed_q = (1, 1, 2 + i % 8, rng.randint(17, chunk // 2))
        batches.append(("mixed", mixed_q, tuple(rng.randint(1, long_ctx) for _ in mixed_q)))
        for family, query_lens, context_lens in batches:
            draft = AttentionCase(
                family,
                query_lens,
                context_lens,
                group,
                head_dim,
                sizes[0],
                dtype,
                query_hint=family == "verify",
            )
            cases.append(_sized(draft, *sizes))
    return cases


def _special_cases(smoke: bool) -> list[AttentionCase]:
    """Split-K (few sequences over long contexts), sliding windows and soft-capping."""
    f32, bf16, f16 = DTYPES
    if smoke:
        return [
            AttentionCase("split-k", (1, 2), (150, 77), 4, 64, 16, bf16, num_splits=4),
            AttentionCase("window", (1, 1, 4, 20), (5, 90, 36, 30), 3, 64, 16, f32, window=37),
            AttentionCase("softcap", (1, 3, 17), (40, 20, 9), 1, 128, 32, f16, softcap=20.0),
        ]
    return [
        AttentionCase("split-k", (1, 1), (3001, 1500), 4, 128, 16, bf16, num_splits=8),
        AttentionCase("split-k", (1, 1, 1), (2047, 333, 2600), 3, 64, 32, f16, num_splits=4),
        AttentionCase("split-k", (1, 3), (1800, 2201), 8, 256, 16, f32, num_splits=4, query_hint=True),
        AttentionCase("split-k", (1, 1), (4000, 3111), 1, 256, 32, bf16, num_splits=None),
        AttentionCase("window", (1, 1, 4, 5), (5, 300, 36, 100), 3, 64, 16, f32, window=37),
        AttentionCase("window", (150, 40), (0, 300), 4, 128, 32, bf16, window=100),
        AttentionCase("window", (1, 2, 9), (61, 500, 60), 1, 256, 16, f16, window=61, query_hint=True),
        AttentionCase("window", (1, 2), (2000, 900), 8, 64, 16, bf16, num_splits=4, window=200),
        AttentionCase("softcap", (1, 1, 5, 60), (90, 400, 33, 0), 4, 128, 16, f32, softcap=30.0),
        AttentionCase("softcap", (120, 1, 1), (70, 300, 17), 3, 256, 32, bf16, window=45, softcap=50.0),
        AttentionCase("softcap", (1, 1, 1), (20, 500, 31), 1, 64, 32, f16, softcap=20.0),
    ]


def _write_cases(smoke: bool) -> list[WriteCase]:
    f32, bf16, f16 = DTYPES
    if smoke:
        return [
            WriteCase(13, 2, 64, 16, f32, f32, torch.int32),
            WriteCase(9, 3, 256, 32, bf16, bf16, torch.int64),
        ]
    return [
        WriteCase(300, 8, 128, 16, bf16, bf16, torch.int64),
        WriteCase(77, 1, 256, 32, f16, f16, torch.int32),
        WriteCase(129, 3, 64, 16, f32, f32, torch.int64),
        WriteCase(50, 2, 128, 32, f32, bf16, torch.int64),
    ]


def matrix_cases(smoke: bool, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    return [*_special_cases(smoke), *_write_cases(smoke), *_core_cases(smoke, rng)]


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float


def _randn(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def build_batch(case: AttentionCase, device: torch.device, gen: torch.Generator) -> Batch:
    """Fresh random K/V paged through shuffled block tables; every slot no query may read is NaN."""
    bs, kv_heads, dim = case.block_size, case.num_kv_heads, case.head_dim
    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    blocks_needed = [-(-n // bs) for n in seq_lens]
    num_blocks = sum(blocks_needed) + SPARE_BLOCKS
    # Block 0 stays unowned: a kernel must not read slot 0 as harmless padding.
    order = (1 + torch.randperm(num_blocks - 1, generator=gen, device=device)).to(torch.int32)
    width = -(-(max(blocks_needed) + 1) // TABLE_ALIGN) * TABLE_ALIGN
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32, device=device)
    shape = (num_blocks, bs, kv_heads, dim)
    k_cache, v_cache = _randn(shape, case.dtype, device, gen), _randn(shape, case.dtype, device, gen)
    owned = torch.zeros(num_blocks, dtype=torch.bool, device=device)
    start = 0
    for s, (n, q_len) in enumerate(zip(seq_lens, case.query_lens)):
        blocks = order[start : start + blocks_needed[s]]
        start += blocks_needed[s]
        block_tables[s, : len(blocks)] = blocks
        owned[blocks.long()] = True
        last = int(blocks[-1])
        if n % bs:
            k_cache[last, n % bs :] = float("nan")
            v_cache[last, n % bs :] = float("nan")
        if case.window:
            hidden = max(0, n - q_len + 1 - case.window) // bs  # blocks before the earliest query's window
            k_cache[blocks[:hidden].long()] = float("nan")
            v_cache[blocks[:hidden].long()] = float("nan")
    k_cache[~owned] = float("nan")
    v_cache[~owned] = float("nan")
    starts = [0, *itertools.accumulate(case.query_lens)]
    q = _randn((starts[-1], kv_heads * case.group, dim), case.dtype, device, gen)
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        scale=1.3 / dim**0.5,  # not 1/sqrt(d): a kernel ignoring the given scale fails
    )


@dataclass
class Matrix:
    """The exactness run's state: where the reference runs, and every case's record."""

    ctx: Context
    triton: ModuleType
    reference: ModuleType
    ref_device: torch.device
    ref_note: str = ""
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def attention_reference(self, case: AttentionCase, batch: Batch) -> torch.Tensor:
        """reference.paged_attention in float64; on the CPU where it cannot run on the device (noted once)."""
        while True:
            dev = self.ref_device
            try:
                return self.reference.paged_attention(
                    batch.q.to(dev, torch.float64),
                    batch.k_cache.to(dev, torch.float64),
                    batch.v_cache.to(dev, torch.float64),
                    batch.block_tables.to(dev),
                    batch.seq_lens.to(dev),
                    batch.query_start_loc.to(dev),
                    batch.scale,
                    window=case.window,
                    softcap=case.softcap,
                ).to(batch.q.device)
            except Exception as e:
                if dev.type == "cpu":
                    raise
                self.ref_note = (
                    f"reference.paged_attention raised on {dev} ({type(e).__name__}: {str(e)[:300]}); "
                    "it ran on the CPU instead"
                )
                self.ctx.log(self.ref_note)
                self.ref_device = torch.device("cpu")

    def run_attention(self, case: AttentionCase, gen: torch.Generator) -> dict[str, Any]:
        batch = build_batch(case, self.ctx.device, gen)
        out = torch.full_like(batch.q, float("nan"))
        hints = {"max_query_len": max(case.query_lens)} if case.query_hint else {}
        result = self.triton.paged_attention(
            batch.q,
            batch.k_cache,
            batch.v_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            batch.scale,
            out=out,
            num_splits=case.num_splits,
            window=case.window,
            softcap=case.softcap,
            **hints,
        )
        if result is not out:
            raise AssertionError("paged_attention did not write into the given out")
        self.ctx.sync()
        ref = self.attention_reference(case, batch)
        err = rel_err(out, ref)
        record = {
            "err": err,
            "passed": err <= THRESHOLDS[case.dtype],
            "unwritten": int(torch.isnan(out).sum()),
        }
        if not record["passed"] and self.ref_device.type != "cpu":
            # Tells a kernel's error from the reference's own on this device.
            cpu = Matrix(self.ctx, self.triton, self.reference, torch.device("cpu"))
            record["err_vs_cpu_reference"] = rel_err(out.cpu(), cpu.attention_reference(case, batch).cpu())
        return record

    def run_write(self, case: WriteCase, gen: torch.Generator) -> dict[str, Any]:
        device = self.ctx.device
        num_blocks = -(-2 * case.num_tokens // case.block_size) + 1
        slots = torch.randperm(num_blocks * case.block_size, generator=gen, device=device)[: case.num_tokens]
        slots[::5] = -1  # padding rows are skipped
        slots = slots.to(case.slot_dtype)
        # key and value as views into one fused projection output, as the model produces them
        qkv = _randn((case.num_tokens, 3 * case.num_kv_heads, case.head_dim), case.dtype, device, gen)
        key, value = qkv[:, case.num_kv_heads : 2 * case.num_kv_heads], qkv[:, 2 * case.num_kv_heads :]
        shape = (num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
        caches = [torch.full(shape, float("nan"), dtype=case.cache_dtype, device=device) for _ in range(4)]
        self.triton.write_kv(key, value, caches[0], caches[1], slots)
        self.ctx.sync()
        self.reference.write_kv(key, value, caches[2], caches[3], slots)
        mismatched = 0
        for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
            same = (got == want) | (torch.isnan(got) & torch.isnan(want))
            mismatched += int((~same).sum())
        written = int(torch.isfinite(caches[0]).sum())
        expected = int((slots >= 0).sum()) * case.num_kv_heads * case.head_dim
        total = 2 * caches[0].numel()
        return {
            "err": mismatched / total,
            "passed": mismatched == 0 and written == expected,
            "written": written,
            "expected_written": expected,
        }

    def run(self, cases: list[Case], stop_at: float) -> None:
        gen = torch.Generator(device=self.ctx.device)
        for i, case in enumerate(cases):
            if time.monotonic() > stop_at:
                self.skipped = [c.name for c in cases[i:]]
                return
            gen.manual_seed(1000 + i)  # fresh inputs per case, reproducible per case
            record: dict[str, Any] = {"name": case.name, "family": case.family, "dtype": _name(case.dtype)}
            t0 = time.perf_counter()
            try:
                if isinstance(case, WriteCase):
                    record |= self.run_write(case, gen)
                else:
                    record |= self.run_attention(case, gen)
            except Exception as e:
                record |= {
                    "err": float("inf"),
                    "passed": False,
                    "error": f"{type(e).__name__}: {e}"[:2000],
                    "traceback": traceback.format_exc()[-3000:],
                }
                self.ctx.log(f"kernels: {case.name} raised {type(e).__name__}: {str(e)[:200]}")
            record["seconds"] = round(
                time.perf_counter() - t0, 4
            )  # the first of a variant includes its compile
            self.records.append(record)


def compiled_kernels(triton_module: ModuleType) -> int | None:
    """Kernels Triton compiled in this process (its per-device caches); None under the interpreter."""
    total = 0
    for fn in (
        triton_module._paged_attention_kernel,
        triton_module._merge_splits_kernel,
        triton_module._write_kv_kernel,
    ):
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        try:
            total += sum(len(entry[0]) for entry in caches.values())
        except (TypeError, IndexError):
            return None
    return total


def predicted_variants(cases: list[Case]) -> int:
    """Distinct kernel variants the cases launch: attention (+ its merge when split), write_kv."""
    keys = set()
    for case in cases:
        keys.add(case.variant())
        if isinstance(case, AttentionCase) and case.num_splits != 1:
            keys.add(("merge", case.dtype, case.head_dim, case.group, case.num_splits))
    return len(keys)


def _fmt(err: float | None) -> str:
    if err is None:
        return "-"
    return "NaN/inf" if not math.isfinite(err) else f"{err:.2e}"


def matrix_markdown(records: list[dict[str, Any]]) -> str:
    families: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        families.setdefault(r["family"], []).append(r)
    rows = []
    for family, recs in families.items():
        worst = {}
        for dtype in DTYPES:
            errs = [r["err"] for r in recs if r["dtype"] == _name(dtype)]
            worst[dtype] = max(errs) if errs else None
        passed = sum(r["passed"] for r in recs)
        verdict = "pass" if passed == len(recs) else "**FAIL**"
        rows.append([family, len(recs), *(_fmt(worst[d]) for d in DTYPES), f"{passed}/{len(recs)} {verdict}"])
    header = ["family", "cases", *(f"max err {_name(d)}" for d in DTYPES), "passed"]
    return table(header, rows)


@dataclass(frozen=True)
class Shape:
    label: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


SHAPES = (Shape("d64 9q/3kv (SmolLM2)", 9, 3, 64), Shape("d128 32q/8kv (8B)", 32, 8, 128))


def copy_bandwidth_gbs(ctx: Context, nbytes: int) -> float:
    """A device-to-device copy: bytes read plus bytes written over its median time."""
    src = torch.randn(nbytes // 4, device=ctx.device)
    dst = torch.empty_like(src)
    ms = median_ms(ctx, lambda: dst.copy_(src), warmup=3, iters=10)
    return 2 * nbytes / ms / 1e6


def _rotating_decode(
    triton_module: ModuleType,
    sets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    q: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
) -> Callable[[], None]:
    """One decode step per call, each over the next cache set, so repeated calls do not read from L2."""
    turn = itertools.count()
    scale = q.shape[-1] ** -0.5

    def step() -> None:
        k_cache, v_cache, tables = sets[next(turn) % len(sets)]
        triton_module.paged_attention(q, k_cache, v_cache, tables, seq_lens, query_start_loc, scale, out=out)

    return step


def graph_step_ms(ctx: Context, step: Callable[[], None], steps: int, iters: int, out: torch.Tensor) -> float:
    """Milliseconds a step from the replays of one CUDA graph of `steps` calls of step (each over the next
    cache set): no host launch time between the kernels, as in the engine's captured decode. out is
    poisoned after the capture, so the replays must be what writes it."""
    side = torch.cuda.Stream(ctx.device)
    side.wait_stream(torch.cuda.current_stream(ctx.device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as torch's capture wants
        for _ in range(steps):
            step()
    torch.cuda.current_stream(ctx.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(steps):
            step()
    try:
        out.fill_(float("nan"))
        ms = median_ms(ctx, graph.replay, warmup=2, iters=iters) / steps
        if not bool(torch.isfinite(out).all()):
            raise AssertionError("decode output from the graph has unwritten (NaN) rows")
        return ms
    finally:
        del graph


def bandwidth(ctx: Context, triton_module: ModuleType, stop_at: float) -> dict[str, Any]:
    """Decode attention's effective GB/s per (shape, sequences, context) against the copy rate."""
    if ctx.smoke:
        cells = [(SHAPES[0], 2, 64)]
        copy_bytes, iters = 8 << 20, 2
    else:
        cells = [(shape, n, c) for shape in SHAPES for n in SEQS for c in CONTEXTS]
        copy_bytes, iters = COPY_BYTES, 20
    copy_gbs, copy_source = ctx.bandwidth_gbs, "the driver's device-to-device copy"
    if copy_gbs is None:
        copy_gbs, copy_source = (
            copy_bandwidth_gbs(ctx, copy_bytes),
            f"a {copy_bytes >> 20} MiB copy measured here",
        )
    results = []
    dtype, bs, size = torch.bfloat16, BANDWIDTH_BLOCK_SIZE, 2
    gen = torch.Generator(device=ctx.device).manual_seed(7)
    for shape, seqs, context in cells:
        cell: dict[str, Any] = {"shape": shape.label, "seqs": seqs, "context": context}
        results.append(cell)
        kv_bytes = seqs * context * shape.num_kv_heads * shape.head_dim * 2 * size
        cell["kv_bytes"] = kv_bytes
        if kv_bytes > MAX_CELL_BYTES:
            cell["skipped"] = f"K/V of {kv_bytes / 2**30:.1f} GiB is over the {MAX_CELL_BYTES >> 30} GiB cap"
            continue
        if time.monotonic() > stop_at:
            cell["skipped"] = "out of time"
            continue
        sets = []
        try:
            num_sets = 1 if ctx.smoke else min(MAX_SETS, max(1, -(-ROTATE_BYTES // kv_bytes)))
            blocks_per_seq = -(-context // bs)
            num_blocks = seqs * blocks_per_seq + 1
            shape_kv = (num_blocks, bs, shape.num_kv_heads, shape.head_dim)
            for _ in range(num_sets):
                tables = (1 + torch.randperm(num_blocks - 1, generator=gen, device=ctx.device)).to(
                    torch.int32
                )
                sets.append(
                    (
                        torch.randn(shape_kv, generator=gen, device=ctx.device, dtype=dtype),
                        torch.randn(shape_kv, generator=gen, device=ctx.device, dtype=dtype),
                        tables.view(seqs, blocks_per_seq),
                    )
                )
            q = torch.randn(
                seqs, shape.num_q_heads, shape.head_dim, generator=gen, device=ctx.device, dtype=dtype
            )
            out = torch.full_like(q, float("nan"))
            seq_lens = torch.full((seqs,), context, dtype=torch.int32, device=ctx.device)
            qsl = torch.arange(seqs + 1, dtype=torch.int32, device=ctx.device)
            step = _rotating_decode(triton_module, sets, q, seq_lens, qsl, out)
            step()
            ctx.sync()
            if not bool(torch.isfinite(out).all()):
                raise AssertionError("decode output has unwritten (NaN) rows")
            ms = median_ms(ctx, step, warmup=3, iters=iters)
            graph_ms = None
            if ctx.cuda:
                steps = num_sets * -(-GRAPH_MIN_STEPS // num_sets)
                try:  # a capture that fails costs the graph columns, not the launch-timed figure
                    graph_ms = graph_step_ms(ctx, step, steps, iters, out)
                except Exception as e:
                    cell["graph_error"] = f"{type(e).__name__}: {e}"[:2000]
                    where = f"{shape.label} {seqs}x{context}"
                    ctx.log(f"kernels: graph timing {where}: {cell['graph_error'][:200]}")
            counted = (
                kv_bytes
                + 2 * q.numel() * size  # q read, out written
                + sets[0][2].numel() * 4  # block tables
                + seq_lens.numel() * 4
                + qsl.numel() * 4
            )
            gbs = counted / ms / 1e6
            cell |= {"sets": num_sets, "ms": ms, "bytes": counted, "gbs": gbs, "fraction": gbs / copy_gbs}
            if graph_ms is not None:
                graph_gbs = counted / graph_ms / 1e6
                cell |= {"graph_ms": graph_ms, "graph_gbs": graph_gbs, "graph_fraction": graph_gbs / copy_gbs}
        except Exception as e:
            cell["error"] = f"{type(e).__name__}: {e}"[:2000]
            ctx.log(f"kernels: bandwidth {shape.label} {seqs}x{context} raised {cell['error'][:200]}")
        finally:
            sets.clear()
            if ctx.cuda:
                torch.cuda.empty_cache()
    return {
        "copy_gbs": copy_gbs,
        "copy_source": copy_source,
        "goal": BANDWIDTH_GOAL,
        "iters": iters,
        "cells": results,
    }


def bandwidth_markdown(bw: dict[str, Any]) -> str:
    """One row a cell: each launch timed alone, then from a graph's replays (the goal is judged on the graph's
    figure where there is one: the engine's decode runs in graphs)."""
    rows = []
    for c in bw["cells"]:
        head = [c["shape"], c["seqs"], c["context"], f"{c['kv_bytes'] / 1e6:.1f}"]
        if "gbs" in c:
            launched = [c["sets"], f"{c['ms']:.3f}", f"{c['gbs']:.0f}", f"{c['fraction']:.0%}"]
            judged = c.get("graph_fraction", c["fraction"])
            mark = "" if judged >= bw["goal"] else " (under goal)"
            if "graph_ms" in c:
                fraction = f"{c['graph_fraction']:.0%}{mark}"
                graphed = [f"{c['graph_ms']:.3f}", f"{c['graph_gbs']:.0f}", fraction]
            else:
                launched[-1] += mark
                graphed = ["-", "-", f"**error** {c['graph_error'][:80]}" if "graph_error" in c else "-"]
            rows.append([*head, *launched, *graphed])
        else:
            note = c.get("skipped") or f"**error** {c.get('error', '')[:120]}"
            rows.append([*head, "-", "-", "-", note, "-", "-", "-"])
    header = ["shape", "seqs", "context", "K/V MB", "sets", "ms", "GB/s", "of copy"]
    header += ["graph ms", "graph GB/s", "of copy (graph)"]
    return table(header, rows)


def run(ctx: Context) -> Part:
    start = time.monotonic()
    try:
        from specserve.kernels import reference, triton_attention
    except ImportError as e:
        return Part("kernels", False, f"Triton kernels not importable: {e}")
    if not ctx.cuda and not triton_attention.interpreted():
        return Part(
            "kernels", False, "Triton kernels need a CUDA device or TRITON_INTERPRET=1 set before import"
        )

    cases = matrix_cases(ctx.smoke)
    variants = predicted_variants(cases)
    matrix = Matrix(ctx, triton_attention, reference, ctx.device)
    matrix_stop = ctx.deadline - BANDWIDTH_SHARE * max(ctx.left(), 0.0)
    matrix.run(cases, matrix_stop)
    matrix_s = time.monotonic() - start
    compiled = compiled_kernels(triton_attention)

    bw_start = time.monotonic()
    try:
        bw = bandwidth(ctx, triton_attention, ctx.deadline)
    except Exception as e:
        bw = {"error": f"{type(e).__name__}: {e}"[:2000], "cells": []}
    bw_s = time.monotonic() - bw_start

    failed = [r for r in matrix.records if not r["passed"]]
    bw_errors = [c for c in bw["cells"] if "error" in c or "graph_error" in c]
    bw_errors += [bw] if "error" in bw else []
    bw_late = [c for c in bw["cells"] if c.get("skipped") == "out of time"]
    ok = not failed and not matrix.skipped and not bw_errors and not bw_late

    thresholds = ", ".join(f"{_name(d)} {t:g}" for d, t in THRESHOLDS.items())
    lines = [
        "Triton (`specserve/kernels/triton_attention.py`) against `reference.paged_attention` / `write_kv`"
        f" on float64-upcast inputs, reference on `{matrix.ref_device}`; kernels on `{ctx.device}`"
        f"{' (Triton interpreter, smoke sizes)' if triton_attention.interpreted() else ''}.",
        f"Bound on ||out - ref|| / ||ref||: {thresholds}; NaN (unwritten, poisoned) never passes. "
        "write_kv must match the reference bit for bit, skipped (negative) slots untouched.",
        f"{len(matrix.records)} cases run in {matrix_s:.1f} s, {len(matrix.records) - len(failed)} passed; "
        f"kernel variants launched: {variants} by the cases' design, "
        f"{compiled if compiled is not None else 'n/a (interpreter)'} compiled by Triton.",
    ]
    if matrix.ref_note:
        lines.append(f"Note: {matrix.ref_note}.")
    lines += ["", matrix_markdown(matrix.records)]
    if failed:
        lines += ["", "Failed cases:", ""]
        lines += [f"- `{r['name']}`: {r.get('error', _fmt(r['err']))[:300]}" for r in failed[:25]]
        if len(failed) > 25:
            lines.append(f"- ... and {len(failed) - 25} more (in the JSON)")
    if matrix.skipped:
        lines += ["", f"Out of time: {len(matrix.skipped)} cases not run (listed in the JSON)."]
    lines += ["", "### Decode bandwidth", ""]
    if "error" in bw:
        lines.append(f"**error**: {bw['error'][:500]}")
    else:
        lines += [
            f"bf16, block size {BANDWIDTH_BLOCK_SIZE}, one query per sequence, split-K as the kernel "
            "chooses; bytes = K/V read (seq_len x kv heads x head_dim x 2 x 2 B) + q + out + block tables + "
            "seq_lens + query_start_loc (split-K partials not counted); median of "
            f"{bw['iters']} {'CUDA-event' if ctx.cuda else 'host-clock'} timings after warm-up, cache sets "
            f"rotating while one set is under {ROTATE_BYTES >> 20} MiB; the graph columns time the replays "
            f"of one CUDA graph of at least {GRAPH_MIN_STEPS} steps (whole turns of the sets), a step each. "
            f"Copy rate {bw['copy_gbs']:.0f} GB/s ({bw['copy_source']}); goal {BANDWIDTH_GOAL:.0%}."
            f" {bw_s:.1f} s.",
            "",
            bandwidth_markdown(bw),
        ]
    if ctx.smoke:
        lines += ["", "Smoke run: tiny sizes, checks the script only; no figure here means anything."]
    data = {
        "cases": matrix.records,
        "skipped_cases": matrix.skipped,
        "reference_device": str(matrix.ref_device),
        "reference_note": matrix.ref_note,
        "thresholds": {_name(d): t for d, t in THRESHOLDS.items()},
        "variants_predicted": variants,
        "kernels_compiled": compiled,
        "matrix_seconds": matrix_s,
        "bandwidth": bw,
        "bandwidth_seconds": bw_s,
    }
    if ctx.cuda:
        torch.cuda.empty_cache()
    return Part("kernels", ok, "\n".join(lines), data)
