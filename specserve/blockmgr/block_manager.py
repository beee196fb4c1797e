"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, reference counts.

It knows block ids and token counts only: no text, no models, no scheduling. A sequence's table holds
exactly ceil(num_slots / block_size) blocks, where num_slots is the largest token count it has asked room
for (its tokens plus any speculative lookahead). Shrinking (rollback of rejected draft tokens, preemption)
frees every whole block past the new count at once.

Prefix caching (vLLM v1's design): a full block whose tokens all have K/V is named by a hash chained over its
tokens and its parent block's hash, so equal names mean equal prefixes. A new sequence's leading full blocks
found under their names are shared (ref count + 1) and not computed again. A block whose count drops to zero
keeps its name and goes to the back of the free list: it is reused, and its name forgotten, only when every
block freed before it has been (LRU eviction).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence


def block_hash(parent: bytes | None, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """The name of a full block: sha256 over the parent's name, the tokens and anything else that changes
    the K/V. A cryptographic hash because one tenant's prompt must not be able to collide with another's
    and read its cache (Python's hash of a tuple of ints can be steered)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", tokens).tobytes())
    h.update(extra)
    return h.digest()


class BlockPool:
    """Free list plus reference counts; a block returns to the free list when its count drops to zero.

    The free list is ordered by when blocks were freed (a dict keeps insertion order and removes any key in
    O(1)): allocation takes the oldest, so a freed block's cached contents live as long as possible."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, not {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.names: list[bytes | None] = [None] * num_blocks  # a cached block's hash
        self.cached: dict[bytes, int] = {}  # hash -> block holding those tokens' K/V

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        block = next(iter(self._free))
        del self._free[block]
        self._forget(block)  # evicted: its contents are about to be overwritten
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} is free"
        self.ref_counts[block] += 1

    def decref(self, block: int) -> None:
        assert self.ref_counts[block] > 0, f"block {block} freed twice"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free[block] = None

    def name(self, block: int, name: bytes) -> None:
        """Record that `block` holds the full block called `name`; a name already held elsewhere (the same
        tokens computed twice, before either was cached) keeps its first block."""
        if self.names[block] is None and name not in self.cached:
            self.names[block] = name
            self.cached[name] = block

    def lookup(self, name: bytes) -> int | None:
        """The cached block called `name`, now referenced once more (taken off the free list if it was
        there), or None."""
        block = self.cached.get(name)
        if block is None:
            return None
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1
        return block

    def _forget(self, block: int) -> None:
        name = self.names[block]
        if name is not None:
            del self.cached[name]
            self.names[block] = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[Hashable, list[int]] = {}
        self.enable_prefix_caching = enable_prefix_caching
        # per sequence: how many of its leading blocks are named, and the last one's name
        self._named: dict[Hashable, tuple[int, bytes | None]] = {}

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

    def allocate_prefix(self, seq_id: Hashable, token_ids: Sequence[int]) -> int:
        """Start a sequence's table with the cached blocks of its longest cached prefix; returns how many
        tokens they hold (a multiple of block_size). The last token is never taken from the cache: its
        logits are needed, so at least it is computed."""
        assert seq_id not in self.tables, f"{seq_id!r} already has blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        table: list[int] = []
        name: bytes | None = None
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            child = block_hash(name, token_ids[start : start + bs])
            block = self.pool.lookup(child)
            if block is None:
                break
            table.append(block)
            name = child
        self.tables[seq_id] = table
        self._named[seq_id] = (len(table), name)
        return len(table) * bs

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed: int) -> None:
        """Name the sequence's blocks that are now full of computed tokens, so later sequences can share
        them. Only committed tokens count: lookahead slots past num_computed are never named."""
        if not self.enable_prefix_caching:
            return
        table = self.tables.get(seq_id)
        if table is None:
            return
        done, name = self._named.get(seq_id, (0, None))
        bs = self.block_size
        # a stop token inside accepted drafts leaves computed K/V past the last kept token: not named
        full = min(min(num_computed, len(token_ids)) // bs, len(table))
        for i in range(done, full):
            name = block_hash(name, token_ids[i * bs : (i + 1) * bs])
            self.pool.name(table[i], name)
        if full > done:
            self._named[seq_id] = (full, name)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block no sequence holds (vLLM's reset_prefix_cache; benchmarks start cold)."""
        for block in self.pool._free:
            self.pool._forget(block)

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep room for the first `num_tokens` tokens only; free every whole block past them."""
        table = self.tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self.pool.decref(table.pop())
        done, name = self._named.get(seq_id, (0, None))
        assert done <= len(table), "a named (committed) block was truncated"

    def free(self, seq_id: Hashable) -> None:
        # last block first, so that the front of a shared prefix is evicted last
        for block in reversed(self.tables.pop(seq_id, ())):
            self.pool.decref(block)
        self._named.pop(seq_id, None)

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
        """free + used == total, ref counts equal table membership, no block both free and owned, every
        cached name maps to a block that carries it."""
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
        for name, block in self.pool.cached.items():
            assert self.pool.names[block] == name, f"block {block}: cached under a name it does not carry"
        assert sum(1 for n in self.pool.names if n is not None) == len(self.pool.cached)
