"""Adaptive speculation length: pick k per step to maximise expected accepted tokens per second.

With per-request acceptance rates a_s (an EWMA of accepted / proposed), k drafts yield
E_s(k) = (1 - a_s^(k+1)) / (1 - a_s) tokens for that request (Leviathan et al.). A step costs one target
forward over all its query tokens plus k draft steps, both measured on this machine: the target's time as
a linear function of the tokens in the forward (fitted online), the proposer's time per draft step. The k in
0..k_max with the best  sum_s E_s(k) / (t_target(tokens(k)) + k * t_draft)  wins (SmartSpec's goodput).
At large batches the target forward is compute-bound, each draft token costs as much as a real one, and
k = 0 wins by itself.

A forward's cost need not be linear in its tokens: a quantized model's int kernels have one form for steps of
up to 8 rows (quant.KERNEL_MAX_ROWS) and another for larger ones (then a dense copy), so on the 2-core AVX2
EPYC (demo GGUF as int4, loaded machine) a verify step of 8 requests x (1 + 4 drafts) took 2.1-2.9 s against
0.7-0.8 s for a plain 8-row step, which a straight line through both underestimates for every depth in
between. Steps are therefore priced from what each token count has cost (StepCost); the line only ranks drafts
and fills gaps.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

# A request's acceptance rate before any of its drafts were verified: optimistic, so that speculation is
# tried before it is judged.
ACCEPTANCE_PRIOR = 0.7


@dataclass
class LinearCost:
    """t(n) = a + b * n, fitted by exponentially-forgetting least squares over (n, seconds) samples."""

    decay: float = 0.98
    s1: float = 0.0
    sn: float = 0.0
    snn: float = 0.0
    st: float = 0.0
    snt: float = 0.0

    def observe(self, n: float, seconds: float) -> None:
        d = self.decay
        self.s1 = d * self.s1 + 1
        self.sn = d * self.sn + n
        self.snn = d * self.snn + n * n
        self.st = d * self.st + seconds
        self.snt = d * self.snt + n * seconds

    @property
    def samples(self) -> float:
        return self.s1

    def coefficients(self) -> tuple[float, float]:
        """(a, b) of t(n) = a + b * n."""
        if self.s1 == 0:
            return 0.0, 0.0
        var = self.snn * self.s1 - self.sn * self.sn
        mean_t = self.st / self.s1
        if var <= 1e-9 * max(1.0, self.snn * self.s1):  # one distinct size seen: assume time grows with n
            return 0.0, mean_t / max(self.sn / self.s1, 1.0)
        b = max((self.snt * self.s1 - self.sn * self.st) / var, 0.0)
        return max(mean_t - b * self.sn / self.s1, 0.0), b

    def predict(self, n: float) -> float:
        a, b = self.coefficients()
        return a + b * n


class StepCost:
    """A target forward's seconds by its query tokens: an EWMA per token count seen, read between counts by
    straight interpolation and past them along the linear fit's slope (LinearCost alone where nothing is
    seen). Holds a jump in cost between two counts (the int kernels' row limit) that one line cannot."""

    def __init__(self, weight: float = 0.2, max_counts: int = 1024) -> None:
        self.linear = LinearCost()
        self.weight = weight
        self.max_counts = max_counts
        self.by_count: dict[int, float] = {}
        self._counts: list[int] = []  # sorted keys of by_count

    def observe(self, n: int, seconds: float) -> None:
        self.linear.observe(n, seconds)
        prev = self.by_count.get(n)
        if prev is not None:
            self.by_count[n] = prev + self.weight * (seconds - prev)
        elif len(self.by_count) < self.max_counts:
            self.by_count[n] = seconds
            bisect.insort(self._counts, n)

    @property
    def samples(self) -> float:
        return self.linear.samples

    def coefficients(self) -> tuple[float, float]:
        return self.linear.coefficients()

    def predict(self, n: int) -> float:
        seen = self.by_count.get(n)
        if seen is not None:
            return seen
        counts = self._counts
        if not counts:
            return self.linear.predict(n)
        i = bisect.bisect_left(counts, n)
        slope = self.linear.coefficients()[1]
        if i == len(counts):  # past the largest count seen
            return self.by_count[counts[-1]] + slope * (n - counts[-1])
        if i == 0:
            return max(self.by_count[counts[0]] - slope * (counts[0] - n), 0.0)
        lo, hi = counts[i - 1], counts[i]
        t_lo, t_hi = self.by_count[lo], self.by_count[hi]
        return t_lo + (t_hi - t_lo) * (n - lo) / (hi - lo)


# Draft places and match lengths DraftCalibration tells apart; later places and longer matches share the last.
CALIBRATED_PLACES = 8
CALIBRATED_MATCHES = 16
# What a place's counts weigh halves every this many steps, so a bucket whose drafts are cut for a long time
# is assumed fair again and re-probed (the workload may have changed), and old evidence gives way to new.
CALIBRATION_HALF_LIFE = 2000
# The weight, in drafts, of the rate a place is assumed to have before it is seen (the place before it has).
CALIBRATION_PRIOR = 2.0


class DraftCalibration:
    """How often a draft token is accepted, given that the tokens before it were, by the proposer, whether
    the request samples greedily, the length of the context its draft continues (Draft.match_len: a suffix
    tree's or n-gram's match) and its place in the draft. One acceptance a request, raised to a power per
    place, prices every draft of that request alike: on agentic traffic a suffix tree's one-token matches
    were accepted 27 % of the time and its matches of 8 or more 95 % at every place (a simulation of the
    proposer over bench/suffix_traffic.py's greedy outputs), so a request's mean says little about the draft
    in hand. A place not seen yet is assumed to be as good as the one before it (the first:
    ACCEPTANCE_PRIOR), which its first few drafts then correct."""

    def __init__(self, half_life: int = CALIBRATION_HALF_LIFE) -> None:
        self.half_life = half_life
        self.steps = 0  # tick()s so far: the clock the counts decay by
        # (method, greedy, match bucket, place) -> [tokens that reached the place, of them accepted, as of
        # step]
        self.counts: dict[tuple[str, bool, int, int], list[float]] = {}
        self._best: dict[tuple[str, bool], float] = {}  # best()'s answers until the counts or clock move

    def tick(self) -> None:
        """A step with drafts to price went by."""
        self.steps += 1
        self._best.clear()

    def _seen(self, key: tuple[str, bool, int, int]) -> tuple[float, float] | None:
        seen = self.counts.get(key)
        if seen is None:
            return None
        weight = 0.5 ** ((self.steps - seen[2]) / self.half_life)
        return seen[0] * weight, seen[1] * weight

    def probabilities(self, method: str, greedy: bool, match_len: int, n: int) -> list[float]:
        """P(draft tokens 0..j all accepted), for j < n."""
        bucket = min(match_len, CALIBRATED_MATCHES)
        out: list[float] = []
        rate, reach = ACCEPTANCE_PRIOR, 1.0
        for place in range(n):
            if place < CALIBRATED_PLACES:
                seen = self._seen((method, greedy, bucket, place))
                if seen is not None:
                    rate = (seen[1] + CALIBRATION_PRIOR * rate) / (seen[0] + CALIBRATION_PRIOR)
            reach *= rate
            out.append(reach)
        return out

    def observe(self, method: str, greedy: bool, match_len: int, proposed: int, accepted: int) -> None:
        bucket = min(match_len, CALIBRATED_MATCHES)
        for place in range(min(accepted + 1, proposed, CALIBRATED_PLACES)):
            key = (method, greedy, bucket, place)
            reached, kept = self._seen(key) or (0.0, 0.0)
            # the last place stands for every later one: all of theirs that were verified count there
            last = place == CALIBRATED_PLACES - 1
            more = min(accepted + 1, proposed) - place if last else 1
            good = max(min(accepted, proposed) - place, 0) if last else int(place < accepted)
            self.counts[key] = [reached + more, kept + good, self.steps]
        self._best.clear()

    def best(self, method: str, greedy: bool) -> float:
        """An acceptance no draft of this method is expected to beat at its first place: the highest of the
        match lengths' (ACCEPTANCE_PRIOR at least, as some match length is always unseen or forgotten), for
        sizing a request's lookahead; pricing cuts the drafts that do not reach it. Asked for every auto
        request each step, it walks the counts once between changes."""
        best = self._best.get((method, greedy))
        if best is None:
            best = ACCEPTANCE_PRIOR
            for key in self.counts:
                if key[0] == method and key[1] == greedy and key[3] == 0:
                    reached, kept = self._seen(key) or (0.0, 0.0)
                    prior = CALIBRATION_PRIOR * ACCEPTANCE_PRIOR
                    best = max(best, (kept + prior) / (reached + CALIBRATION_PRIOR))
            self._best[(method, greedy)] = best
        return best


# The guard's probes of the choice it is not following: every this many of a load's steps at first, twice as
# far apart each time one agrees with the choice, up to GUARD_PROBE_MOST.
GUARD_PROBE_FIRST = 8
GUARD_PROBE_MOST = 64
# Steps measured of both choices before either is preferred, and what an older step weighs against the next.
GUARD_MIN_STEPS = 4
GUARD_DECAY = 0.94


@dataclass
class _Rate:
    """Tokens made over the seconds they took, summed over a choice's steps with older ones decayed."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Load:
    speculate: bool = True  # the choice this load's steps follow
    since_probe: int = 0  # steps since the last probe of the other choice
    interval: int = GUARD_PROBE_FIRST
    on: _Rate = field(default_factory=_Rate)
    off: _Rate = field(default_factory=_Rate)


class SpeculationGuard:
    """Whether `auto` requests draft at all at a load, by what whole steps made, not by what the policy
    predicted they would: per load (decoding sequences, in octaves), the tokens per second of decode steps
    that speculated against those of steps that did not, each timed whole (proposing, verifying and the
    bookkeeping of drafts included). Speculation goes on while it makes more; a step now and then runs the
    other way to keep both measured (GUARD_PROBE_FIRST, GUARD_PROBE_MOST). The policy prices a draft by the
    forward's cost alone and by calibrated chances that start optimistic, and proposing, verifying and their
    bookkeeping took 2.7 ms more of a 40 ms step than a plain one: at 32 in flight `auto` made 0.84-0.93x
    speculation off's tok/s (`python bench/spec_mix.py --requests 9,24,48 --max-tokens 96`, Zen 4, bf16).
    `auto` must never cost against off."""

    def __init__(self, decay: float = GUARD_DECAY) -> None:
        self.decay = decay
        self.loads: dict[int, _Load] = {}

    @staticmethod
    def _key(decoding: int) -> int:
        return max(decoding, 1).bit_length()

    def speculates(self, decoding: int) -> bool:
        """Whether a step of `decoding` decoding sequences lets its auto requests draft."""
        load = self.loads.get(self._key(decoding))
        if load is None:
            return True
        return load.speculate != (load.since_probe >= load.interval)

    def observe(self, decoding: int, speculated: bool, tokens: int, seconds: float, measured: bool) -> None:
        """A step went by that speculates()'s answer `speculated` ran: `tokens` it made in `seconds`, whole.
        Steps that also computed prompt chunks are not `measured` (their time is mostly the prompt's)."""
        load = self.loads.setdefault(self._key(decoding), _Load())
        probe = speculated != load.speculate
        load.since_probe = 0 if probe else load.since_probe + 1
        if not measured:
            return
        (load.on if speculated else load.off).add(tokens, seconds, self.decay)
        if load.on.steps < GUARD_MIN_STEPS or load.off.steps < GUARD_MIN_STEPS:
            return
        better = load.on.rate >= load.off.rate
        if better != load.speculate:
            load.speculate, load.interval = better, GUARD_PROBE_FIRST
        elif probe:
            load.interval = min(2 * load.interval, GUARD_PROBE_MOST)


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class AdaptivePolicy:
    """Chooses k for the "auto" requests of a step; fixed-k and "off" requests are taken as they ask."""

    def __init__(self, k_max: int, ewma: float = 0.1, warmup_steps: int = 8) -> None:
        self.k_max = k_max
        self.ewma = ewma
        self.warmup_steps = warmup_steps
        self.target = StepCost()
        self.draft_step_seconds = LinearCost()  # per draft step, as a function of sequences drafted
        # the same, per proposer: what choosing one for a request costs (method_rate)
        self.method_seconds: dict[str, LinearCost] = {}

    def observe_draft(self, method: str, sequences: int, seconds_per_step: float) -> None:
        self.method_seconds.setdefault(method, LinearCost()).observe(sequences, seconds_per_step)

    def method_costs(self, method: str) -> list[float] | None:
        """Seconds of a step in which one decoding sequence drafts k tokens with `method`, for k in 0..k_max:
        t(1 + k) + k x its draft step's cost for one sequence, t the target's measured step cost. None before
        the target's cost has been measured (warm-up). The same for every request of a step, so `auto`
        prices them once a step, not once per request and method."""
        if self.target.samples < self.warmup_steps:
            return None
        drafting = self.method_seconds.get(method)
        a_d, b_d = drafting.coefficients() if drafting is not None else (0.0, 0.0)
        per_draft = a_d + b_d
        return [max(self.target.predict(1 + k) + k * per_draft, 1e-9) for k in range(self.k_max + 1)]

    def method_rate(self, acceptance: float, method: str, costs: list[float] | None = None) -> float | None:
        """The tokens per second one decoding sequence makes drafting with `method` at its best k (0 too):
        max over k of E(a, k) / method_costs(method)[k] (`costs`: those, already read this step). A proposer
        as accurate as another but dearer ranks below it, and one whose drafts cost more than they save
        ranks level with not drafting. None before the target's cost has been measured (warm-up): then only
        acceptances can rank methods."""
        if costs is None:
            costs = self.method_costs(method)
            if costs is None:
                return None
        # E(a, k) = 1 + a + ... + a^k, summed as k grows: `auto` asks this for every request and method each
        # step, and the closed form's call per k was ~60 % of its lookahead's time at 32 in flight
        # (cProfile of bench/spec_mix.py's mix with k held at 0, 2-core AVX2 EPYC, float32)
        a = min(max(acceptance, 0.0), 0.999)
        best, expected, term = 0.0, 0.0, 1.0
        for seconds in costs:
            expected += term
            term *= a
            best = max(best, expected / seconds)
        return best

    def observe_acceptance(self, acceptance_ewma: float, proposed: int, accepted: int) -> float:
        if not proposed:
            return acceptance_ewma
        # Each proposed draft is one observation: a step that tested 8 drafts moves the estimate further
        # than one that tested 1, so a fresh request's optimistic prior gives way after a probe or two.
        weight = 1 - (1 - self.ewma) ** proposed
        return (1 - weight) * acceptance_ewma + weight * (accepted / proposed)

    def row_price(self, base_tokens: int, sampling: int) -> float:
        """The tokens a step of `base_tokens` that samples for `sampling` sequences forgoes by verifying one
        more row: its rate times the row's measured cost (0 before the target's cost is measured)."""
        if self.target.samples < self.warmup_steps:
            return 0.0
        seconds = self.target.predict(base_tokens)
        return sampling / max(seconds, 1e-9) * max(self.target.predict(base_tokens + 1) - seconds, 0.0)

    def prune(self, probabilities: list[list[float]], base_tokens: int, sampling: int) -> list[int]:
        """How many of each draft's tokens a step verifies: the choice with the most expected tokens per
        second of the step's measured cost. probabilities[s]: draft s's tokens' P(accepted with all before
        it), non-increasing; base_tokens: the step's tokens besides these drafts; sampling: the sequences
        it samples a token for. Draft tokens are taken most likely first (within a draft, in order, so each
        keeps a prefix) and the best count of them wins; none unless that beats no drafts by 2 %, as in
        choose_ks. Before the target's cost is measured (warm-up) every draft is kept whole."""
        if self.target.samples < self.warmup_steps:
            return [len(p) for p in probabilities]
        ranked = sorted(
            ((p, place, s) for s, draft in enumerate(probabilities) for place, p in enumerate(draft)),
            key=lambda t: (-t[0], t[1]),
        )
        predict = self.target.predict
        base_rate = sampling / max(predict(base_tokens), 1e-9)
        best_rate, best_count, expected = base_rate * 1.02, 0, float(sampling)
        for count, (p, _, _) in enumerate(ranked, 1):
            expected += p
            rate = expected / max(predict(base_tokens + count), 1e-9)
            if rate > best_rate:
                best_rate, best_count = rate, count
        kept = [0] * len(probabilities)
        for _, _, s in ranked[:best_count]:
            kept[s] += 1
        return kept

    def choose_ks(self, acceptances: list[float], other_tokens: int) -> list[int]:
        """A k for each auto request this step, given their acceptance rates and the tokens of the
        non-speculating part of the batch (prefill chunks, decodes of requests that do not speculate).

        Request s's j-th draft adds a_s^j expected tokens (it counts only if the j - 1 before it were
        accepted) and costs one more token of the target's forward, b seconds (the slope of the step's cost
        from no drafts to D for every request); a step of depth D also costs D
        draft steps over the requests drafting. A draft pays while a_s^j > rate x b, the tokens the step
        would make in that time: so each request drafts up to its own j, a rarely-accepted one nothing and a
        copying one up to D. For each D that rate is found by two rounds of a fixed point, and the best D
        wins. One k for the whole batch let a few fresh, optimistic requests buy every request's drafts at 8
        and 32 in flight (-2-8 % tok/s in bench/chat_traffic.py, README). Speculation must beat not
        speculating by 2 % to be used at all."""
        n = len(acceptances)
        if not n:
            return []
        if self.target.samples < self.warmup_steps:
            return [self.k_max] * n  # measure speculation before judging it
        a_d, b_d = self.draft_step_seconds.coefficients()
        tokens = other_tokens + n
        t_base = self.target.predict(tokens)
        base_rate = n / max(t_base, 1e-9)
        accs = [min(max(a, 1e-6), 0.999) for a in acceptances]
        logs = [math.log(a) for a in accs]
        best_rate, best = base_rate, [0] * n
        for depth in range(1, self.k_max + 1):
            # a draft token's cost: the cost curve's slope up to every request drafting `depth` (a jump in
            # cost on the way, the int kernels' row limit, is spread over the tokens that cross it)
            b_t = max((self.target.predict(tokens + n * depth) - t_base) / (n * depth), 0.0)
            rate = base_rate
            for _ in range(2):
                threshold = rate * b_t
                if threshold >= 1.0:
                    ks = [0] * n  # not even a sure draft pays for its slot
                elif threshold <= 0.0:
                    ks = [depth] * n
                else:
                    cut = math.log(threshold)
                    ks = [min(depth, int(cut / la)) for la in logs]
                drafted = sum(ks)
                if not drafted:
                    break
                expected = n + sum(a * (1 - a**k) / (1 - a) for a, k in zip(accs, ks) if k)
                drafting = sum(1 for k in ks if k)
                seconds = self.target.predict(tokens + drafted) + max(ks) * (a_d + b_d * drafting)
                rate = expected / max(seconds, 1e-9)
            if drafted and rate > best_rate:
                best_rate, best = rate, ks
        return best if best_rate > base_rate * 1.02 else [0] * n
