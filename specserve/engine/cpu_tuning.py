"""CPU tuning: the thread team, OpenMP's wait policy, and the allocator.

Threads. A parallel region (torch's ops and our kernels share one libgomp team) ends when its slowest thread
does, so a team larger than the CPUs the process may really use waits, every region, for a thread the OS has
descheduled. The team is sized to the CPUs of the affinity mask and to the cgroup's CPU quota (what a
Kubernetes CPU limit sets): `CpuBudget.read()`. OMP_NUM_THREADS, where set, is left to rule.

A neighbour that is not a quota (a busy process on one of the cores) leaves the mask and quota as they were
while a team one thread smaller may run faster: `TeamTuner` tries the budget and one fewer now and then and
keeps the size whose steps compute more tokens a second (the engine's `adaptive_threads`).

Waiting. libgomp's threads spin 300,000 times at each barrier before they sleep (milliseconds on a core with a
slow `pause`), unless the team is larger than the affinity mask. With a busy neighbour on the same cores,
that spinning takes the time slice the thread still working needs, and every region stalls.
`default_wait_policy()` lowers the spin before libgomp starts (it reads its environment once, when torch is
imported): `serve`, `worker` and `specserve.LLM` call it first.

Allocator. Every layer allocates and frees K/V gathers and activations of megabytes. glibc serves blocks
that large with fresh mmap()s and returns them on free, so each one page-faults its memory in again: several
ms per layer. Raising the mmap and trim thresholds keeps freed memory in the heap for reuse (what vLLM's CPU
backend gets from preloading tcmalloc). Linux/glibc only; SPECSERVE_KEEP_MALLOC=1 leaves malloc alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_freed_memory() -> bool:
    """Give the pages of freed blocks back to the OS (glibc's malloc_trim): after loading, the transients of
    casting and fusing weights would otherwise stay in the process's RSS."""
    libc = _libc() if sys.platform.startswith("linux") else None
    trim = getattr(libc, "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False


def _set_thresholds(mmap_bytes: int, trim_bytes: int) -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("SPECSERVE_KEEP_MALLOC") == "1":
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_bytes)) and bool(mallopt(M_TRIM_THRESHOLD, trim_bytes))


def return_freed_memory_at_once() -> bool:
    """Called before the model is loaded: every block of 1 MiB or more gets a mapping of its own, returned to
    the OS when freed. Loading frees a tensor for each fused or cast copy it makes; with glibc's adaptive
    threshold those blocks stayed in the heap, and building the demo model's layers in bf16 added 78 MiB
    of such garbage to the load's peak (25 MiB with this)."""
    return _set_thresholds(1 << 20, 1 << 20)


def keep_freed_memory_in_heap() -> bool:
    """Called after the model is loaded: a load's transients are freed for good, a step's are reused."""
    # glibc caps the mmap threshold at 32 MiB on 64-bit (HEAP_MAX/2); larger blocks still come from mmap.
    return _set_thresholds(32 << 20, 1 << 30)


# ---------------------------------------------------------------- the thread team


@dataclass(frozen=True)
class CpuBudget:
    """The CPUs this process may use: its affinity mask and the cgroup's quota in cores (None: no quota)."""

    affinity: int
    quota: float | None = None

    @classmethod
    def read(cls, root: Path = Path("/"), affinity: int | None = None) -> CpuBudget:
        """This process's budget; `root` is where /proc and /sys/fs/cgroup are found (tests point it at a
        fake tree, and pass `affinity`)."""
        if affinity is None:
            affinity = (
                len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            )
        return cls(affinity, cgroup_cpu_quota(root))

    @property
    def cores(self) -> float:
        return min(float(self.affinity), self.quota) if self.quota is not None else float(self.affinity)

    @property
    def threads(self) -> int:
        """The team: the quota rounded half up, at least one thread, at most one per CPU of the mask.

        A quota throttles the whole cgroup at once when it runs out, so a team rounded up does not straggle
        against itself: its threads are stopped together, and meanwhile it used the fraction a team rounded
        down leaves idle (1.5 cores: two threads get 1.5 cores' work done per period, one thread 1.0). Below
        half a core over, the fraction is left to the process's other threads (the API, tokenizing)."""
        if self.quota is None:
            return max(1, self.affinity)
        return max(1, min(self.affinity, math.floor(self.quota + 0.5)))

    def describe(self) -> str:
        quota = "no CPU quota" if self.quota is None else f"a CPU quota of {self.quota:g} cores"
        return f"{self.affinity} CPUs in the affinity mask, {quota}"


def _quota_v2(directory: Path) -> float | None:
    """cpu.max: "$MAX $PERIOD", where $MAX is "max" when unlimited."""
    fields = (directory / "cpu.max").read_text().split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def _quota_v1(directory: Path) -> float | None:
    """cpu.cfs_quota_us ("-1" when unlimited) over cpu.cfs_period_us."""
    quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
    period = int((directory / "cpu.cfs_period_us").read_text().strip())
    return quota / period if quota > 0 and period > 0 else None


def _levels(mount: Path, cgroup_path: str) -> list[Path]:
    """The process's cgroup directory and each one above it up to the mount, those that exist. Inside a
    container the path /proc shows may name directories the container's mount does not have (its root is
    the container's own group): those are skipped, the mount's root is still read."""
    parts = [p for p in cgroup_path.strip().split("/") if p]
    levels = [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in levels if d.is_dir()]


def cgroup_cpu_quota(root: Path = Path("/")) -> float | None:
    """The tightest CPU quota, in cores, over the process's cgroup and its ancestors, cgroup v2 (cpu.max)
    and v1 (cpu.cfs_quota_us / cpu.cfs_period_us) both; None when there is none or nothing can be read."""
    try:
        membership = (root / "proc/self/cgroup").read_text().splitlines()
        mounts = (root / "proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in membership:
        hierarchy = line.split(":", 2)
        if len(hierarchy) != 3:
            continue
        _, controllers, path = hierarchy
        for mount_line in mounts:
            fields = mount_line.split()
            if len(fields) < 4:
                continue
            if controllers == "" and fields[2] == "cgroup2":
                version = 2
            elif "cpu" in controllers.split(",") and fields[2] == "cgroup" and "cpu" in fields[3].split(","):
                version = 1
            else:
                continue
            for directory in _levels(root / fields[1].lstrip("/"), path):
                try:
                    quota = _quota_v2(directory) if version == 2 else _quota_v1(directory)
                except (OSError, ValueError):  # a level without the files, or junk in them: no quota there
                    continue
                if quota is not None:
                    quotas.append(quota)
    return min(quotas) if quotas else None


def size_thread_team(budget: CpuBudget | None = None, ranks: int = 1) -> int:
    """Set torch's (and so our kernels') team to the budget, split over `ranks` processes sharing it; an
    OMP_NUM_THREADS the operator set is left as it is. Returns the team size in force."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        threads = max(1, torch.get_num_threads() // ranks) if ranks > 1 else torch.get_num_threads()
    else:
        budget = budget or CpuBudget.read()
        threads = max(1, budget.threads // ranks)
        log.info("CPU threads: %d (%s)", threads, budget.describe())
    torch.set_num_threads(threads)
    return threads


# libgomp spins this many times at a barrier before it sleeps on a futex: its own count for a team it knows
# to be larger than its CPUs, which on a shared node it cannot know. About 50 us with a slow `pause`: the
# gaps between the regions of a step (microseconds) are still spun over, a thread waiting longer waits for
# a descheduled one and hands it the core. The smoke run of bench/contention.py (AMX Xeon, 2 cores, a
# machine at load ~17, indicative only), 4 requests x 8 tokens beside a busy loop: 32.7 s with libgomp's
# default, 16.0 s at GOMP_SPINCOUNT=10000, 2.9 s with OMP_WAIT_POLICY=passive. README's `LLM` example on
# the same loaded machine, 8 prompts x 32 tokens in float32: 136 s (OMP_WAIT_POLICY=active), 152 s (300,000
# spins, libgomp's default) and 11 s, 8 s (this count, run second and last).
SPIN_COUNT = 1_000


def default_wait_policy(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set GOMP_SPINCOUNT to SPIN_COUNT unless the operator chose a wait policy (OMP_WAIT_POLICY or
    GOMP_SPINCOUNT). True when it was set in time: libgomp reads its environment when torch loads it."""
    environ = os.environ if environ is None else environ
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return "torch" not in sys.modules


# ---------------------------------------------------------------- the team size, by trial


@dataclass(frozen=True)
class TrialPlan:
    """How TeamTuner tries the other team size: `warmup` steps after each change are not counted (the first
    products after a change rebuild oneDNN's primitives and the team), `measured` steps are; the other size
    must run `margin` faster to be taken; between trials the chosen size holds for `first_hold` steps,
    doubled (up to `max_hold`) each time a trial keeps the choice, so a quiet machine pays for ever rarer
    trials. A trial whose two sizes ran steps of different sizes (mean tokens a step apart by more than
    `comparable`, a prefill wave beside decode steps) decides nothing."""

    warmup: int = 1
    measured: int = 3
    margin: float = 0.05
    first_hold: int = 64
    max_hold: int = 1024
    comparable: float = 0.75


@dataclass
class _Tally:
    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class TeamTuner:
    """Picks the team size among {budget, budget - 1} by what steps measure: a busy neighbour on one of
    the cores makes each parallel region of a full team wait for the descheduled thread, and a team one
    smaller may then run faster. Each trial runs the other size, then the chosen one again, for
    `plan.warmup + plan.measured` steps each, and compares their tokens per second.

    Pure decision logic: the engine reports each step's tokens and seconds to `observe` and sets the team it
    returns; `size` is the team the next step should run."""

    def __init__(self, budget: int, plan: TrialPlan = TrialPlan()) -> None:
        if budget < 2:
            raise ValueError(f"a team of {budget} has no smaller size to try")
        self.plan = plan
        self.budget = budget
        self.chosen = budget
        self.size = budget
        self.trials = 0
        self._hold = plan.first_hold
        self._countdown = plan.first_hold
        self._schedule: list[tuple[int, bool]] = []  # (team size, counted) of the trial's steps to come
        self._tallies: dict[int, _Tally] = {}

    def _other(self) -> int:
        return self.budget - 1 if self.chosen == self.budget else self.budget

    def _start_trial(self) -> None:
        self._tallies = {self._other(): _Tally(), self.chosen: _Tally()}
        self._schedule = [
            (size, i >= self.plan.warmup)
            for size in (self._other(), self.chosen)
            for i in range(self.plan.warmup + self.plan.measured)
        ]

    def _decide(self) -> None:
        self.trials += 1
        mine, other = self._tallies[self.chosen], self._tallies[self._other()]
        per_step = sorted((mine.tokens_per_step, other.tokens_per_step))
        comparable = per_step[1] > 0 and per_step[0] / per_step[1] >= self.plan.comparable
        if comparable and other.rate > mine.rate * (1 + self.plan.margin):
            log.info(
                "CPU threads: %d -> %d (%.0f against %.0f tok/s a step)",
                self.chosen,
                self._other(),
                other.rate,
                mine.rate,
            )
            self.chosen = self._other()
            self._hold = self.plan.first_hold
        elif comparable:
            self._hold = min(2 * self._hold, self.plan.max_hold)
        self._countdown = self._hold
        self.size = self.chosen

    def observe(self, tokens: int, seconds: float) -> int:
        """The step just run, at team `size`, computed `tokens` in `seconds`; the team for the next step."""
        if self._schedule:
            size, counted = self._schedule.pop(0)
            if counted:
                self._tallies[size].add(tokens, seconds)
            if self._schedule:
                self.size = self._schedule[0][0]
            else:
                self._decide()
            return self.size
        self._countdown -= 1
        if self._countdown <= 0:
            self._start_trial()
            self.size = self._schedule[0][0]
        return self.size


def team_tuner(threads: int, wanted: bool) -> TeamTuner | None:
    """A tuner for the team of `threads` in force, where one should run: asked for, a team of more than one
    thread, and none fixed by an OMP_NUM_THREADS the operator set."""
    if not wanted or threads < 2 or os.environ.get("OMP_NUM_THREADS"):
        return None
    return TeamTuner(threads)
