"""Speculative decoding as the engine uses it: choose k, propose, verify, learn.

Per step: lookahead(running) from the scheduler (k per decoding sequence; no side effects), propose(plan)
before the target forward (one DraftBatch), verify() on the target's logits, update(plan, accepted) after
the scheduler has applied the step, record_step(plan, accepted, seconds) with the whole step's time (the
guard on whether drafting pays at its load). Each request's acceptance estimate lives here, keyed by seq_id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from specserve.engine.penalties import adjust_logits, adjusts
from specserve.engine.sampler import RowParams
from specserve.engine.sampling_params import InvalidParameter
from specserve.engine.sequence import Sequence
from specserve.engine.step import Accepted, DraftBatch, SchedulerOutput
from specserve.spec.policy import ACCEPTANCE_PRIOR, AdaptivePolicy, DraftCalibration, SpeculationGuard
from specserve.spec.proposer import Draft, Proposer
from specserve.spec.suffix import FleetTree, SuffixProposer
from specserve.spec.verifier import VerifyBatch, VerifyResult, verify

if TYPE_CHECKING:
    from specserve.engine.structured import StructuredOutputs

# Per idle step, a request's acceptance estimate drifts back toward the prior, so speculation is retried when
# the text may have become predictable. Every retry that accepts nothing halves that drift (down to
# 1 / 2**MAX_BACKOFF of it): with a useless proposer, retries grow rare and cost next to nothing.
RELAX = 0.02
MAX_BACKOFF = 6
# A new request starts from the workload's acceptance, an EWMA over every verified draft (this weight each),
# not from the optimistic prior: under `vllm bench serve` (random prompts, temperature 1) every request
# spent ~12 drafts at 7 % acceptance proving the prior wrong, the cost of speculation there (README).
# The prior stays the target that idle requests relax toward, so copying ones in such a mix still probe.
WORKLOAD_EWMA = 0.02


def check_speculation(speculation: str | int, methods: Seq[str] | None) -> None:
    """A request naming a method its engine does not draft with (`methods`; None: no speculation) is
    refused, not served by another proposer or none."""
    if isinstance(speculation, str) and speculation not in ("auto", "off", *(methods or ())):
        held = (
            "does not speculate" if methods is None else f"drafts with {', '.join(map(repr, methods))} only"
        )
        raise InvalidParameter("speculation", f"method {speculation!r} is not available: this worker {held}")


@dataclass
class _Estimate:
    acceptance: float  # EWMA of accepted / proposed drafts
    failed_probes: int = 0  # speculation steps in a row that accepted nothing (slows the next re-probe)


@dataclass
class _SeqState(_Estimate):
    method: str = ""  # the proposer drafting for it; acceptance and failed_probes are that proposer's
    # the other proposers' estimates, as they were when they last drafted for it
    shelved: dict[str, _Estimate] = field(default_factory=dict)


class SpeculativeDecoder:
    """`proposer`: one, or several by method name (the first drafts unless a request's acceptance says
    another does better, or the request names one)."""

    def __init__(
        self,
        proposer: Proposer | dict[str, Proposer],
        num_speculative_tokens: int,
        max_model_len: int,
        method: str = "",
    ) -> None:
        self.proposers = dict(proposer) if isinstance(proposer, dict) else {method: proposer}
        self.methods = tuple(self.proposers)  # a request may name one as its `speculation`
        self.proposer = self.proposers[self.methods[0]]
        self.k_max = num_speculative_tokens
        self.max_model_len = max_model_len
        self.policy = AdaptivePolicy(num_speculative_tokens)
        self.calibration = DraftCalibration()
        self.guard = SpeculationGuard()
        # the last lookahead's (decoding sequences, whether its auto requests could draft), for record_step
        self._step: tuple[int, bool] | None = None
        # the proposers whose drafts are priced token by token (_price): an "auto" request drafting with one
        # of them drafts with each every step and verifies the draft worth most (_choose)
        self.priced_methods = tuple(
            m for m, p in self.proposers.items() if getattr(p, "priced_drafts", False)
        )
        # this step's priced drafts (see _price), for update to learn from: sampled requests' verified
        # drafts, seq_id -> (method, greedy, match_len); greedy requests' drafts of every priced proposer,
        # whole, seq_id -> [((method, greedy, match_len), tokens)], scored against the tokens the target chose
        self._priced: dict[int, tuple[str, bool, int]] = {}
        self._scored: dict[int, list[tuple[tuple[str, bool, int], list[int]]]] = {}
        # this step's drafts of the priced proposers an "auto" request did not verify (_choose)
        self._unchosen: dict[int, dict[str, Draft]] = {}
        self._state: dict[int, _SeqState] = {}
        self.num_proposed = 0  # totals over the engine's life
        self.num_accepted = 0
        # the same by the method that proposed them: method -> [proposed, accepted]
        self.by_method: dict[str, list[int]] = {m: [0, 0] for m in self.methods}
        # a new request's starting estimate, per method
        self.workload_acceptance = dict.fromkeys(self.methods, ACCEPTANCE_PRIOR)
        # a proposer that reads the target's hidden states (EAGLE-3): the layers the forward captures
        self._capturing = {m: p for m, p in self.proposers.items() if getattr(p, "aux_layers", ())}
        self.capture_layers: tuple[int, ...] = next((p.aux_layers for p in self._capturing.values()), ())

    # ---- scheduling ------------------------------------------------------------------------------------

    def _cap(self, seq: Sequence, k: int) -> int:
        """No drafts past max_model_len, nor past max_tokens (the bonus token counts too)."""
        room = min(
            self.max_model_len - seq.num_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        return max(0, min(k, room))

    def is_auto(self, seq: Sequence) -> bool:
        mode = seq.params.speculation
        return mode == "auto" or (bool(mode) and mode in self.methods)

    def acceptance(self, seq_id: int) -> float:
        state = self._state.get(seq_id)
        return self.workload_acceptance[self.methods[0]] if state is None else state.acceptance

    def _seq_state(self, seq: Sequence) -> _SeqState:
        state = self._state.get(seq.seq_id)
        if state is None:
            first = self.methods[0]
            state = self._state[seq.seq_id] = _SeqState(self.workload_acceptance[first], method=first)
        return state

    def _pick(self, seq: Sequence, costs: dict[str, list[float] | None]) -> None:
        """The proposer to draft for an "auto" request: the one it names, else the one that makes it the most
        tokens per second at its acceptance for it (AdaptivePolicy.method_rate, `costs` read once this step);
        by acceptance alone until the target's cost is measured. A method the request has not drafted with
        is judged at `_untried`'s estimate, one it has at its own estimate for it."""
        state = self._seq_state(seq)
        named = seq.params.speculation
        choosing = self._chooses_drafts(seq, state)
        if named in self.proposers:
            best = named
        else:
            best, best_value = state.method, self._value(state.acceptance, state.method, costs)
            for method in self.methods:
                if method == state.method or (choosing and method in self.priced_methods):
                    continue  # between priced proposers, each step's drafts decide (_choose)
                shelved = state.shelved.get(method)
                acceptance = self._untried(state, method) if shelved is None else shelved.acceptance
                value = self._value(acceptance, method, costs)
                if value > best_value:
                    best, best_value = method, value
        if best != state.method:
            self._switch(state, best)

    def _switch(self, state: _SeqState, method: str) -> None:
        """The request drafts with `method` from now: its estimate for the method it leaves is shelved."""
        state.shelved[state.method] = _Estimate(state.acceptance, state.failed_probes)
        taken = state.shelved.pop(method, None) or _Estimate(self._untried(state, method))
        state.method, state.acceptance, state.failed_probes = method, taken.acceptance, taken.failed_probes

    def _chooses_drafts(self, seq: Sequence, state: _SeqState) -> bool:
        """Whether this request drafts with every priced proposer each step and verifies the best draft
        (_choose): an "auto" one (not one naming its method) that drafts with a priced proposer now."""
        return (
            len(self.priced_methods) > 1
            and seq.params.speculation == "auto"
            and state.method in self.priced_methods
        )

    def _untried(self, state: _SeqState, method: str) -> float:
        """A request's acceptance with a method it has not drafted with: that method's workload acceptance,
        scaled by how the request fares against the workload with the method it drafts with now. Both
        proposers copy from the same text, so a request that copies badly with one is likely to with the
        other; judged at the other's workload mean instead, a request whose estimate had fallen was put back
        at the mean on switching, and the policy priced its drafts at the better of two estimates. A fresh
        request is at the workload's estimate, so it starts at the workload's for each method."""
        current = self.workload_acceptance[state.method]
        relative = state.acceptance / current if current > 0 else 1.0
        return min(self.workload_acceptance[method] * relative, 0.999)

    def _value(self, acceptance: float, method: str, costs: dict[str, list[float] | None]) -> float:
        method_costs = costs[method]
        if method_costs is None:
            return acceptance
        return self.policy.method_rate(acceptance, method, method_costs) or 0.0

    def lookahead(self, running: list[Sequence]) -> dict[int, int]:
        """k per decoding sequence this step: fixed-k requests as asked, "auto" ones by the policy where the
        guard lets them draft at this load (SpeculationGuard), else 0."""
        ks: dict[int, int] = {}
        auto: list[Sequence] = []
        other_tokens = 0
        decoding = sum(1 for seq in running if seq.in_decode)
        speculating = self.guard.speculates(decoding)
        self._step = (decoding, speculating)
        costs: dict[str, list[float] | None] = {}
        if len(self.methods) > 1:
            costs = {m: self.policy.method_costs(m) for m in self.methods}
        for seq in running:
            mode = seq.params.speculation
            if not seq.in_decode:
                other_tokens += seq.num_tokens - seq.num_computed_tokens
            elif self.is_auto(seq):
                if len(self.methods) > 1:
                    self._pick(seq, costs)
                auto.append(seq)
            elif mode != "off" and mode:
                ks[seq.seq_id] = self._cap(seq, min(int(mode), self.k_max))
            else:
                other_tokens += 1
        if auto:
            if speculating:
                chosen = self.policy.choose_ks([self._lookahead_acceptance(s) for s in auto], other_tokens)
            else:
                chosen = [0] * len(auto)
            for seq, k in zip(auto, chosen):
                ks[seq.seq_id] = self._cap(seq, k)
        return ks

    def _priced_method(self, seq: Sequence) -> str | None:
        """The method drafting for an "auto" request if its drafts are priced token by token (_price)."""
        state = self._state.get(seq.seq_id)
        method = self.methods[0] if state is None else state.method
        return method if getattr(self.proposers[method], "priced_drafts", False) else None

    def _lookahead_acceptance(self, seq: Sequence) -> float:
        """The acceptance choose_ks sizes an auto request's lookahead by: its own estimate, or where its
        drafts are priced later (_price), what the method's best drafts are worth, so that a long match
        finds room and the pricing cuts the rest."""
        method = self._priced_method(seq)
        if method is None:
            return self.acceptance(seq.seq_id)
        greedy = seq.params.greedy
        if self._chooses_drafts(seq, self._seq_state(seq)):
            return max(self.calibration.best(m, greedy) for m in self.priced_methods)
        return self.calibration.best(method, greedy)

    def fleet_tree(self) -> FleetTree | None:
        """Where other workers' finished outputs go for drafting (service/suffix_fleet.py feeds it): the
        suffix proposer's, if this decoder holds one that keeps a shared tree."""
        for proposer in self.proposers.values():
            if isinstance(proposer, SuffixProposer):
                return proposer.fleet_tree()
        return None

    # ---- the target's hidden states --------------------------------------------------------------------

    def wants_capture(self, seq: Sequence) -> bool:
        """Whether the forward captures this sequence's hidden states: every token of a request that may
        draft with a capturing proposer, since its head must see each position the target computes."""
        mode = seq.params.speculation
        if not self._capturing or mode == "off" or mode == 0:
            return False
        if isinstance(mode, str) and mode in self.proposers:
            return mode in self._capturing
        return True

    def capture(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        """The states the forward captured of `seq`'s positions [start, start + len(aux))."""
        for proposer in self._capturing.values():
            proposer.capture(seq, start, aux)  # type: ignore[attr-defined]

    # ---- the step --------------------------------------------------------------------------------------

    def propose(self, plan: SchedulerOutput, grammar: StructuredOutputs | None = None) -> DraftBatch | None:
        # what update learns from is this step's alone: a step without drafts must not score the last one's
        self._priced.clear()
        self._scored.clear()
        self._unchosen.clear()
        requests = [(s.seq, s.num_lookahead) for s in plan.scheduled if s.num_lookahead and s.samples]
        if not requests:
            return None
        t0 = time.perf_counter()
        if len(self.methods) == 1:
            drafts = self.proposer.propose(requests)
        else:
            by_method: dict[str, list[tuple[Sequence, int]]] = {}
            choosing: list[Sequence] = []
            for seq, k in requests:
                state = self._seq_state(seq)
                if self._chooses_drafts(seq, state):
                    choosing.append(seq)
                    for method in self.priced_methods:
                        by_method.setdefault(method, []).append((seq, k))
                else:
                    by_method.setdefault(state.method, []).append((seq, k))
            options: dict[int, dict[str, Draft]] = {}
            for method, group in by_method.items():
                started = time.perf_counter()
                for seq_id, draft in self.proposers[method].propose(group).items():
                    options.setdefault(seq_id, {})[method] = draft
                depth = max(k for _, k in group)
                self.policy.observe_draft(method, len(group), (time.perf_counter() - started) / depth)
            drafts = {seq_id: next(iter(by.values())) for seq_id, by in options.items() if len(by) == 1}
            if choosing:
                row_price = self.policy.row_price(
                    sum(s.num_tokens for s in plan.scheduled), sum(s.samples for s in plan.scheduled)
                )
                for seq in choosing:
                    drafts[seq.seq_id] = self._choose(seq, options.get(seq.seq_id, {}), row_price)
        for seq, _ in requests:
            # rows whose logits depend on the tokens before them (penalties) or whose grammar cuts drafts
            # verify the tree's best chain: a chain's context is its preceding drafts, a node's its ancestors
            draft = drafts.get(seq.seq_id)
            if draft is not None and draft.parents is not None:
                if adjusts(seq.params) or (grammar is not None and grammar.constrained(seq)):
                    drafts[seq.seq_id] = draft.best_chain()
        if grammar is not None:
            drafts = self._grammar_drafts(grammar, requests, drafts)
        self._price(plan, drafts)
        k = max(k for _, k in requests)
        self.policy.draft_step_seconds.observe(len(requests), (time.perf_counter() - t0) / k)
        token_ids: list[int] = []
        cu = [0]
        parents: list[tuple[int, ...] | None] = []
        for s in plan.scheduled:
            draft = drafts.get(s.seq.seq_id) if s.num_lookahead and s.samples else None
            tree = None
            if draft is not None:
                token_ids.extend(draft.token_ids)
                if draft.parents is not None and draft.token_ids:
                    tree = tuple(draft.parents)
            parents.append(tree)
            cu.append(len(token_ids))
        if not token_ids:  # nothing found to propose: the step samples as a plain one (no verify rows)
            return None
        has_tree = any(p is not None for p in parents)
        return DraftBatch(tuple(token_ids), tuple(cu), tuple(parents) if has_tree else None)

    def _choose(self, seq: Sequence, options: dict[str, Draft], row_price: float) -> Draft:
        """Of the priced proposers' drafts for `seq`, the one its best prefix is worth most for: the
        calibrated chances of its tokens, less what a verify row costs in tokens (`row_price`), summed up to
        where that sum peaks. On a tie the proposer drafting for it now keeps it. The others are kept
        for update to learn from (greedy requests)."""
        state = self._seq_state(seq)
        greedy = seq.params.greedy
        best, best_value = state.method, -1.0
        for method, draft in options.items():
            if not draft.token_ids or not draft.match_len or draft.parents is not None:
                continue
            value = total = 0.0
            for p in self.calibration.probabilities(method, greedy, draft.match_len, len(draft.token_ids)):
                total += p - row_price
                value = max(value, total)
            if value > best_value or (value == best_value and method == state.method):
                best, best_value = method, value
        if best != state.method:
            self._switch(state, best)
        self._unchosen[seq.seq_id] = {m: d for m, d in options.items() if m != best}
        return options.get(best) or Draft([])

    def _price(self, plan: SchedulerOutput, drafts: dict[int, Draft]) -> None:
        """Cut "auto" requests' chains from proposers that say their match length (suffix, n-gram) to the
        tokens that pay for their verify rows: each token's chance from DraftCalibration, the step's cost
        from the target's measured cost by token count (AdaptivePolicy.prune)."""
        priced: list[tuple[int, tuple[str, bool, int]]] = []
        probabilities: list[list[float]] = []
        base_tokens = sampling = 0
        for s in plan.scheduled:
            base_tokens += s.num_tokens
            sampling += s.samples
            draft = drafts.get(s.seq.seq_id) if s.num_lookahead and s.samples else None
            if draft is None or not draft.token_ids:
                continue
            method = self._priced_method(s.seq) if self.is_auto(s.seq) else None
            if method is None or not draft.match_len or draft.parents is not None:
                base_tokens += len(draft.token_ids)
                continue
            greedy = s.seq.params.greedy
            key = (method, greedy, draft.match_len)
            priced.append((s.seq.seq_id, key))
            probabilities.append(self.calibration.probabilities(*key, len(draft.token_ids)))
            if greedy:
                # whole, and the drafts not chosen too: a greedy target's tokens say how far each would
                # have been accepted, so a cut token is still learned from
                scored = [(key, draft.token_ids)]
                for other, unchosen in self._unchosen.get(s.seq.seq_id, {}).items():
                    if unchosen.token_ids and unchosen.match_len and unchosen.parents is None:
                        scored.append(((other, True, unchosen.match_len), unchosen.token_ids))
                self._scored[s.seq.seq_id] = scored
        if not priced:
            return
        self.calibration.tick()
        for (seq_id, key), kept in zip(priced, self.policy.prune(probabilities, base_tokens, sampling)):
            draft = drafts[seq_id]
            if kept < len(draft.token_ids):
                drafts[seq_id] = Draft(draft.token_ids[:kept], match_len=draft.match_len)
            if kept and not key[1]:
                self._priced[seq_id] = key

    def _grammar_drafts(
        self, grammar: StructuredOutputs, requests: list[tuple[Sequence, int]], drafts: dict[int, Draft]
    ) -> dict[int, Draft]:
        """Constrained sequences' drafts end at the first token their grammar forbids; a stateless proposer's
        (n-gram) are then extended with the grammar's forced text. A draft model's are only cut: its cache
        holds its own proposals, so tokens it did not propose must not be verified in their place."""
        out = dict(drafts)
        for seq, k in requests:
            if grammar.constrained(seq):
                extend = getattr(self._proposer_of(seq), "stateless", False)
                draft = drafts.get(seq.seq_id) or Draft([])
                out[seq.seq_id] = Draft(grammar.draft(seq, draft.token_ids, k, extend))
        return out

    def record_forward(self, num_tokens: int, seconds: float) -> None:
        self.policy.target.observe(num_tokens, seconds)

    def verify(
        self,
        plan: SchedulerOutput,
        drafts: DraftBatch,
        logits: torch.Tensor,
        eos_token_ids: Seq[int] = (),
    ) -> list[Accepted]:
        """Accepted drafts + the next token per sampling sequence, in plan order (mid-prompt chunks are
        skipped); logits hold 1 + its number of drafts rows per sampling sequence."""
        rows_of = [i for i, s in enumerate(plan.scheduled) if s.samples]
        seqs = [plan.scheduled[i].seq for i in rows_of]
        counts = [drafts.num_drafts(i) for i in rows_of]
        k = max(counts)
        vocab = logits.shape[-1]
        count_t = torch.tensor(counts)
        # Position j of row s is packed row index[s, j]; padding positions repeat a real one.
        starts = (count_t + 1).cumsum(0) - count_t - 1
        offsets = torch.arange(k + 1)[None, :].clamp(max=count_t[:, None])
        index = (starts[:, None] + offsets).clamp(max=logits.shape[0] - 1)
        is_draft = torch.arange(k)[None, :] < count_t[:, None]
        draft_tokens = torch.zeros(len(seqs), k, dtype=torch.long)
        draft_tokens[is_draft] = torch.tensor(drafts.token_ids, dtype=torch.long)  # flat, row-major
        rows = RowParams.build([s.params for s in seqs], [s.seed for s in seqs], vocab)
        first = [s.num_tokens for s in seqs]
        trees = None if drafts.parents is None else [drafts.tree(i) for i in rows_of]
        parents = None
        if trees is not None:  # chains beside trees verify as trees of one branch; padding rows -1
            parents = torch.full((len(seqs), k + 1), -1, dtype=torch.long)
            for row, (tree, n) in enumerate(zip(trees, counts)):
                parents[row, : n + 1] = torch.tensor(tree if tree is not None else range(-1, n))
        if any(adjusts(s.params) for s in seqs):
            # penalties and biases at each position count the drafts before it (engine/penalties.py)
            target_logits = adjust_logits(logits[index], seqs, draft_tokens, eos_token_ids)
            batch = VerifyBatch(target_logits, draft_tokens, count_t, rows, first, parents=parents)
        else:
            batch = VerifyBatch(logits, draft_tokens, count_t, rows, first, index, parents)
        result = verify(batch)
        if trees is not None:
            return self._tree_accepted(result, trees, draft_tokens.tolist(), counts)
        num_accepted = result.num_accepted.tolist()
        next_token = result.next_token.tolist()
        draft_rows = draft_tokens.tolist()
        return [
            Accepted((*draft_rows[row][:a], t), a, n)
            for row, (a, t, n) in enumerate(zip(num_accepted, next_token, counts))
        ]

    @staticmethod
    def _tree_accepted(
        result: VerifyResult, trees: list[tuple[int, ...] | None], drafts: list[list[int]], counts: list[int]
    ) -> list[Accepted]:
        out = []
        for row, (tree, last, token, n) in enumerate(
            zip(trees, result.last_node.tolist(), result.next_token.tolist(), counts)
        ):
            path = [last]
            parents = tree if tree is not None else range(-1, n)
            while parents[path[-1]] >= 0:
                path.append(parents[path[-1]])
            path.reverse()
            tokens = (*(drafts[row][node - 1] for node in path[1:]), token)
            out.append(Accepted(tokens, len(path) - 1, n, path=tuple(path) if tree is not None else None))
        return out

    def tree_accepted(self, seq: Sequence, path: tuple[int, ...]) -> None:
        """A tree's accepted path: its verify rows' captured states move to the positions the path's
        tokens now hold."""
        for proposer in self._capturing.values():
            proposer.tree_accepted(seq, path)  # type: ignore[attr-defined]

    def update(self, plan: SchedulerOutput, accepted: Seq[Accepted]) -> None:
        """Learn from a step the scheduler and the output processor have applied: totals, acceptance
        estimates, the proposer's state. Finished sequences are forgotten."""
        for s, acc in zip(plan.scheduled, accepted):
            seq = s.seq
            self.num_proposed += acc.num_draft_tokens
            self.num_accepted += acc.num_accepted_drafts
            for key, draft in self._scored.get(seq.seq_id, ()):
                self._score(key, draft, acc.token_ids)
            if acc.num_draft_tokens:
                self._count(seq, acc.num_draft_tokens, acc.num_accepted_drafts)
                key = self._priced.get(seq.seq_id)
                if key is not None:
                    self.calibration.observe(*key, acc.num_draft_tokens, acc.num_accepted_drafts)
            if seq.is_finished:
                self.forget(seq)
            elif acc.num_draft_tokens:
                self.observe(seq, acc.num_draft_tokens, acc.num_accepted_drafts)
            elif s.num_tokens == 1 and not s.num_lookahead and self.is_auto(seq):
                self.observe(seq, 0, 0)
        self._priced.clear()
        self._scored.clear()

    def record_step(self, plan: SchedulerOutput, accepted: Seq[Accepted], seconds: float) -> None:
        """A whole step's seconds (schedule to update), for the guard on whether auto requests draft at its
        load: what it made, under the choice its lookahead followed."""
        if self._step is None:
            return
        decoding, speculated = self._step
        self._step = None
        if not any(self.is_auto(s.seq) for s in plan.scheduled):
            return  # the choice changed nothing this step
        tokens = sum(len(a.token_ids) for s, a in zip(plan.scheduled, accepted) if s.samples)
        measured = all(s.num_tokens == 1 for s in plan.scheduled)
        self.guard.observe(decoding, speculated, tokens, seconds, measured)

    def _score(self, key: tuple[str, bool, int], draft: list[int], emitted: Seq[int]) -> None:
        """What a greedy request's draft would have had accepted, verified whole: as many tokens as it
        shares with the tokens the target chose (its accepted drafts, then its own token). A draft that
        agrees with all of them is known to be right that far and no further."""
        n = min(len(draft), len(emitted))
        agree = 0
        while agree < n and draft[agree] == emitted[agree]:
            agree += 1
        self.calibration.observe(*key, n if agree == n else len(draft), agree)

    def _count(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A verified draft's tokens, for the engine's and the request's counters of the method that
        proposed them (grammar-forced tokens count under the method whose draft they extend)."""
        state = self._state.get(seq.seq_id)
        method = self.methods[0] if state is None else state.method
        for counts in (self.by_method[method], seq.draft_by_method.setdefault(method, [0, 0])):
            counts[0] += num_proposed
            counts[1] += num_accepted

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """A decode step of an "auto" or fixed-k sequence: its drafts' fate, or (0, 0) for a step that
        did not speculate, which relaxes the estimate toward the prior."""
        state = self._seq_state(seq)
        if num_proposed:
            state.acceptance = self.policy.observe_acceptance(state.acceptance, num_proposed, num_accepted)
            weight = 1 - (1 - WORKLOAD_EWMA) ** num_proposed
            workload = self.workload_acceptance
            workload[state.method] += weight * (num_accepted / num_proposed - workload[state.method])
            state.failed_probes = 0 if num_accepted else state.failed_probes + 1
            self.proposers[state.method].accepted(seq, num_proposed, num_accepted)
        else:
            relax = RELAX / 2 ** min(state.failed_probes, MAX_BACKOFF)
            state.acceptance += relax * (ACCEPTANCE_PRIOR - state.acceptance)

    def _proposer_of(self, seq: Sequence) -> Proposer:
        state = self._state.get(seq.seq_id)
        return self.proposer if state is None else self.proposers[state.method]

    def forget(self, seq: Sequence) -> None:
        """The sequence finished: drop everything kept for it (every proposer learns from its output)."""
        self._state.pop(seq.seq_id, None)
        for proposer in self.proposers.values():
            proposer.forget(seq)

    def preempted(self, seqs: Iterable[Sequence]) -> None:
        """Their KV is gone, so is the draft cache's; what was learnt of their acceptance still holds."""
        for seq in seqs:
            for proposer in self.proposers.values():
                proposer.forget(seq)
