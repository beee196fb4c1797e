"""The sampler's nucleus (temperature, min_p, top-k, top-p without sorting the vocabulary) against a plain
sort-based reference, and its one-uniform draws against the distribution they claim."""

from __future__ import annotations

import pytest
import torch

from specserve.engine.sampler import CANDIDATE_WIDTHS, RowParams, nucleus, probabilities, sample
from specserve.engine.sampling_params import SamplingParams


def reference(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """vLLM's order on one row, by sorting: temperature, min_p, top-k, then top-p over the top-k tokens."""
    probs = (logits.double() / p.temperature).softmax(-1)
    if p.min_p:
        probs = torch.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs = probs / probs.sum()
    vals, order = probs.sort(descending=True)
    keep = vals > 0
    if p.top_k:
        keep &= torch.arange(len(vals)) < p.top_k
    vals = vals * keep
    if p.top_p < 1.0:
        share = vals / vals.sum()
        keep &= (share.cumsum(0) - share) < p.top_p
    vals = vals * keep
    return torch.zeros_like(probs).scatter_(0, order, vals / vals.sum())


CASES = [
    SamplingParams(temperature=0.7, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.05, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=3000, top_p=0.999),  # a top-k wider than the first candidates
    SamplingParams(temperature=1.0),  # the whole vocabulary
]


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat rows need wider candidates, or the full sort
def test_nucleus_equals_the_sorting_reference(scale: float) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 5000
    logits = torch.randn(len(CASES), vocab, generator=gen) * scale
    for rows in (CASES, CASES[:-1]):  # with a whole-vocabulary row (dense form) and without (narrow form)
        got = probabilities(logits[: len(rows)], RowParams.build(rows, [0] * len(rows), vocab))
        for i, p in enumerate(rows):
            want = reference(logits[i], p).float()
            # the same support but for a token that float rounding puts on either side of the top-p cut
            assert ((got[i] > 0) != (want > 0)).sum() <= 1
            torch.testing.assert_close(got[i], want, atol=2e-3, rtol=0)


def test_flat_rows_fall_back_past_the_candidate_widths() -> None:
    vocab = 4 * CANDIDATE_WIDTHS[-1]
    logits = torch.zeros(1, vocab)  # uniform: top_p 0.9 keeps 90 % of the vocabulary
    params = SamplingParams(temperature=1.0, top_p=0.9)
    n = nucleus(logits, RowParams.build([params], [0], vocab))
    assert int((n.probs > 0).sum()) == pytest.approx(0.9 * vocab, abs=2)


def test_draws_follow_the_distribution_and_do_not_depend_on_the_form() -> None:
    vocab = 300
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1)) * 2
    narrow = SamplingParams(temperature=0.8, top_p=0.9)
    rows = RowParams.build([narrow], [0], vocab)
    want = probabilities(logits, rows)[0]
    n = 100_000
    # n requests with seeds 0..n-1 at one position: one draw each from the distribution
    tokens = sample(logits.expand(n, vocab), RowParams.build([narrow] * n, list(range(n)), vocab), [5] * n)
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert freq[want == 0].sum() == 0
    assert (freq - want).abs().max() < 0.01
    # and one request's draws over n positions
    tokens = sample(logits.expand(n, vocab), RowParams.build([narrow] * n, [7] * n, vocab), list(range(n)))
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert (freq - want).abs().max() < 0.01
    # a seeded row draws the same token alone (narrow form) and beside a whole-vocabulary row (dense form)
    for seed in range(20):
        alone = sample(logits, RowParams.build([narrow], [seed], vocab), [3])
        mates = [narrow, SamplingParams(temperature=1.0)]
        beside = sample(logits.expand(2, vocab), RowParams.build(mates, [seed, 99], vocab), [3, 8])
        assert int(alone[0]) == int(beside[0])


def test_position_uniforms_are_uniform_and_keyed_by_seed_and_position() -> None:
    from specserve.engine.sampler import position_uniforms
    from specserve.engine.sampling_params import SEED_RANGE

    n = 200_000
    u = position_uniforms([3] * n, list(range(n)))
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    # every 1/100 bucket within 5 standard deviations of its count
    counts = torch.bincount((u * 100).long(), minlength=100).double()
    assert float((counts - n / 100).abs().max()) < 5 * (n / 100) ** 0.5
    # neighbouring positions and neighbouring seeds are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01
    by_seed = position_uniforms(list(range(n)), [10] * n)
    assert abs(float(torch.corrcoef(torch.stack([by_seed[:-1], by_seed[1:]]))[0, 1])) < 0.01
    # the whole seed range takes (a negative seed is its 64-bit word, not an error)
    ends = position_uniforms([SEED_RANGE[0], -1, SEED_RANGE[1]], [0, 0, 0])
    assert ((ends >= 0) & (ends < 1)).all() and ends[1] == ends[2]


def test_token_zero_keeps_its_mass_when_cut_rows_end_at_different_widths() -> None:
    """Rows cut at 64 candidates are padded with token 0 at mass 0 beside a row that needed the full sort;
    the dense form must not let that padding overwrite a real token 0 (SmolLM2's end of text)."""
    vocab = 5000
    peaked = torch.full((vocab,), -12.0)
    peaked[:10] = torch.linspace(3, 2, 10)  # token 0 the most likely
    flat = torch.zeros(vocab)  # top_p 0.9 over a flat row: past every candidate width
    rows = [SamplingParams(temperature=1.0, top_p=0.9)] * 2 + [SamplingParams(temperature=1.0)]
    logits = torch.stack([peaked, flat, flat])
    got = probabilities(logits, RowParams.build(rows, [0] * 3, vocab))
    torch.testing.assert_close(got[0], reference(peaked, rows[0]).float(), atol=1e-6, rtol=0)


def test_tokens_tied_with_the_kth_stay() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 1.0] + [0.0] * 200])
    got = probabilities(logits, RowParams.build([SamplingParams(top_k=3)], [0], logits.shape[1]))
    assert (got[0] > 0).tolist()[:6] == [True, True, True, True, True, False]


def test_a_verified_position_takes_the_token_sampling_gives_there() -> None:
    """Row 0 proposes one draft; its mate 1 or 4, which makes the step's padded width K 1 or 4. Whatever
    the width and whatever row 0 drafted, its tokens are those sample() gives at the same positions."""
    from specserve.spec.verifier import VerifyBatch, verify

    vocab, gen = 40, torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, vocab, generator=gen)
    params = [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=1.0)]
    for seed in range(30):
        drafts = torch.randint(0, vocab, (2, 4), generator=torch.Generator().manual_seed(seed))
        one = RowParams.build(params[:1], [seed], vocab)
        plain = [int(sample(logits[0, j : j + 1], one, [20 + j])[0]) for j in range(2)]
        drafts[0, 0] = plain[0] if seed % 2 else drafts[0, 0]  # half the rows accept their draft
        out = []
        for k in (1, 4):
            rows = RowParams.build(params, [seed, 0], vocab)
            batch = VerifyBatch(logits[:, : k + 1], drafts[:, :k], torch.tensor([1, k]), rows, [20, 31])
            result = verify(batch)
            a = int(result.num_accepted[0])
            out.append([*drafts[0, :a].tolist(), int(result.next_token[0])])
        assert out[0] == out[1] == plain[: len(out[0])]


def test_verify_reads_the_packed_logits_as_the_padded_ones() -> None:
    """Rows drafting 0, 3 and 1 tokens: the forward's packed rows (through `index`) and a padded
    [S, K + 1, V] copy give the same tokens for the same seeds; only the real positions are sampled from."""
    from specserve.spec.verifier import VerifyBatch, verify

    vocab, counts = 50, [0, 3, 1]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        packed = torch.randn(sum(counts) + len(counts), vocab, generator=gen) * 2
        drafts = torch.randint(0, vocab, (3, 3), generator=gen)
        starts = [0, 1, 5]
        index = torch.tensor([[min(s + j, s + c) for j in range(4)] for s, c in zip(starts, counts)])
        for r, c in enumerate(counts):  # make some drafts likely enough to be accepted
            for j in range(c):
                packed[starts[r] + j, drafts[r, j]] += 3.0
        padded = packed[index]
        padded[0, 1:] = float("nan")  # padding positions must never be read
        out = []
        for logits, idx in ((packed, index), (padded, None)):
            params = [SamplingParams(temperature=0.8, seed=seed + r) for r in range(3)]
            rows = RowParams.build(params, [seed + r for r in range(3)], vocab)
            num = torch.tensor(counts)
            result = verify(VerifyBatch(logits, drafts, num, rows, [4, 9, 17], idx))
            out.append((result.num_accepted.tolist(), result.next_token.tolist()))
        assert out[0] == out[1]
