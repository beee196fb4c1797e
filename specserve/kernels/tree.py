"""Tree attention masks for verifying a draft tree in one target forward.

A sequence's new query rows may form a tree instead of a chain: node 0 is the last accepted token and
`parents[i] < i` is node i's parent (parents[0] = -1). Node i's K/V sit at slot context_len + i, its rope
position is context_len + depth(i), and it attends to the whole committed context plus its own ancestors and
itself, never its siblings. The kernels receive the tree per query row, as an ancestor bitmask over the
sequence's new rows (bit j: may attend to new row j) and the row's depth; a sequence without a tree gets
all bits and depth = its row index, which is causal attention, so one layout serves a mixed batch.

A chain (parents[i] = i - 1) is not a tree here: `normalize` turns it into None, so it stays on the kernels'
causal path bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TREE_NODES = 64  # one uint64 ancestor mask per node
ALL_BITS = -1  # every bit set as int64: causal attention for a sequence without a tree


def check_parents(parents: Sequence[int]) -> None:
    """Raises ValueError unless parents is a tree rooted at node 0 in topological order."""
    if not parents or parents[0] != -1:
        raise ValueError("a draft tree's node 0 is its root (parent -1)")
    if len(parents) > MAX_TREE_NODES:
        raise ValueError(f"a draft tree holds at most {MAX_TREE_NODES} nodes, not {len(parents)}")
    for i, p in enumerate(parents[1:], start=1):
        if not 0 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents must precede their children")


def is_chain(parents: Sequence[int]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


def normalize(trees: Sequence[Sequence[int] | None] | None) -> list[list[int] | None] | None:
    """Checked trees with chains dropped to None; None when no sequence has a tree."""
    if trees is None:
        return None
    out: list[list[int] | None] = []
    for parents in trees:
        if parents is not None:
            check_parents(parents)
            if is_chain(parents):
                parents = None
        out.append(None if parents is None else list(parents))
    return out if any(t is not None for t in out) else None


def depths(parents: Sequence[int]) -> list[int]:
    d = [0] * len(parents)
    for i, p in enumerate(parents[1:], start=1):
        d[i] = d[p] + 1
    return d


def ancestor_masks(parents: Sequence[int]) -> list[int]:
    """Per node, the bits of its ancestors and itself (unsigned Python ints below 2**64)."""
    masks = [0] * len(parents)
    for i, p in enumerate(parents):
        masks[i] = (1 << i) | (masks[p] if p >= 0 else 0)
    return masks


def _signed(bits: int) -> int:
    return bits - (1 << 64) if bits >= 1 << 63 else bits


@dataclass(frozen=True)
class TreeRows:
    """Per packed query row: the ancestor mask (int64, the uint64's bits) and the depth (int32)."""

    mask: torch.Tensor  # [num_tokens] int64
    depth: torch.Tensor  # [num_tokens] int32
    seq_ids: list[int]  # the sequences that hold a tree

    def to(self, device: torch.device | str) -> TreeRows:
        return TreeRows(self.mask.to(device), self.depth.to(device), self.seq_ids)


def tree_rows(trees: Sequence[Sequence[int] | None], query_lens: Sequence[int]) -> TreeRows | None:
    """The kernels' per-row layout for a batch; None where no sequence holds a tree (chains included)."""
    norm = normalize(trees)
    if norm is None:
        return None
    if len(norm) != len(query_lens):
        raise ValueError(f"{len(norm)} trees for {len(query_lens)} sequences")
    mask: list[int] = []
    depth: list[int] = []
    seq_ids = []
    for s, (parents, ql) in enumerate(zip(norm, query_lens)):
        if parents is None:
            mask.extend([ALL_BITS] * ql)
            depth.extend(range(ql))
            continue
        if len(parents) != ql:
            raise ValueError(f"sequence {s}: a tree of {len(parents)} nodes over {ql} query rows")
        seq_ids.append(s)
        mask.extend(_signed(m) for m in ancestor_masks(parents))
        depth.extend(depths(parents))
    return TreeRows(torch.tensor(mask, dtype=torch.int64), torch.tensor(depth, dtype=torch.int32), seq_ids)


def visible(
    mask_rows: torch.Tensor,
    depth_rows: torch.Tensor,
    context_len: int,
    kv_pos: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """[q_len, len(kv_pos)] bool: which cache positions each of one sequence's tree rows may attend to.

    kv_pos are absolute cache positions. A context position p is seen by a row at position
    context_len + depth when p > that - window; a new row j is seen when it is an ancestor (or the row
    itself) and, with a window, when its own position context_len + depth(j) is inside it.
    """
    q_len = mask_rows.shape[0]
    j = kv_pos - context_len  # the new row a position holds (negative: the context)
    in_tree = (j >= 0) & (j < q_len)
    jc = j.clamp(0, max(q_len - 1, 0))
    bit = ((mask_rows[:, None] >> jc[None, :]) & 1).bool()
    q_at = context_len + depth_rows.long()[:, None]
    key_at = torch.where(in_tree, context_len + depth_rows.long()[jc], kv_pos)[None, :]
    vis = torch.where(in_tree[None, :], bit, (j < 0)[None, :].expand(q_len, -1))
    if window is not None:
        vis &= key_at > q_at - window
    return vis


def path_slots(
    parents: Sequence[int], path: Sequence[int], block_table: Sequence[int], context_len: int, block_size: int
) -> tuple[list[int], list[int]]:
    """Where the accepted path's K/V is (slot context_len + node) and where it goes (context_len + depth),
    for the nodes that move: `path` is root first, path[d] at depth d. A node's index is never below its
    depth, so moving them in increasing depth never overwrites a node still to move."""
    if not path or path[0] != 0:
        raise ValueError("an accepted path starts at the tree's root")
    for d in range(1, len(path)):
        if parents[path[d]] != path[d - 1]:
            raise ValueError(f"accepted path {list(path)} leaves the tree at depth {d}")

    def slot(pos: int) -> int:
        return block_table[pos // block_size] * block_size + pos % block_size

    moves = [(slot(context_len + node), slot(context_len + d)) for d, node in enumerate(path) if node != d]
    return [src for src, _ in moves], [dst for _, dst in moves]


def move_kv(
    caches: Sequence[tuple[torch.Tensor, torch.Tensor]], src: Sequence[int], dst: Sequence[int]
) -> None:
    """Copies each layer's K/V rows at slots src to slots dst (every layer of a pool: the target's, or the
    EAGLE-3 head's one). The rows are gathered before any is written, so overlapping moves are safe."""
    if not src:
        return
    device = caches[0][0].device
    src_t = torch.tensor(src, dtype=torch.long, device=device)
    dst_t = torch.tensor(dst, dtype=torch.long, device=device)
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, *cache.shape[2:])
            rows.index_copy_(0, dst_t, rows.index_select(0, src_t))
