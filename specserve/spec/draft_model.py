"""Draft-model proposer: a small Llama-family model with its own paged KV cache proposes k tokens.

Per engine step it runs k batched forwards over every speculating sequence: the first also catches the
draft cache up on tokens it has not seen (the prompt on first use, then the accepted tokens and bonus token
of the last verification), the rest feed back the token just drafted. After verification the draft cache is
truncated to the tokens that survived, like the target's. With prefix caching the draft cache shares
prefixes the same way: a sequence's first catch-up starts after its longest cached prefix, and the blocks
its committed tokens fill are named after each proposal.
"""

from __future__ import annotations

from specserve.blockmgr import BlockManager
from specserve.engine.model_runner import ForwardEntry, ModelRunner
from specserve.engine.sampler import RowParams, sample
from specserve.engine.sequence import Sequence
from specserve.models.llama import LlamaModel
from specserve.spec.proposer import Draft


class DraftModelProposer:
    def __init__(
        self, model: LlamaModel, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        self.model = model
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.num_cached: dict[int, int] = {}  # seq_id -> tokens whose K/V the draft cache holds

    def propose(self, requests: list[tuple[Sequence, int]]) -> dict[int, Draft]:
        active: list[tuple[Sequence, int]] = []
        drafts: dict[int, Draft] = {}
        for seq, k in requests:
            if seq.seq_id not in self.block_manager.tables:  # first use: start after a cached prefix
                self.num_cached[seq.seq_id] = self.block_manager.allocate_prefix(seq.seq_id, seq.token_ids)
            # room for every token plus the k-1 drafts whose K/V the later forwards write
            if self.block_manager.ensure(seq.seq_id, seq.num_tokens + k - 1):
                active.append((seq, k))
            else:
                drafts[seq.seq_id] = Draft([])
        if not active:
            return drafts
        proposed: dict[int, list[int]] = {seq.seq_id: [] for seq, _ in active}
        rows_all = RowParams.build(
            [seq.params for seq, _ in active], [seq.seed for seq, _ in active], self.model.cfg.vocab_size
        )
        for step in range(max(k for _, k in active)):
            idx = [i for i, (_, k) in enumerate(active) if k > step]
            entries = []
            for i in idx:
                seq = active[i][0]
                if step == 0:
                    start = self.num_cached.get(seq.seq_id, 0)
                    tokens = seq.token_ids[start:]
                else:
                    start = seq.num_tokens + step - 1
                    tokens = [proposed[seq.seq_id][-1]]
                entries.append(ForwardEntry(tokens, start, self.block_manager.block_table(seq.seq_id), 1))
            logits = self.runner.run(entries)
            # at the uniform the target's token at that position is drawn with: verification then accepts
            # the draft wherever the two distributions put that uniform on the same token
            positions = [active[i][0].num_tokens + step for i in idx]
            tokens_out = sample(logits, rows_all.select(idx), positions).tolist()
            for j, i in enumerate(idx):
                proposed[active[i][0].seq_id].append(tokens_out[j])
        for seq, k in active:
            # step 0 wrote every committed token's K/V: their full blocks can be shared
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_tokens)
            self.num_cached[seq.seq_id] = seq.num_tokens + k - 1
            drafts[seq.seq_id] = Draft(proposed[seq.seq_id])
        return drafts

    def accepted(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        """Keep the draft K/V of the tokens that survived: the old tokens plus the accepted drafts."""
        if seq.seq_id not in self.num_cached or not num_proposed:
            return
        # seq.token_ids now ends with the accepted drafts and the bonus token; the draft cache has K/V up to
        # (old length + num_proposed - 1), of which the first (old length + num_accepted) are right.
        old_len = seq.num_tokens - num_accepted - 1
        keep = old_len + min(num_accepted, num_proposed - 1)
        self.num_cached[seq.seq_id] = keep
        self.block_manager.truncate(seq.seq_id, keep)

    def forget(self, seq: Sequence) -> None:
        self.num_cached.pop(seq.seq_id, None)
        self.block_manager.free(seq.seq_id)
