"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, reference counts.

It knows block ids and token counts only: no text, no models, no scheduling. A sequence's table holds
exactly ceil(num_slots / block_size) blocks, where num_slots is the largest token count it has asked room
for (its tokens plus any speculative lookahead). Shrinking (rollback of rejected draft tokens, preemption)
frees every whole block past the new count at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class BlockPool:
    """Free list plus reference counts; a block returns to the free list when its count drops to zero."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        block = self._free.popleft()
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.append(block)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[Hashable, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """Blocks `ensure(seq_id, num_tokens)` would take from the pool."""
        have = len(self.tables.get(seq_id, ()))
        return max(0, self.blocks_for(num_tokens) - have)

    def ensure(self, seq_id: Hashable, num_tokens: int) -> bool:
        """Make room for `num_tokens` tokens (allocating the table on first use). All or nothing."""
        need = self.blocks_needed(seq_id, num_tokens)
        if need > self.pool.num_free:
            return False
        table = self.tables.setdefault(seq_id, [])
        for _ in range(need):
            table.append(self.pool.allocate())
        return True

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep room for the first `num_tokens` tokens only; free every whole block past them."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self.pool.decref(table.pop())

    def free(self, seq_id: Hashable) -> None:
        for block in self.tables.pop(seq_id, ()):
            self.pool.decref(block)

    def fork(self, src: Hashable, dst: Hashable) -> None:
        """Share src's blocks with a new sequence (prefix sharing); copy-on-write is the caller's affair."""
        assert dst not in self.tables, f"{dst!r} already has blocks"
        table = list(self.tables[src])
        for block in table:
            self.pool.incref(block)
        self.tables[dst] = table

    def block_table(self, seq_id: Hashable) -> list[int]:
        return self.tables.get(seq_id, [])

    def check_invariants(self) -> None:
        """free + used == total, ref counts equal table membership, no block both free and owned."""
        owners = [0] * self.pool.num_blocks
        for table in self.tables.values():
            for block in table:
                owners[block] += 1
        free = set(self.pool._free)
        assert len(free) == self.pool.num_free, "a block is on the free list twice"
        for block in range(self.pool.num_blocks):
            assert owners[block] == self.pool.ref_counts[block], f"block {block}: refs != owners"
            assert (block in free) == (owners[block] == 0), f"block {block}: free/owned mismatch"
        assert len(free) + sum(1 for n in owners if n) == self.pool.num_blocks
