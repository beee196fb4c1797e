"""bf16 `auto` on AVX512-BF16 without AMX (Zen 4): a verify step's rows carry the decode steps' very bits, so
greedy speculation a request at a time gives the tokens and logprobs decoding without it gives. Every part of
such a step sums a row as a one-row step does: the int4 layers and the Q8_0 head on 16-output tiles
(linear.OwnInt4TileRowsBf16, OwnInt8GroupedTileRowsBf16), attention's split parts fixed by position
(attention.h: part_starts) and chosen by the step's sequences, not its team of threads. Layers with a
sliding window (Gemma 3) split by the window instead and are not held to it."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams
from specserve.kernels import cpu

# one request's drafts at most: a verify step of 8 rows, the head's tile rows beside its dense copy
DRAFTS = 7
TEXTS = (
    "The quick brown fox jumps over the lazy dog while the farmer counts his sheep in the field. ",
    "def parse(line):\n    key, _, value = line.partition('=')\n    return key.strip(), value.strip()\n",
    "Dear team, the release is moved to Friday; please update the tickets and the changelog. ",
)


def _bf16_tiles() -> None:
    if cpu.build.load() is None or not cpu.build.quant_bf16_fast():
        pytest.skip("the bf16 tile products need AVX512-BF16")
    if cpu.build.int4_rows_amx() or cpu.build.int8_grouped_rows_amx():
        pytest.skip("AMX tiles run the verify rows here, summed in another order than a one-row step")


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_bf16_speculation_a_request_at_a_time_gives_the_tokens_of_decoding(method):
    _bf16_tiles()
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, logprobs=0)
    spec = {"method": method, "num_speculative_tokens": DRAFTS}
    engine = {"dtype": "bfloat16", "quantization": "auto", "max_num_seqs": 1, "num_kv_blocks": 128}
    plain = LLM(None, **engine)
    drafted = LLM(None, **engine, speculative_config=spec)
    # contexts across several of the split's octaves (64, 128, 256, 512 positions)
    prompts = [plain.tokenizer.encode(text * 30)[: 150 + 150 * i] for i, text in enumerate(TEXTS)]

    def tokens(llm: LLM) -> list[list[tuple[int, float]]]:
        outs = [llm.generate([p], params)[0] for p in prompts]
        assert llm is plain or sum(o.usage.draft_accepted for o in outs) > 0
        return [[(t, lp.logprob) for t, lp in zip(o.token_ids, o.logprobs)] for o in outs]

    assert tokens(drafted) == tokens(plain)
