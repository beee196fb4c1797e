"""Adaptive speculation length: pick k per step to maximise expected accepted tokens per second.

With per-request acceptance rates a_s (an EWMA of accepted / proposed), k drafts yield
E_s(k) = (1 - a_s^(k+1)) / (1 - a_s) tokens for that request (Leviathan et al.). A step costs one target
forward over all its query tokens plus k draft steps, both measured on this machine: the target's time as
a linear function of the tokens in the forward (fitted online), the proposer's time per draft step. The k in
0..k_max with the best  sum_s E_s(k) / (t_target(tokens(k)) + k * t_draft)  wins (SmartSpec's goodput).
At large batches the target forward is compute-bound, each draft token costs as much as a real one, and
k = 0 wins by itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def expected_tokens(acceptance: float, k: int) -> float:
    a = min(max(acceptance, 0.0), 0.999)
    return (1 - a ** (k + 1)) / (1 - a)


class AdaptivePolicy:
    """Chooses k for the "auto" requests of a step; fixed-k and "off" requests are taken as they ask."""

    def __init__(self, k_max: int, ewma: float = 0.1, warmup_steps: int = 8) -> None:
        self.k_max = k_max
        self.ewma = ewma
        self.warmup_steps = warmup_steps
        self.target = LinearCost()
        self.draft_step_seconds = LinearCost()  # per draft step, as a function of sequences drafted

    def observe_acceptance(self, acceptance_ewma: float, proposed: int, accepted: int) -> float:
        if not proposed:
            return acceptance_ewma
        # Each proposed draft is one observation: a step that tested 8 drafts moves the estimate further
        # than one that tested 1, so a fresh request's optimistic prior gives way after a probe or two.
        weight = 1 - (1 - self.ewma) ** proposed
        return (1 - weight) * acceptance_ewma + weight * (accepted / proposed)

    def choose_ks(self, acceptances: list[float], other_tokens: int) -> list[int]:
        """A k for each auto request this step, given their acceptance rates and the tokens of the
        non-speculating part of the batch (prefill chunks, decodes of requests that do not speculate).

        Request s's j-th draft adds a_s^j expected tokens (it counts only if the j - 1 before it were
        accepted) and costs one more token of the target's forward, b seconds; a step of depth D also costs D
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
        a_t, b_t = self.target.coefficients()
        a_d, b_d = self.draft_step_seconds.coefficients()
        tokens = other_tokens + n
        base_rate = n / max(a_t + b_t * tokens, 1e-9)
        accs = [min(max(a, 1e-6), 0.999) for a in acceptances]
        logs = [math.log(a) for a in accs]
        best_rate, best = base_rate, [0] * n
        for depth in range(1, self.k_max + 1):
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
                seconds = a_t + b_t * (tokens + drafted) + max(ks) * (a_d + b_d * drafting)
                rate = expected / max(seconds, 1e-9)
            if drafted and rate > best_rate:
                best_rate, best = rate, ks
        return best if best_rate > base_rate * 1.02 else [0] * n
