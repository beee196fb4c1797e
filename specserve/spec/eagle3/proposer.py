"""EAGLE-3 proposer: the head (head.py) drafts from the target's hidden states, on the target's block tables.

Per engine step, for each speculating sequence of N tokens (positions 0..N-1, the target has computed
0..N-2), one batched head forward catches up: the rows of positions the head has not seen up to N-2, each
reading the token after it and fc(the target's three captured states at that position) (head.py's layout).
Its last row drafts token N; each of the k-1 forwards after it reads the draft just made and the head's own
hidden output of the row before, one position further.

The head's K/V is one more layer on the target's cache geometry: its own [blocks, block size] pool, indexed
by the target's block tables. A position's head K/V lives in the block the target's K/V of that position
lives in, so prefix caching shares it with the target's blocks (a sequence whose prefix was cached starts
catching up after it) and rolling back the target's rejected drafts rolls back the head's: the rows past the
verified ones are rewritten by the next catch-up. The target's captured states come from the engine's
forward (`capture`), for every token of the sequences that may speculate with this head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.engine.sampler import RowParams, sample
from specserve.engine.sequence import Sequence
from specserve.kernels import AttentionBackend, select_backend
from specserve.spec.eagle3.head import Eagle3Head
from specserve.spec.proposer import Draft

BlockTable = Callable[[int], list[int]]
# Draft-tree nodes a step's sequences share: a sequence drafts min(k, this // sequences) nodes, and the step
# drafts chains where that leaves a tree no room to branch (the verify rows of trees grow the target's
# forward, which pays at small batches only).
TREE_STEP_NODES = 64


class PagedHead:
    """The head's weights for serving (q/k/v and gate/up fused) and its forward over a paged cache; it has
    what ModelRunner asks of a model (backend, device, windows, allocate_kv_cache), so the runner lays out
    the head's steps as it does the target's."""

    windows: tuple[int, ...] = ()

    def __init__(self, head: Eagle3Head, dtype: torch.dtype, device: torch.device, attention_backend: str):
        cfg = head.cfg
        self.cfg = cfg
        self.head = head.to(device=device, dtype=dtype).eval()
        self.dtype, self.device = dtype, torch.device(device)
        self.backend: AttentionBackend = select_backend(self.device, attention_backend)
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        with torch.no_grad():
            self.qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
            self.gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
        self.q_size = cfg.num_attention_heads * cfg.head_dim
        self.kv_size = cfg.num_key_value_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # the target id of each draft id, once: the draft's logits land there (head.target_logits)
        self.target_ids = head.draft_to_target(torch.arange(cfg.draft_vocab_size, device=self.device))

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.cfg
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        return [(cache[0], cache[1])]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin

    @torch.inference_mode()
    def forward(
        self,
        runner: ModelRunner,
        entries: list[ForwardEntry],
        hidden: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the head over the entries' rows: `hidden` [rows, hidden] is each row's fused target
        states or the head's own previous output. Returns the draft logits (float32, draft vocabulary) and
        hidden_out of the rows whose logits the entries ask for."""
        head, cfg = self.head, self.cfg
        layer = head.layers[0]
        input_ids, positions, attn_in, logit_rows = runner.prepare(entries)
        n = input_ids.shape[0]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        x, residual = head.layer_input(input_ids, hidden)
        qkv = F.linear(x, self.qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        cos, sin = head._cos_sin(qkv, positions[None])
        cos, sin = cos[0, :, None, :].to(self.dtype), sin[0, :, None, :].to(self.dtype)
        q = self._rotate(q.view(n, nh, hd), cos, sin).contiguous()
        k = self._rotate(k.view(n, nkv, hd), cos, sin).contiguous()
        (k_cache, v_cache) = runner.kv_caches[0]
        self.backend.write_kv(k, v.reshape(n, nkv, hd).contiguous(), k_cache, v_cache, attn_in.slot_mapping)
        o = self.backend.paged_attention(
            q,
            k_cache,
            v_cache,
            attn_in.block_tables,
            attn_in.seq_lens,
            attn_in.query_start_loc,
            self.scale,
            plan=attn_in.plan,
            **({} if attn_in.trees is None else {"trees": attn_in.trees}),
        )
        h = residual + layer.self_attn.o_proj(o.reshape(n, self.q_size))
        gate, up = F.linear(layer.post_attention_layernorm(h), self.gate_up).chunk(2, dim=-1)
        h = h + layer.mlp.down_proj(layer.mlp.act(gate) * up)
        out = h[logit_rows]
        return head.logits(out).float(), out

    def target_logits(self, draft_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[R, draft vocab] -> [R, target vocab], -inf where the draft vocabulary has no token."""
        out = draft_logits.new_full((draft_logits.shape[0], vocab_size), float("-inf"))
        out[:, self.target_ids] = draft_logits
        return out


class _Tree:
    """One sequence's draft tree as it grows: node 0 the last token; the nodes added at the last depth
    (`frontier`) wait for their head rows, which decide their children."""

    def __init__(self, last_token: int, budget: int, max_depth: int) -> None:
        self.tokens = [last_token]
        self.parents = [-1]
        self.depth = [0]
        self.score = [0.0]  # cumulative draft log-probability
        self.budget = budget  # draft nodes (the root not counted)
        self.max_depth = max_depth
        self.frontier: list[int] = []

    def grow(
        self, nodes: list[int], logprobs: torch.Tensor, target_ids: torch.Tensor, branching: int
    ) -> None:
        """nodes' rows' draft log-probabilities [len(nodes), draft vocab]: the best `branching` of the best
        `branching` nodes' `branching` children join the tree, as far as the budget goes."""
        room = self.budget - (len(self.tokens) - 1)
        self.frontier = []
        if room <= 0 or self.depth[nodes[0]] >= self.max_depth:
            return
        order = sorted(range(len(nodes)), key=lambda j: -self.score[nodes[j]])[:branching]
        top = logprobs[order].topk(min(branching, logprobs.shape[-1]), dim=-1)
        candidates = [
            (self.score[nodes[j]] + float(lp), nodes[j], int(tid))
            for j, lps, ids in zip(order, top.values, target_ids[top.indices])
            for lp, tid in zip(lps, ids)
        ]
        candidates.sort(key=lambda c: -c[0])  # stable: on a tie the earlier node's earlier child
        for score, parent, token in candidates[: min(branching, room)]:
            self.frontier.append(len(self.tokens))
            self.tokens.append(token)
            self.parents.append(parent)
            self.depth.append(self.depth[parent] + 1)
            self.score.append(score)


@dataclass
class _Seq:
    """What the head holds of one sequence: its K/V is valid at positions [0, cached) (on the target's
    blocks), and the target's captured states of positions [aux_start, aux_start + len(aux)) wait for it."""

    cached: int
    aux_start: int
    aux: torch.Tensor  # [rows, 3 * target hidden]


class Eagle3Proposer:
    """`block_table(seq_id)`: the target's block table of a sequence (the scheduler has already given it
    the slots of this step's drafts, which cover every position the head writes)."""

    def __init__(
        self,
        head: PagedHead,
        aux_layers: tuple[int, ...],
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        block_table: BlockTable,
        tree: tuple[int, int] | None = None,
    ) -> None:
        self.head = head
        self.tree = tree  # (branching, depth) of the draft trees; None: chains
        self.aux_layers = aux_layers  # the target layers whose input the engine captures for the head
        self.vocab_size = vocab_size
        self.runner = ModelRunner(head, num_blocks, block_size)  # type: ignore[arg-type]
        self.block_table = block_table
        self._seqs: dict[int, _Seq] = {}

    # ---- the target's states ----------------------------------------------------------------------------

    def capture(self, seq: Sequence, start: int, aux: torch.Tensor) -> None:
        """The target computed positions [start, start + len(aux)) of `seq` this step: their captured states
        replace whatever was held from `start` on (rows of rejected drafts). A sequence first seen past
        position 0 had its prefix cached: the head's K/V of it sits in the shared blocks."""
        state = self._seqs.get(seq.seq_id)
        keep = -1 if state is None else start - state.aux_start
        if state is None or not 0 <= keep <= state.aux.shape[0] or start < state.cached:
            self._seqs[seq.seq_id] = _Seq(start, start, aux)
            return
        state.aux = torch.cat([state.aux[:keep], aux]) if keep else aux

    # ---- Proposer ---------------------------------------------------------------------------------------

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        if self.tree is not None:
            branching, depth = self.tree
            per_seq = TREE_STEP_NODES // len(requests)
            if branching > 1 and per_seq > depth:
                return self.propose_tree([(seq, min(k, per_seq)) for seq, k in requests], branching, depth)
        return self.propose_chains(requests)

    def _split_ready(
        self, requests: list[tuple[Sequence, int]]
    ) -> tuple[dict[int, Draft], list[tuple[Sequence, int, _Seq]]]:
        """Empty drafts for the sequences the head cannot draft for yet, and the others with their state."""
        drafts: dict[int, Draft] = {}
        active: list[tuple[Sequence, int, _Seq]] = []
        for seq, k in requests:
            state = self._ready(seq, k)
            if state is None:
                drafts[seq.seq_id] = Draft([])
            else:
                active.append((seq, k, state))
        return drafts, active

    def propose_chains(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        drafts, active = self._split_ready(requests)
        if not active:
            return drafts
        entries, hidden = self._catch_up(active)
        rows_all = RowParams.build(
            [seq.params for seq, _, _ in active], [seq.seed for seq, _, _ in active], self.vocab_size
        )
        proposed: dict[int, list[int]] = {seq.seq_id: [] for seq, _, _ in active}
        idx = list(range(len(active)))
        out = hidden
        for step in range(max(k for _, k, _ in active)):
            if step:
                keep = [j for j, i in enumerate(idx) if active[i][1] > step]
                idx = [idx[j] for j in keep]
                hidden = out[keep]
                entries = [
                    ForwardEntry(
                        [proposed[active[i][0].seq_id][-1]],
                        active[i][0].num_tokens - 2 + step,
                        self.block_table(active[i][0].seq_id),
                        1,
                    )
                    for i in idx
                ]
            draft_logits, out = self.head.forward(self.runner, entries, hidden)
            rows = rows_all.select(idx)
            if rows.all_greedy:
                tokens_out = self.head.target_ids[draft_logits.argmax(dim=-1)].tolist()
            else:
                # at the uniform the target's token at that position is drawn with: verification then
                # accepts the draft wherever the two distributions put that uniform on the same token
                positions = [active[i][0].num_tokens + step for i in idx]
                tokens_out = sample(self.head.target_logits(draft_logits, self.vocab_size), rows, positions)
                tokens_out = tokens_out.tolist()
            for j, i in enumerate(idx):
                proposed[active[i][0].seq_id].append(int(tokens_out[j]))
        self._caught_up(active)
        for seq, _, _ in active:
            drafts[seq.seq_id] = Draft(proposed[seq.seq_id])
        return drafts

    def _ready(self, seq: Sequence, k: int) -> _Seq | None:
        """The sequence's state where the head can draft for it: the catch-up needs the target's states of
        every position from `cached` to N - 2."""
        state = self._seqs.get(seq.seq_id)
        if (
            state is None
            or k < 1
            or state.cached >= seq.num_tokens - 1  # nothing new since it last drafted
            or state.aux_start + state.aux.shape[0] < seq.num_tokens - 1
        ):
            return None
        return state

    def _catch_up(self, active: list[tuple[Sequence, int, _Seq]]) -> tuple[list[ForwardEntry], torch.Tensor]:
        """The catch-up forward's entries (rows of positions cached..N-2, the last one drafting) and their
        fused hidden inputs."""
        entries: list[ForwardEntry] = []
        fused_rows: list[torch.Tensor] = []
        for seq, _, state in active:
            end = seq.num_tokens - 1
            start = state.cached
            table = self.block_table(seq.seq_id)
            entries.append(ForwardEntry(seq.token_ids[start + 1 : end + 1], start, table, 1))
            fused_rows.append(state.aux[start - state.aux_start : end - state.aux_start])
        with torch.inference_mode():
            hidden = self.head.head.fuse(torch.cat(fused_rows).to(self.head.dtype))
        return entries, hidden

    def _caught_up(self, active: list[tuple[Sequence, int, _Seq]]) -> None:
        for seq, _, state in active:
            # the catch-up wrote every position up to N - 2: its states are no longer needed
            end = seq.num_tokens - 1
            state.aux = state.aux[end - state.aux_start :]
            state.cached = state.aux_start = end

    def propose_tree(
        self, requests: list[tuple[Sequence, int]], branching: int, max_depth: int | None = None
    ) -> dict[int, Draft]:
        """A draft tree of up to k nodes per (sequence, k): EAGLE-2's dynamic tree, simplified. The root is
        the last token; each depth expands the best `branching` nodes of the depth before by cumulative draft
        log-probability into their `branching` most likely children, and keeps the best `branching` of those,
        until k nodes or max_depth. branching 1 is chain drafting's greedy chain.

        The head's rows of a tree stand where the verify rows will: node i at position N - 2 + i of the
        head's cache, its rope position N - 2 + depth(i), attending to its ancestors (ForwardEntry.tree);
        each depth reruns the tree so far in one forward, the head being one layer over a few rows. The
        head's K/V past the verified tokens is rewritten by the next catch-up, as after a chain."""
        drafts, active = self._split_ready(requests)
        if not active:
            return drafts
        entries, fused = self._catch_up(active)
        logits, root_out = self.head.forward(self.runner, entries, fused)
        roots = [int(e.start_pos + len(e.token_ids)) - 1 for e in entries]  # N - 2, the root's position
        ends = torch.tensor([len(e.token_ids) for e in entries]).cumsum(0) - 1
        root_in = fused[ends]  # the root row's own input: its fused target states
        trees = [_Tree(seq.token_ids[-1], k, max_depth or k) for seq, k, _ in active]
        for t, row in zip(trees, logits.log_softmax(dim=-1)):
            t.grow([0], row[None], self.head.target_ids, branching)
        node_out = [{0: root_out[i]} for i in range(len(active))]
        while True:
            growing = [i for i, t in enumerate(trees) if t.frontier]
            if not growing:
                break
            tree_entries, rows_in, newest = [], [], []
            for i in growing:
                t, (seq, _, _) = trees[i], active[i]
                tree_entries.append(
                    ForwardEntry(
                        t.tokens, roots[i], self.block_table(seq.seq_id), len(t.frontier), tree=t.parents
                    )
                )
                rows_in.append(root_in[i][None])
                rows_in.extend(node_out[i][p][None] for p in t.parents[1:])
                newest.append(t.frontier)
            logits, out = self.head.forward(self.runner, tree_entries, torch.cat(rows_in))
            at = 0
            for i, nodes in zip(growing, newest):
                n = len(nodes)
                for j, node in enumerate(nodes):
                    node_out[i][node] = out[at + j]
                trees[i].grow(nodes, logits[at : at + n].log_softmax(dim=-1), self.head.target_ids, branching)
                at += n
        self._caught_up(active)
        for (seq, _, _), t in zip(active, trees):
            drafts[seq.seq_id] = Draft(t.tokens[1:], t.parents)
        return drafts

    def tree_accepted(self, seq: Sequence, path: tuple[int, ...]) -> None:
        """The target's states of a verified tree were captured in row order from its root's position:
        the accepted path's rows now stand for positions root + depth; the rest are dropped."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            return
        root = seq.num_computed_tokens - state.aux_start
        if not 0 <= root or root + max(path) >= state.aux.shape[0]:
            self._seqs.pop(seq.seq_id)  # states missing: the next draft starts from a fresh catch-up
            return
        rows = state.aux[root + torch.tensor(path)]
        state.aux = torch.cat([state.aux[:root], rows])

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Nothing to undo: the head's K/V past the verified tokens is rewritten by the next catch-up, in
        the target's blocks, which the scheduler has already truncated."""

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
