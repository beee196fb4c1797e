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
    ) -> None:
        self.head = head
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
        drafts: dict[int, Draft] = {}
        active: list[tuple[Sequence, int, _Seq]] = []
        for seq, k in requests:
            state = self._seqs.get(seq.seq_id)
            # the catch-up needs the target's states of every position from `cached` to N - 2
            if (
                state is None
                or k < 1
                or state.cached >= seq.num_tokens - 1  # nothing new since it last drafted
                or state.aux_start + state.aux.shape[0] < seq.num_tokens - 1
            ):
                drafts[seq.seq_id] = Draft([])
            else:
                active.append((seq, k, state))
        if not active:
            return drafts
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
        for seq, _, state in active:
            # the catch-up wrote every position up to N - 2: its states are no longer needed
            end = seq.num_tokens - 1
            state.aux = state.aux[end - state.aux_start :]
            state.cached = state.aux_start = end
            drafts[seq.seq_id] = Draft(proposed[seq.seq_id])
        return drafts

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Nothing to undo: the head's K/V past the verified tokens is rewritten by the next catch-up, in
        the target's blocks, which the scheduler has already truncated."""

    def forget(self, seq: Sequence) -> None:
        self._seqs.pop(seq.seq_id, None)
