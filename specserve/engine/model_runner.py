"""Runs one forward over a batch of sequences on a paged KV cache and returns the logits asked for.

Used for the target model and, with its own cache and block manager, for a draft model: it knows token
ids, positions and block tables, nothing of requests or scheduling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.kernels import tree as tree_mask
from specserve.models.llama import AttentionInputs, Capture, LlamaModel

if TYPE_CHECKING:
    from specserve.engine.cuda_graphs import CudaGraphs


@dataclass
class ForwardEntry:
    """One sequence's share of a forward pass."""

    token_ids: list[int]  # tokens whose K/V this step computes (chunk, decode token, or token + drafts)
    start_pos: int  # position of token_ids[0]
    block_table: list[int]
    num_logits: int  # logits wanted for the last num_logits tokens (0 for a prefill chunk mid-prompt)
    capture: bool = False  # run_capturing hands back every token's hidden states at the layers it names
    # A draft tree over token_ids (kernels/tree.py: parents, node 0 the last accepted token): token i's K/V
    # goes to slot start_pos + i, its rope position is start_pos + depth(i), and it attends to its ancestors.
    tree: list[int] | None = None


def max_position(entries: list[ForwardEntry]) -> int:
    """The step's largest position, known on the host (the model would otherwise read it off the device).
    A tree's rows sit at or before its last slot, so the slots bound the positions."""
    return max((e.start_pos + len(e.token_ids) for e in entries), default=0) - 1


def wanted_rows(hidden: torch.Tensor, logit_rows: torch.Tensor) -> torch.Tensor:
    """The rows of `hidden` whose logits were asked for. They are increasing, so as many as there are rows
    means all of them (a decode step's): the gather, another parallel region and a copy, is skipped."""
    return hidden if logit_rows.shape[0] == hidden.shape[0] else hidden[logit_rows]


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)
        self.backend = model.backend
        self.graphs: CudaGraphs | None = None  # the target's, where the engine captured them

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def prepare(
        self, entries: list[ForwardEntry]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionInputs, torch.Tensor]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logit_rows: list[int] = []
        for e in entries:
            n = len(e.token_ids)
            end = e.start_pos + n
            base = len(input_ids)
            input_ids.extend(e.token_ids)
            if e.tree is None:
                positions.extend(range(e.start_pos, end))
            else:
                positions.extend(e.start_pos + d for d in tree_mask.depths(e.tree))
            slots.extend(self._slots(e.block_table, e.start_pos, end))
            seq_lens.append(end)
            query_lens.append(n)
            logit_rows.extend(range(base + n - e.num_logits, base + n))
        tables = [e.block_table for e in entries]
        qsl = [0]
        for n in query_lens:
            qsl.append(qsl[-1] + n)
        plan = None
        window_plans: dict[int, object] = {}
        trees = tree_mask.normalize([e.tree for e in entries])
        tree_kw = {} if trees is None else {"trees": trees}
        tree_rows = None
        if self.backend.build_plan is not None:
            plan = self.backend.build_plan(tables, seq_lens, query_lens, self.block_size, **tree_kw)
            # sliding-window layers (Gemma 3, Mistral) read plans of their own; none for most models
            for w in self.model.windows:
                window_plans[w] = self.backend.build_plan(
                    tables, seq_lens, query_lens, self.block_size, window=w, **tree_kw
                )
            block_tables = torch.empty(0, dtype=torch.int32)  # the plan carries what the kernel reads
        else:
            width = max(len(t) for t in tables)
            block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
            if trees is not None:  # a kernel without plans (Triton) reads the rows from AttentionInputs
                tree_rows = tree_mask.tree_rows(trees, query_lens)
        device = self.model.device
        attn = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            block_tables=block_tables.to(device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            plan=plan,
            window_plans=window_plans,
            trees=None if tree_rows is None else tree_rows.to(device),
        )
        return (
            torch.tensor(input_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            attn,
            torch.tensor(logit_rows, dtype=torch.long, device=device),
        )

    def forward(self, entries: list[ForwardEntry]) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of every token of the step, and the rows whose logits were asked for."""
        input_ids, positions, attn, logit_rows = self.prepare(entries)
        top = max_position(entries)
        return self.model.forward(input_ids, positions, self.kv_caches, attn, top), logit_rows

    def run(self, entries: list[ForwardEntry]) -> torch.Tensor:
        """Float32 logits [sum(num_logits), vocab], rows in entry order."""
        if self.graphs is not None:
            logits = self.graphs.run(entries)
            if logits is not None:
                return logits
        hidden, logit_rows = self.forward(entries)
        return self.model.logits(wanted_rows(hidden, logit_rows)).cpu()

    def run_capturing(
        self, entries: list[ForwardEntry], layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """run's logits, and the hidden states entering `layers` (models/llama.py: Capture) of every token of
        the entries marked `capture`, [their tokens, len(layers) * hidden] in entry order."""
        input_ids, positions, attn, logit_rows = self.prepare(entries)
        rows: list[int] = []
        base = 0
        for e in entries:
            if e.capture:
                rows.extend(range(base, base + len(e.token_ids)))
            base += len(e.token_ids)
        capture = Capture(layers, torch.tensor(rows, dtype=torch.long, device=self.model.device))
        hidden, aux = self.model.forward_capturing(
            input_ids, positions, self.kv_caches, attn, capture, max_position(entries)
        )
        return self.model.logits(wanted_rows(hidden, logit_rows)).cpu(), aux

    def close(self) -> None:
        """Nothing to release here; a tensor-parallel runner stops its other ranks (engine/parallel.py)."""
