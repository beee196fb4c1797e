"""Suffix decoding: draft by continuing the longest suffix of the context seen before, from suffix trees.

Two trees of token sequences (suffix tries cut at `max_depth` tokens): one per request over its prompt and
output so far, and one over the outputs of the last `max_cached_requests` finished requests, within
MAX_SHARED_NODES nodes (agentic and templated traffic repeats itself across requests). A step matches the
context's suffixes of every length in each tree, then walks from each match to the most frequent child while
the product of the child / parent occurrence ratios (the draft token's estimated probability) stays at or
above `min_token_prob`, for at most max_spec_factor x match length (+ max_spec_offset) and k tokens. The
draft with the highest score (the sum of its tokens' probabilities: its expected accepted tokens) wins, the
request's own tree on a tie. A context that matches nothing gets no draft.

Drafts are deterministic (one-hot q), so the verifier keeps the target's distribution exactly.

Pure Python rather than Arctic Inference's compiled suffix tree (arctic-inference 0.3.0's
`arctic_inference.suffix_decoding` imports without vLLM on CPU): a wheel per CPython version and platform
for a few hundred lines of dict walks is not worth the dependency, and every step's cost here is bounded by
the depth, not by the text's length:
- appending a token to a request's tree touches the suffixes that end at it and occurred before (a
  RequestTree keeps a path seen once as its place in the text, not as max_depth new nodes), and following it
  in a shared tree touches those it holds (read-only, rebuilt once from the last `max_depth` tokens after the
  tree changed; it stops at the first suffix the tree lacks, as no longer one is there);
- a proposal reads those nodes directly (no search from the root) and walks at most k children from each
  (the most frequent child of every node is kept up to date), longest match first, stopping where no shorter
  match can score more.

The trees are flat: a node is a row of a few int lists, and children are found in one dict of int keys
per tree (SuffixTree, RequestTree), so a tree is a handful of objects whatever its size. Nodes as one
Python object each cost the step most of its proposal time, in Python's cyclic collector rather than in
the walks: every node made on the step thread counted toward a collection, and a full one walked every
node of every tree (~200 ms with a fleet tree of 200 outputs and 32 requests' trees); the 50 proposals
bench/suffix_fleet.py's micro part times per case caught one such or not, which is all an EMPTY fleet
tree's extra 2.5 ms was (with the collector off it priced the same as no fleet tree). Lists rather than
arrays: an array's read makes an int object and is ~4x slower, and a list of ints is one object to the
collector (its items are no containers). Not compiled: a build step and a binding for dict walks Python
already does in C, when the flat trees price a proposal for 32 sequences at 0.21 ms with no fleet tree,
0.21 ms with an empty one, 0.67 ms with a full one (200 outputs) and 0.53 ms while it is built, collector
on, against 1.06 / 1.02 / 1.57 / 27.9 ms for one object a node, run just before (`python
bench/suffix_fleet.py --skip-serving`, the 2-core Xeon, loaded: indicative only).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field

from specserve.engine.sequence import Sequence
from specserve.spec.proposer import Draft

# A child's key in SuffixTree.kids: its parent's row shifted past any token id, or'ed with its token.
_TOKEN_BITS = 32
_ROOT = 0


class SuffixTree:
    """Suffixes of token sequences, each cut at max_depth tokens, added (`insert`) and removed (`remove`)
    whole: the shared trees' (a request's own is a RequestTree).

    A node is a row of the lists: its `token`, `count` (the path's occurrences within max_depth of where
    they start), `best` (its most frequent child; ties: the lowest token id; -1: none; not kept for the
    root, which no walk starts from) and its place among its parent's children (`first` child, `next` and
    `prev` sibling), so a removal unlinks it at once and finds the parent's most frequent child again.
    `kids` maps parent << 32 | token to the child's row. A node whose count falls to 0 leaves `kids` and its
    row goes to `free`, for the next node made."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2 (a match and one token after it)")
        self.max_depth = max_depth
        self.root = _ROOT
        self.token = [-1]
        self.count = [0]
        self.best = [-1]
        self.first = [-1]
        self.next = [-1]
        self.prev = [-1]
        self.kids: dict[int, int] = {}
        self.free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root aside."""
        return len(self.token) - len(self.free) - 1

    def children(self, node: int) -> Iterator[int]:
        kid = self.first[node]
        while kid >= 0:
            yield kid
            kid = self.next[kid]

    def _make(self, parent: int, token: int) -> int:
        """A new child of `parent` (count 0), in a free row if there is one."""
        if self.free:
            row = self.free.pop()
            self.token[row] = token
            self.count[row] = 0
            self.best[row] = -1
        else:
            row = len(self.token)
            self.token.append(token)
            self.count.append(0)
            self.best.append(-1)
            self.first.append(-1)
            self.next.append(-1)
            self.prev.append(-1)
        head = self.first[parent]
        self.first[row] = -1
        self.next[row] = head
        self.prev[row] = -1
        if head >= 0:
            self.prev[head] = row
        self.first[parent] = row
        self.kids[parent << _TOKEN_BITS | token] = row
        return row

    def _drop(self, parent: int, row: int) -> None:
        """Unlink `row` (count 0) from its parent and free it; its children go in the same removal."""
        del self.kids[parent << _TOKEN_BITS | self.token[row]]
        before, after = self.prev[row], self.next[row]
        if before >= 0:
            self.next[before] = after
        else:
            self.first[parent] = after
        if after >= 0:
            self.prev[after] = before
        self.best[row] = -1
        self.free.append(row)

    def _rerank(self, node: int) -> None:
        """Find `node`'s most frequent child again, after one of its children lost an occurrence."""
        count, token = self.count, self.token
        best = -1
        kid = self.first[node]
        while kid >= 0:
            if best < 0 or (count[kid], -token[kid]) > (count[best], -token[best]):
                best = kid
            kid = self.next[kid]
        self.best[node] = best

    def _counted(self, ends: list[int], token: int) -> tuple[list[int], int]:
        """`ends`: the nodes of a sequence's suffixes of lengths 1..len(ends), shortest first. The nodes of
        its suffixes with `token` appended (made where new), one occurrence more each, and how many were
        made."""
        kids, count, best, tokens = self.kids, self.count, self.best, self.token
        made = 0
        row = kids.get(token)  # the root's child: _ROOT << _TOKEN_BITS is 0
        if row is None:
            row = self._make(_ROOT, token)
            made += 1
        count[row] += 1
        out = [row]
        for node in ends:
            row = kids.get(node << _TOKEN_BITS | token)
            if row is None:
                row = self._make(node, token)
                made += 1
            c = count[row] + 1
            count[row] = c
            b = best[node]
            if b != row and (b < 0 or c > count[b] or (c == count[b] and token < tokens[b])):
                best[node] = row
            out.append(row)
        return out, made

    def insert(self, tokens: Iterable[int]) -> int:
        """Count every suffix of `tokens`; returns the nodes it added."""
        return sum(self.insert_steps(tokens, 1 << 62))

    def insert_steps(self, tokens: Iterable[int], chunk: int) -> Iterator[int]:
        """insert(tokens) `chunk` tokens at a time, yielding the nodes each chunk added: the tree is whole
        between chunks (as if a prefix of `tokens` had been inserted), so a reader may walk it there."""
        added = 0
        ends: list[int] = []
        keep = self.max_depth - 1
        for i, token in enumerate(tokens, 1):
            nodes, made = self._counted(ends, token)
            added += made
            ends = nodes[:keep]
            if i % chunk == 0:
                yield added
                added = 0
        yield added

    def remove(self, tokens: list[int]) -> int:
        """Undo insert(tokens): every suffix's occurrences go, and nodes no sequence reaches any more;
        returns how many nodes went."""
        return sum(self.remove_steps(tokens, 1 << 62))

    def remove_steps(self, tokens: list[int], chunk: int) -> Iterator[int]:
        """remove(tokens) `chunk` suffixes at a time, yielding the nodes each chunk dropped."""
        kids, count, best = self.kids, self.count, self.best
        dropped = 0
        for start in range(len(tokens)):
            node = _ROOT
            for token in tokens[start : start + self.max_depth]:
                row = kids[node << _TOKEN_BITS | token]
                c = count[row] - 1
                count[row] = c
                if not c:
                    self._drop(node, row)
                    dropped += 1
                # a node with one child left (its count all that child's) needs no search
                if node != _ROOT and best[node] == row and (not c or c != count[node]):
                    self._rerank(node)
                node = row
            if (start + 1) % chunk == 0:
                yield dropped
                dropped = 0
        yield dropped

    def follow(self, ends: list[int], token: int) -> list[int]:
        """`ends`: the nodes of a sequence's suffixes of lengths 1..len(ends) (< max_depth - 1), shortest
        first; the nodes of its suffixes with `token` appended, as far as they occur in the tree (a suffix
        that does not has no longer one that does)."""
        kids = self.kids
        row = kids.get(token)
        if row is None:
            return []
        out = [row]
        for node in ends[: self.max_depth - 2]:
            row = kids.get(node << _TOKEN_BITS | token)
            if row is None:
                break
            out.append(row)
        return out

    def match(self, suffix: list[int]) -> int | None:
        node = _ROOT
        for token in suffix:
            row = self.kids.get(node << _TOKEN_BITS | token)
            if row is None:
                return None
            node = row
        return node


class RequestTree:
    """A request's tree over its text so far, grown a token at a time (never removed from): SuffixTree's rows,
    but only for paths that occur twice or more. A path that occurs once is where it occurs: its parent's
    `kids` (and `best`) hold -2 - position (of its last token in `text`), and its only continuation, what
    follows it there in the text, is implied; it gets a row when it occurs again. Most of a text's suffixes
    past a few tokens occur once, so a token costs the dict steps of the suffixes that occurred before
    (`ends`: their rows, shortest first) rather than max_depth new nodes."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError("max_depth must be at least 2 (a match and one token after it)")
        self.max_depth = max_depth
        self.root = _ROOT
        self.text: list[int] = []
        self.token = [-1]
        self.count = [0]
        self.best = [-1]
        self.kids: dict[int, int] = {}
        self.ends: list[int] = []  # rows of the text's suffixes of lengths 1..len(ends) (< max_depth)

    def append(self, token: int) -> None:
        text, kids, count, best, tokens = self.text, self.kids, self.count, self.best, self.token
        text.append(token)
        here = -2 - (len(text) - 1)
        depth = self.max_depth
        ends: list[int] = []
        for length, node in enumerate((_ROOT, *self.ends), 1):  # the child's length
            key = node << _TOKEN_BITS | token
            row = kids.get(key)
            if row is None:  # a first occurrence: so are all longer ones, each noted at its parent
                kids[key] = child = here
                c = 1
            elif row >= 0:
                child = row
                c = count[row] + 1
                count[row] = c
            else:  # a second occurrence: a row, whose one child so far is what followed the first
                first = -2 - row
                child = len(tokens)
                c = 2
                tokens.append(token)
                count.append(2)
                after = -1
                if length < depth and first + 1 < len(text):
                    after = -3 - first
                    kids[child << _TOKEN_BITS | text[first + 1]] = after
                best.append(after)
                kids[key] = child
            if node != _ROOT:
                b = best[node]
                if b == row:  # the once-seen child now has its row
                    best[node] = child
                elif b != child:
                    bc, bt = (count[b], tokens[b]) if b >= 0 else (1, text[-2 - b]) if b != -1 else (0, 0)
                    if c > bc or (c == bc and token < bt):
                        best[node] = child
            if child >= 0 and length < depth:
                ends.append(child)
        self.ends = ends

    def paths(self) -> dict[tuple[int, ...], tuple[int, int | None]]:
        """Every path's occurrence count and its most frequent next token (None: none), rows or not."""
        text, depth = self.text, self.max_depth
        under: dict[int, list[int]] = {}
        for key, child in self.kids.items():
            under.setdefault(key >> _TOKEN_BITS, []).append(child)

        def next_token(b: int) -> int | None:
            return None if b == -1 else self.token[b] if b >= 0 else text[-2 - b]

        out: dict[tuple[int, ...], tuple[int, int | None]] = {}
        stack: list[tuple[tuple[int, ...], int]] = [((), _ROOT)]
        while stack:
            path, node = stack.pop()
            for child in under.get(node, ()):
                if child >= 0:
                    out[path + (self.token[child],)] = (self.count[child], next_token(self.best[child]))
                    stack.append((path + (self.token[child],), child))
                    continue
                at = -2 - child
                chain = path + (text[at],)
                while True:
                    more = len(chain) < depth and at + 1 < len(text)
                    out[chain] = (1, text[at + 1] if more else None)
                    if not more:
                        break
                    at += 1
                    chain += (text[at],)
        return out


@dataclass(frozen=True)
class Speculation:
    token_ids: list[int]
    score: float  # sum of the draft tokens' estimated probabilities
    match_len: int


NO_SPECULATION = Speculation([], 0.0, 0)


@dataclass(frozen=True)
class Walk:
    """How far a draft goes from a match."""

    max_spec_factor: float
    max_spec_offset: float
    min_token_prob: float
    # per max_tokens, the draft's longest for each match length (index: match length)
    _limits: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def limits(self, max_tokens: int, depth: int) -> list[int]:
        out = self._limits.get(max_tokens)
        if out is None or len(out) <= depth:
            grow = self.max_spec_factor, self.max_spec_offset
            out = [min(max_tokens, int(n * grow[0] + grow[1] + 1e-6)) for n in range(depth + 1)]
            self._limits[max_tokens] = out
        return out

    def speculate(
        self,
        tree: SuffixTree | RequestTree,
        ends: list[int],
        max_tokens: int,
        beat: Speculation = NO_SPECULATION,
        text: list[int] | None = None,
    ) -> Speculation:
        """The best draft from any of the context's suffix nodes in `tree` (`ends[i]`: the suffix of length
        i + 1) if it scores above `beat`, else `beat`; on a tie, the longer match. `text`: a RequestTree's.

        Longest match first: a draft of n tokens scores n at most (each token's probability is at most 1),
        and n only shrinks with the match, so the walk stops at the first match whose limit cannot beat the
        best so far, and a shorter match must score strictly more to win, as a tie goes to the longer."""
        count, best_kid, token = tree.count, tree.best, tree.token
        min_prob, depth = self.min_token_prob, tree.max_depth
        best = beat
        limits = self.limits(max_tokens, depth)  # the same list every call: ends are shorter than depth
        for i in range(len(ends) - 1, -1, -1):
            limit = limits[i + 1]
            if limit <= best.score:
                break
            node = ends[i]
            child = best_kid[node]
            if child == -1:
                continue
            tokens: list[int] = []
            prob = 1.0
            score = 0.0
            while True:
                if child < 0:  # a path seen once (RequestTree): the text after it, each token a ratio of 1
                    assert text is not None
                    prob *= 1 / count[node]
                    if prob < min_prob:
                        break
                    at = -2 - child
                    tokens.append(text[at])
                    score += prob
                    while len(tokens) < limit and i + 1 + len(tokens) < depth and at + 1 < len(text):
                        at += 1
                        tokens.append(text[at])
                        score += prob
                    break
                c = count[child]
                if c <= 0:  # removed since it was reached (FleetTree)
                    break
                prob *= c / count[node]
                if prob < min_prob:
                    break
                tokens.append(token[child])
                score += prob
                if len(tokens) >= limit:
                    break
                node = child
                child = best_kid[node]
                if child == -1:
                    break
            if tokens and score > best.score:
                best = Speculation(tokens, score, i + 1)
        return best


class _Followed:
    """Where a sequence's suffixes stand in a shared tree, as of that tree's `version`."""

    __slots__ = ("ends", "version", "age")

    def __init__(self) -> None:
        self.ends: list[int] = []
        self.version = -1  # no version: the next reading rebuilds `ends`
        self.age = 0  # proposals since `ends` were rebuilt


class _RequestState:
    """One sequence's tree over its tokens so far, and where its suffixes stand in the shared trees."""

    def __init__(self, max_depth: int) -> None:
        self.tree = RequestTree(max_depth)
        self.num_tokens = 0
        self.shared = _Followed()  # this worker's finished outputs
        self.fleet = _Followed()  # other workers' (FleetTree)
        self.num_fleet = 0  # tokens followed in the fleet's tree


# The shared tree's nodes at most, whatever max_requests allows: an output of n tokens adds up to n x depth
# nodes, so 10,000 outputs of 256 distinct tokens would be 61 M nodes, GBs. A node takes about 165 bytes
# (its rows, its int, its key in `kids`; tracemalloc, CPython 3.11, 2,000 random tokens at depth 24): some
# 330 MB here, the bound the trees had as one object a node at 4 M nodes of ~67 bytes.
MAX_SHARED_NODES = 2_000_000


class GlobalTree:
    """Outputs of finished requests, the least recently added evicted past max_requests or past max_nodes
    nodes (each removed whole: its every occurrence count). A key added again replaces its earlier output.
    The newest output stays even when it alone is over max_nodes."""

    def __init__(self, max_depth: int, max_requests: int, max_nodes: int = MAX_SHARED_NODES) -> None:
        self.tree = SuffixTree(max_depth)
        self.max_requests = max_requests
        self.max_nodes = max_nodes
        self.num_nodes = 0
        self.outputs: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.version = 0  # changes with the tree, so followers know their nodes may be stale

    def add(self, key: Hashable, tokens: list[int]) -> None:
        for _ in self.add_steps(key, tokens, 1 << 62):
            pass

    def add_steps(self, key: Hashable, tokens: list[int], chunk: int) -> Iterator[None]:
        """add(key, tokens) about `chunk` tokens of tree work at a time; between two steps the tree is whole,
        so a reader holding the writer's lock may walk it. `version` changes once per output inserted or
        removed, not per step: a reader's nodes from before stay usable meanwhile (a node removed since has
        count 0 and no child, so Walk drafts nothing from it; once its row is reused for another path, a
        stale reader may draft that path's continuation, which the verifier rejects like any poor draft:
        the target's tokens never depend on a draft), and rebuilding every reader's nodes per chunk would
        cost the step more than the drafts it misses."""
        if self.max_requests <= 0 or not tokens:
            return
        old = self.outputs.pop(key, None)
        if old is not None:
            yield from self._removing(old, chunk)
        while len(self.outputs) >= self.max_requests:
            yield from self._removing(self.outputs.popitem(last=False)[1], chunk)
        self.outputs[key] = list(tokens)
        for added in self.tree.insert_steps(tokens, chunk):
            self.num_nodes += added
            yield
        self.version += 1
        while self.num_nodes > self.max_nodes and len(self.outputs) > 1:
            yield from self._removing(self.outputs.popitem(last=False)[1], chunk)

    def _removing(self, tokens: list[int], chunk: int) -> Iterator[None]:
        for dropped in self.tree.remove_steps(tokens, chunk):
            self.num_nodes -= dropped
            yield
        self.version += 1


_DONE = object()
# Tree work the fleet's builder does per hold of its lock: ~25 us a token (CPython 3.11, depth 24, 200 random
# outputs of 128 tokens in a row, the 2-core Xeon, loaded), so a step that wants the tree waits for none of
# it: it skips the fleet's tree that step.
FLEET_CHUNK_TOKENS = 16
MAX_REST_S = 0.01
# A sequence re-finds its place in the fleet's tree, after it changed, at most every this many proposals:
# at every change, 32 sequences' rebuilds took a proposal from 1.6 to 16 ms while the builder ran
# (bench/suffix_fleet.py's micro part, 2-core Xeon, loaded), for drafts from the outputs of the last steps.
FLEET_REFRESH = 8
# Outputs waiting to be built into the fleet's tree, and this worker's waiting to be sent: past this many the
# newest incoming one is dropped (the feed counts it) and the oldest outgoing one.
FLEET_MAX_PENDING = 256


class FleetTree:
    """Other workers' finished outputs (service/suffix_fleet.py reads them from Redis), and this worker's for
    them: a GlobalTree of its own, built on a thread of its own, never on the step's.

    The builder inserts `FLEET_CHUNK_TOKENS` tokens at a time, each under `lock`; a proposal takes the lock
    only if it is free (`acquire(blocking=False)`) and otherwise drafts from the other trees alone that step,
    so no step waits on the fleet. Both queues are bounded; `offer` and `share` never block."""

    def __init__(
        self,
        max_depth: int,
        max_requests: int,
        max_nodes: int = MAX_SHARED_NODES,
        max_pending: int = FLEET_MAX_PENDING,
        chunk: int = FLEET_CHUNK_TOKENS,
    ) -> None:
        self.cache = GlobalTree(max_depth, max_requests, max_nodes)
        self.lock = threading.Lock()
        self.chunk = chunk
        self._incoming: queue.Queue[tuple[Hashable, list[int]] | None] = queue.Queue(max_pending)
        self._outgoing: deque[list[int]] = deque(maxlen=max_pending)
        self.num_built = 0  # outputs built into the tree
        self.num_dropped = 0  # incoming outputs dropped for want of room (the builder behind)
        self.num_unsent = 0  # own outputs dropped before the feed sent them
        self._closed = False
        self._thread = threading.Thread(target=self._build, name="specserve-suffix-fleet", daemon=True)
        self._thread.start()

    # ---- the feed's side (any thread) --------------------------------------------------------------------

    def offer(self, key: Hashable, tokens: list[int]) -> bool:
        """Queue another worker's output for the tree; False when the queue is full (it is dropped)."""
        try:
            self._incoming.put_nowait((key, tokens))
        except queue.Full:
            self.num_dropped += 1
            return False
        return True

    def outgoing(self) -> list[list[int]]:
        """This worker's outputs shared since the last call, oldest first."""
        out = []
        while self._outgoing:
            try:
                out.append(self._outgoing.popleft())
            except IndexError:
                break
        return out

    @property
    def capacity(self) -> int:
        """Outputs that may wait for the builder."""
        return self._incoming.maxsize

    @property
    def pending(self) -> int:
        """Outputs offered and not yet in the tree."""
        return self._incoming.unfinished_tasks

    def close(self) -> None:
        """Stop the builder. It lives as long as its proposer otherwise: a worker that stops leaves it to the
        next feed on the same engine."""
        self._closed = True  # seen after the output being built, should the queue be too full to wake it
        with contextlib.suppress(queue.Full):
            self._incoming.put_nowait(None)

    # ---- the step's side ---------------------------------------------------------------------------------

    def share(self, tokens: list[int]) -> None:
        """A finished output of this worker's, for the feed to send (the deque drops the oldest when full)."""
        if len(self._outgoing) == self._outgoing.maxlen:
            self.num_unsent += 1
        self._outgoing.append(tokens)

    # ---- the builder -------------------------------------------------------------------------------------

    def _build(self) -> None:
        while True:
            item = self._incoming.get()
            if item is None or self._closed:
                self._incoming.task_done()
                return
            key, tokens = item
            steps = self.cache.add_steps(key, tokens, self.chunk)
            try:
                while True:
                    started = time.perf_counter()
                    with self.lock:
                        if next(steps, _DONE) is _DONE:
                            break
                    # Rest as long as the chunk took: the builder holds the GIL half the time at most, so a
                    # step's Python (scheduling, sampling, proposing) is never crowded out by it.
                    time.sleep(min(time.perf_counter() - started, MAX_REST_S))
            finally:
                self.num_built += 1
                self._incoming.task_done()


class SuffixProposer:
    # Its state is the committed tokens alone: drafts it did not make may replace or extend its own
    # (grammar-forced tokens).
    stateless = True
    priced_drafts = True  # proposer.Proposer

    def __init__(
        self,
        num_speculative_tokens: int,
        max_tree_depth: int = 24,
        max_cached_requests: int = 10000,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_spec_offset: float = 0.0,
        max_cached_nodes: int = MAX_SHARED_NODES,
    ) -> None:
        self.max_depth = max_tree_depth
        self.max_tokens = num_speculative_tokens
        self.max_cached_requests = max_cached_requests
        self.max_cached_nodes = max_cached_nodes
        self.walk = Walk(max_spec_factor, max_spec_offset, min_token_prob)
        self.cache = GlobalTree(max_tree_depth, max_cached_requests, max_cached_nodes)
        self.fleet: FleetTree | None = None  # other workers' outputs, once a feed asks for them
        self._requests: dict[int, _RequestState] = {}

    def fleet_tree(self) -> FleetTree | None:
        """The tree other workers' outputs go into (made on the first call; any thread may call it); None
        when no shared tree is kept (max_cached_requests 0)."""
        if self.fleet is None and self.max_cached_requests > 0:
            self.fleet = FleetTree(self.max_depth, self.max_cached_requests, self.max_cached_nodes)
        return self.fleet

    # ---- Proposer ----------------------------------------------------------------------------------------

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        fleet = self.fleet
        held = fleet is not None and bool(fleet.cache.outputs) and fleet.lock.acquire(blocking=False)
        try:
            drafts = {}
            for seq, k in requests:
                state = self._catch_up(seq)
                if held:
                    assert fleet is not None
                    self._follow(fleet.cache, state.fleet, seq.token_ids, state.num_fleet, FLEET_REFRESH)
                    state.num_fleet = state.num_tokens
                else:
                    state.fleet.version = -1  # not followed this step: rebuilt when it is next
                spec = self.speculate(state, min(k, self.max_tokens), held)
                drafts[seq.seq_id] = Draft(spec.token_ids, match_len=spec.match_len if spec.token_ids else 0)
            return drafts
        finally:
            if held:
                assert fleet is not None
                fleet.lock.release()

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        pass  # the trees hold committed tokens only: nothing to roll back

    def forget(self, seq: Sequence) -> None:
        """A finished sequence's output joins the global tree and goes to the fleet (an aborted one's does
        not: it was cut short); a preempted one's tree is rebuilt when it drafts again."""
        self._requests.pop(seq.seq_id, None)
        if seq.is_finished and seq.finish_reason != "abort":
            output = seq.output_token_ids
            self.cache.add(seq.seq_id, output)
            if self.fleet is not None and output:
                self.fleet.share(list(output))

    # ---- the trees ---------------------------------------------------------------------------------------

    def speculate(self, state: _RequestState, max_tokens: int, fleet: bool = False) -> Speculation:
        """The best of the request's own tree, this worker's outputs and (`fleet`: its lock is held) the
        fleet's; on a tie, in that order."""
        walk = self.walk
        best = walk.speculate(state.tree, state.tree.ends, max_tokens, text=state.tree.text)
        if self.cache.outputs:
            best = walk.speculate(self.cache.tree, state.shared.ends, max_tokens, best)
        if fleet:
            assert self.fleet is not None
            best = walk.speculate(self.fleet.cache.tree, state.fleet.ends, max_tokens, best)
        return best

    def _catch_up(self, seq: Sequence) -> _RequestState:
        """Append the tokens committed since the last proposal to the sequence's trees."""
        state = self._requests.get(seq.seq_id)
        tokens = seq.token_ids
        if state is None or state.num_tokens > len(tokens):
            state = self._requests[seq.seq_id] = _RequestState(self.max_depth)
        start = state.num_tokens
        tree = state.tree
        for token in tokens[start:]:
            tree.append(token)
        state.num_tokens = len(tokens)
        if self.cache.outputs:
            self._follow(self.cache, state.shared, tokens, start)
        return state

    def _follow(
        self, cache: GlobalTree, at: _Followed, tokens: list[int], start: int, refresh: int = 0
    ) -> None:
        """Bring `at` up to `tokens` in `cache`'s tree: from tokens[start:], or from the last max_depth - 1
        tokens after the tree changed, at once or (`refresh`) once `at` is that many proposals old: its nodes
        stay walkable meanwhile (GlobalTree.add_steps), they only miss what was added since."""
        at.age += 1
        if at.version != cache.version and (at.version < 0 or at.age > refresh):
            at.ends, start = [], max(0, len(tokens) - (self.max_depth - 1))
            at.version, at.age = cache.version, 0
        for token in tokens[start:]:
            at.ends = cache.tree.follow(at.ends, token)
