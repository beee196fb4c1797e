"""tools/train_eagle.py on a tiny random target: it answers, trains a few steps, resumes, and writes a head
that loads in speculators' layout and fits the target; its prompts never come from the standard library."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from specserve.spec.eagle3.head import Eagle3Config, check_target, load_eagle3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_eagle  # noqa: E402


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory, demo_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(demo_tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        bos_token_id=demo_tokenizer.bos_token_id,
        eos_token_id=demo_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.15)  # varied answers rather than one token repeated
    out = tmp_path_factory.mktemp("tiny_target")
    model.save_pretrained(out)
    demo_tokenizer.save_pretrained(out)
    return out, model


def _argv(target: Path, out: Path, steps: int) -> list[str]:
    return [
        "--target", str(target), "--out", str(out),
        "--num-prompts", "10", "--prompt-scan-s", "2", "--gen-batch", "5", "--max-new-tokens", "12",
        "--layer-ids", "1,2,3", "--min-vocab", "512", "--max-vocab", "1024",
        "--ttt-steps", "3", "--k", "3", "--batch-tokens", "256", "--max-steps", str(steps),
        "--time-budget-min", "5", "--eval-reserve-min", "0", "--threads", "2",
    ]  # fmt: skip


def test_trains_resumes_and_writes_a_loadable_head(tiny_target, tmp_path):
    target, model = tiny_target
    out = tmp_path / "head"
    report = train_eagle.main(_argv(target, out, steps=3))
    assert report["train_steps"] == 3
    assert report["answers"] == 10 and report["answer_tokens"] > 0
    figure = report["heldout"]
    assert figure["rows"] > 0 and figure["k"] == 3
    assert all(0.0 <= a <= 1.0 for a in figure["acceptance_per_position"])
    through = figure["accepted_through_position"]
    assert all(a >= b for a, b in zip(through, through[1:]))  # accepting draft j needs drafts 1..j-1
    assert figure["mean_acceptance_length"] == pytest.approx(1.0 + sum(through), abs=1e-3)
    assert json.loads((out / "train_report.json").read_text())["heldout"] == figure

    cfg = Eagle3Config.from_dir(out)
    assert cfg.target_layer_ids == (1, 2, 3) and cfg.speculative_tokens == 3
    check_target(cfg, num_layers=4, hidden_size=64, vocab_size=model.config.vocab_size)
    head = load_eagle3(out, target_embed=model.get_input_embeddings().weight.detach())
    assert 512 <= cfg.draft_vocab_size <= 1024 and int(head.t2d.sum()) == cfg.draft_vocab_size
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)

    # --resume continues the same run: the answers on disk are reused and the step count carries on
    shards = {p: p.stat().st_mtime_ns for p in (out / "work" / "samples").glob("shard_*.pt")}
    with pytest.raises(SystemExit, match="--resume"):
        train_eagle.main(_argv(target, out, steps=5))
    report = train_eagle.main([*_argv(target, out, steps=5), "--resume"])
    assert report["train_steps"] == 5
    assert {p: p.stat().st_mtime_ns for p in (out / "work" / "samples").glob("shard_*.pt")} == shards


def test_prompts_come_from_installed_packages_not_the_stdlib():
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = train_eagle._package_roots()
    assert roots and all(r != stdlib for r in roots)
    files = train_eagle._text_files(roots)
    assert files and not any(stdlib in f.parents and "site-packages" not in f.parts for f in files)
    prompts = train_eagle.build_prompts(12, seed=0, scan_s=2)
    assert len(prompts) == len(set(prompts)) == 12
    assert prompts == train_eagle.build_prompts(12, seed=0, scan_s=2)  # the held-out split is stable


def _sample(tokens: list[int], prompt_len: int, holdout: bool = False) -> train_eagle.Sample:
    n = len(tokens)
    return train_eagle.Sample(
        tokens=torch.tensor(tokens),
        prompt_len=prompt_len,
        aux=torch.zeros(n, 3),
        last=torch.zeros(n, 1),
        greedy_next=torch.zeros(n, dtype=torch.long),
        greedy=True,
        holdout=holdout,
    )


@pytest.mark.parametrize(
    "coverage, lo, hi, expected, covered",
    [
        (0.5, 1, 10, [5], 0.5),  # token 5 is half of the answers
        (0.8, 1, 10, [5, 6], 0.8),
        (0.99, 1, 10, [5, 6, 7], 1.0),
        (0.99, 1, 2, [5, 6], 0.8),  # capped
        (0.5, 4, 10, [0, 5, 6, 7], 1.0),  # past the tokens seen: the lowest unused ids
    ],
)
def test_draft_vocabulary_is_the_most_frequent_answer_tokens(coverage, lo, hi, expected, covered):
    # answers (after the 2-token prompt): token 5 x5, 6 x3, 7 x2; the prompt's token 9 never counts
    samples = [
        _sample([9, 9, 5, 5, 5, 6, 6], 2),
        _sample([9, 9, 5, 5, 6, 7, 7], 2),
        _sample([9, 9, 8], 2, True),
    ]
    ids, table = train_eagle.choose_vocab(samples, 12, coverage, lo, hi)
    assert ids.tolist() == expected
    assert table[len(expected)] == {"train": covered, "heldout": 0.0}  # the held-out answer is token 8
