"""Hidden-state capture (models/llama.py: Capture) against HF transformers' output_hidden_states, through
the Python loop and the chained layers, over the step shapes a server runs: prefill chunks, decodes, verify
rows."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM
from specserve.engine.model_runner import ForwardEntry, ModelRunner

BLOCK = 16
LAYERS = (2, 4, 5)  # EAGLE-3's defaults for 8 layers: (2, 8 // 2, 8 - 3)
# each step's (sequence, start, tokens, captured)
STEPS = [
    [(0, 0, 21, True), (1, 0, 7, False)],
    [(0, 21, 1, True), (1, 7, 5, True)],
    [(0, 22, 4, True), (1, 12, 1, False)],
    [(1, 13, 9, True)],
]


def _hf_hidden(path, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return tuple(h[0] for h in out.hidden_states)


@pytest.mark.parametrize("chained", [False, True], ids=["loop", "chain"])
def test_captured_states_equal_hf_hidden_states(tiny_model_factory, chained):
    path = tiny_model_factory("llama_8l_hd64")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=8)
    model = llm.engine.model
    if chained and not model.chain_runs:
        pytest.skip("the library's chain does not run this model here")
    if not chained:
        model.chain_runs = []
    generator = torch.Generator().manual_seed(0)
    seqs = {s: torch.randint(0, model.cfg.vocab_size, (40,), generator=generator).tolist() for s in (0, 1)}
    refs = {s: _hf_hidden(path, seqs[s]) for s in seqs}
    runner = ModelRunner(model, 8, BLOCK)
    tables = {0: [0, 1], 1: [2, 3]}
    plain = ModelRunner(model, 8, BLOCK)
    for step in STEPS:
        entries = [
            ForwardEntry(seqs[s][start : start + n], start, tables[s], 1, capture)
            for s, start, n, capture in step
        ]
        logits, aux = runner.run_capturing(entries, LAYERS)
        captured = [(s, start, n) for s, start, n, capture in step if capture]
        assert aux.shape == (sum(n for _, _, n in captured), len(LAYERS) * model.cfg.hidden_size)
        at = 0
        for s, start, n in captured:
            want = torch.cat([refs[s][i][start : start + n] for i in LAYERS], dim=-1)
            # float32 through other kernels than HF's: the last bits differ as the stream grows
            torch.testing.assert_close(aux[at : at + n], want, rtol=1e-3, atol=1e-3)
            at += n
        # a capturing step's own output is the plain forward's, bit for bit
        assert torch.equal(logits, plain.run(entries))


def test_capture_refuses_layers_past_the_model(tiny_model_factory):
    llm = LLM(str(tiny_model_factory("llama_8l_hd64")), dtype="float32", num_kv_blocks=8)
    runner = ModelRunner(llm.engine.model, 8, BLOCK)
    with pytest.raises(ValueError, match=r"capture layers \(2, 9\)"):
        runner.run_capturing([ForwardEntry([1, 2, 3], 0, [0], 1, True)], (2, 9))
