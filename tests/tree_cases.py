"""Hand-made draft trees and a float64 dense-mask oracle for tree attention, shared by the torch reference,
C++ and Triton tests.

The oracle builds each row's boolean mask by walking its parents (no bitmasks), then runs plain softmax
attention: node i sees the committed context and its ancestors and itself; with a window, a node at position
context + depth(i) sees positions (its own - window, its own], an ancestor j at context + depth(j).
"""

from __future__ import annotations

import torch
from kernel_cases import PagedBatch

TREES: dict[str, list[int]] = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0, 0],
    "binary3": [-1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6],
    "uneven": [-1, 0, 0, 1, 3, 3, 2, 6, 0, 4],
    # deeper than a short query: the reference's prefill-chunk path
    "wide40": [-1] + [(i - 1) // 3 for i in range(1, 40)],
    "full64": [-1] + [i - 1 if i % 5 else i // 2 for i in range(1, 64)],
}

# (trees per sequence, context lengths): every tree beside decodes, a prefill chunk and a chain
LAYOUTS = [
    (["binary3", None, "star", "uneven"], [40, 7, 3, 100]),
    (["chain", "uneven", None], [17, 64, 250]),
    (["wide40", None, "star"], [9, 33, 0]),
    (["full64", "binary3"], [130, 1]),
]
PREFILL = 21  # query length of the layouts' None entries after the first (a chunk over a context)


def query_lens(names: list[str | None]) -> list[int]:
    lens = []
    for n, name in enumerate(names):
        lens.append(len(TREES[name]) if name else (1 if n == 1 else PREFILL))
    return lens


def parents_of(names: list[str | None]) -> list[list[int] | None]:
    return [list(TREES[name]) if name else None for name in names]


def _ancestors(parents: list[int], i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def dense_tree_attention(
    batch: PagedBatch,
    trees: list[list[int] | None],
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    outs = []
    starts = batch.query_start_loc.tolist()
    for s, (k, v) in enumerate(zip(batch.keys, batch.values)):
        q = batch.q[starts[s] : starts[s + 1]].double()
        q_len, seq_len = q.shape[0], k.shape[0]
        ctx = seq_len - q_len
        parents = trees[s] if trees[s] is not None else [i - 1 for i in range(q_len)]
        depth = [len(_ancestors(parents, i)) - 1 for i in range(q_len)]
        visible = torch.zeros(q_len, seq_len, dtype=torch.bool)
        for i in range(q_len):
            at = ctx + depth[i]
            visible[i, :ctx] = True if window is None else torch.arange(ctx) > at - window
            for j in _ancestors(parents, i):
                visible[i, ctx + j] = window is None or ctx + depth[j] > at - window
        group = q.shape[1] // k.shape[1]
        k = k.double().repeat_interleave(group, dim=1)
        v = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)
