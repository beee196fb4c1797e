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

    def predict(self, n: float) -> float:
        if self.s1 == 0:
            return 0.0
        var = self.snn * self.s1 - self.sn * self.sn
        mean_t = self.st / self.s1
        if var <= 1e-9 * max(1.0, self.snn * self.s1):  # one distinct size seen: assume time grows with n
            return mean_t * n / max(self.sn / self.s1, 1.0)
        b = max((self.snt * self.s1 - self.sn * self.st) / var, 0.0)
        a = max(mean_t - b * self.sn / self.s1, 0.0)
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

    def choose_k(self, acceptances: list[float], other_tokens: int) -> int:
        """The k for every auto request this step, given their acceptance rates and the tokens of the
        non-speculating part of the batch (prefill chunks, decodes of requests that do not speculate)."""
        if not acceptances:
            return 0
        if self.target.samples < self.warmup_steps:
            return self.k_max  # measure speculation before judging it
        n = len(acceptances)
        best_k, best_rate = 0, 0.0
        for k in range(self.k_max + 1):
            tokens = other_tokens + n * (1 + k)
            seconds = self.target.predict(tokens) + k * self.draft_step_seconds.predict(n)
            rate = sum(expected_tokens(a, k) for a in acceptances) / max(seconds, 1e-9)
            if rate > best_rate * 1.02 or k == 0:  # a longer k must pay for itself clearly
                best_k, best_rate = k, rate
        return best_k
