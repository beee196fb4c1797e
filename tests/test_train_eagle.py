"""tools/train_eagle.py on a tiny random target: it answers, trains a few steps, resumes, and writes a head
that loads in speculators' layout and fits the target; its prompts never come from the standard library."""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from test_eagle3_head import CFG

from specserve.spec.eagle3.head import Eagle3Config, check_target, load_eagle3, random_eagle3

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import train_eagle  # noqa: E402
from eagle3_train import answers as answers_mod  # noqa: E402
from eagle3_train import features as features_mod  # noqa: E402
from eagle3_train import prompts as prompts_mod  # noqa: E402


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
        "--target", str(target), "--out", str(out), "--device", "cpu",
        "--num-prompts", "20", "--prompt-scan-s", "2", "--in-flight", "8", "--max-new-tokens", "12",
        "--sampled-fraction", "0.5",
        "--layer-ids", "1,2,3", "--min-vocab", "512", "--max-vocab", "1024",
        "--ttt-steps", "3", "--k", "3", "--batch-tokens", "256", "--feature-batch-tokens", "256",
        "--max-steps", str(steps), "--time-budget-min", "5", "--eval-reserve-min", "0", "--threads", "2",
        "--dtype", "float32",  # the engine's greedy answers compared with HF's in float32
    ]  # fmt: skip


@pytest.mark.slow
def test_trains_resumes_and_writes_a_loadable_head(tiny_target, tmp_path):
    """The whole CPU flow on a tiny target: prompts exported and read back, answers from specserve's
    engine, features once, training, the held-out figure, a head that loads; --resume reuses the answers
    and the features and carries the step count on; a head past --max-file-mib is sharded."""
    target, model = tiny_target
    prompts = tmp_path / "prompts.jsonl"
    assert train_eagle.main([*_argv(target, tmp_path / "unused", 0), "--export-prompts", str(prompts)])
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == 20 and [r["holdout"] for r in rows] == [i % 10 == 0 for i in range(20)]
    assert not (tmp_path / "unused").exists()

    out = tmp_path / "head"
    report = train_eagle.main([*_argv(target, out, steps=3), "--prompts", str(prompts)])
    assert report["train_steps"] == 3
    assert report["answers"] == 20 and report["answer_tokens"] > 0
    answers = [
        json.loads(line) for line in (tmp_path / "head-work" / "answers.jsonl").read_text().splitlines()
    ]
    assert sorted(a["index"] for a in answers) == list(range(20))
    assert all(a["greedy"] for a in answers if a["holdout"]) and not all(a["greedy"] for a in answers)
    tok = train_eagle.load_target(target, "cpu", torch.float32)[1]
    for a in answers:  # the engine's answers are the target's: greedy ones equal HF's greedy decoding
        assert a["prompt_ids"] == answers_mod.chat_ids(tok, rows[a["index"]]["messages"][0]["content"])
        assert 0 < len(a["answer_ids"]) <= 12
    greedy = next(a for a in answers if a["greedy"])
    want = model.generate(
        torch.tensor([greedy["prompt_ids"]]), max_new_tokens=12, do_sample=False, pad_token_id=0
    )[0, len(greedy["prompt_ids"]) :].tolist()
    assert greedy["answer_ids"] == want[: len(greedy["answer_ids"])]

    report_file = json.loads((out / "eval.json").read_text())
    assert set(report_file["phases"]) == {"prompts", "answers", "features", "training", "eval"}
    for k in (4, 6):
        figure = report["heldout"][f"k{k}"]
        assert figure["rows"] > 0 and figure["k"] == k
        assert all(0.0 <= a <= 1.0 for a in figure["acceptance_per_position"])
        through = figure["accepted_through_position"]
        assert all(a >= b for a, b in zip(through, through[1:]))  # accepting draft j needs 1..j-1
        assert figure["mean_acceptance_length"] == pytest.approx(1.0 + sum(through), abs=1e-3)
        assert report_file["heldout"][f"k{k}"] == figure

    cfg = Eagle3Config.from_dir(out)
    assert cfg.target_layer_ids == (1, 2, 3) and cfg.speculative_tokens == 3
    check_target(cfg, num_layers=4, hidden_size=64, vocab_size=model.config.vocab_size)
    head = load_eagle3(out, target_embed=model.get_input_embeddings().weight.detach())
    assert 512 <= cfg.draft_vocab_size <= 1024 and int(head.t2d.sum()) == cfg.draft_vocab_size
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)

    # --resume continues the same run: answers and features on disk are reused, the step count carries on
    work = tmp_path / "head-work"
    assert sorted(f.name for f in out.iterdir()) == ["config.json", "eval.json", "model.safetensors"]
    kept = {p: p.stat().st_mtime_ns for p in [work / "answers.jsonl", *(work / "features").glob("*.pt")]}
    with pytest.raises(SystemExit, match="--resume"):
        train_eagle.main(_argv(target, out, steps=5))
    report = train_eagle.main([*_argv(target, out, steps=5), "--prompts", str(prompts), "--resume"])
    assert report["train_steps"] == 5
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    resumed = load_eagle3(out, target_embed=model.get_input_embeddings().weight.detach())

    # the same head under a 0.1 MiB file limit: shards and an index, each file under it, loading equal
    small = tmp_path / "sharded"
    files = train_eagle.save_head(resumed, small, "tiny", with_embed=False, max_file_bytes=100_000)
    assert len(files) > 1 and all(f.stat().st_size <= 100_000 for f in files)
    index = json.loads((small / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in files}
    again = load_eagle3(small, target_embed=model.get_input_embeddings().weight.detach())
    for (n, a), b in zip(resumed.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), n


def test_a_prompts_file_round_trips_and_bad_lines_are_refused_by_number(tmp_path):
    prompts = [train_eagle.Prompt("What is a kite?", True), train_eagle.Prompt("Write me a poem.", False)]
    path = tmp_path / "p.jsonl"
    train_eagle.write_prompts(path, prompts)
    assert train_eagle.read_prompts(path) == prompts
    path.write_text(path.read_text() + '{"messages": [{"role": "system", "content": "x"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:3: messages"):
        train_eagle.read_prompts(path)


def test_prompts_come_from_installed_packages_not_the_stdlib():
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = prompts_mod._package_roots()
    assert roots and all(r != stdlib for r in roots)
    files = prompts_mod._text_files(roots)
    assert files and not any(stdlib in f.parents and "site-packages" not in f.parts for f in files)
    prompts = train_eagle.build_prompts(12, seed=0, scan_s=2)
    assert len({p.text for p in prompts}) == 12
    assert [p.holdout for p in prompts] == [i % 10 == 0 for i in range(12)]
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


def test_the_chain_loss_compares_each_draft_with_the_target_at_the_position_it_drafts():
    """ttt_loss against the same loss written out: step s at row i drafts the token at i + s + 2, so it
    meets the target's distribution at position i + s + 1, counted where that token is an answer token."""
    cfg = CFG
    head = random_eagle3(cfg, seed=11)
    g = torch.Generator().manual_seed(12)
    vd, steps, decay = cfg.draft_vocab_size, 3, 0.8
    lm_rows = torch.randn(vd, 5, generator=g)
    samples = []
    for n, prompt_len in ((14, 7), (11, 9), (9, 6)):
        samples.append(
            train_eagle.Sample(
                tokens=torch.randint(0, cfg.target_vocab_size, (n,), generator=g),
                prompt_len=prompt_len,
                aux=torch.randn(n, 3 * cfg.target_hidden_size, generator=g).bfloat16(),
                last=torch.randn(n, 5, generator=g).bfloat16(),
                greedy_next=head.draft_to_target(torch.randint(0, vd, (n,), generator=g)),
                greedy=True,
                holdout=False,
            )
        )
    batch = train_eagle.collate(samples, head, max_len=64)
    with torch.no_grad():
        loss, agree = train_eagle.ttt_loss(head, lm_rows, batch, steps, decay)
        ids, aux, positions = batch[0], batch[1], batch[2]
        chain = head.forward_chain(ids, head.fuse(aux.float()), positions, steps)
    want_loss, want_agree = 0.0, []
    for s in range(steps):
        ce, hits, count = 0.0, 0, 0
        for r, smp in enumerate(samples):
            n = len(smp.tokens)
            for i in range(n - 1):
                if i + s + 2 < n and i + s + 2 >= smp.prompt_len:
                    p = (smp.last[i + s + 1].float() @ lm_rows.T).softmax(-1)
                    ce += float(-(p * chain[s][r, i].log_softmax(-1)).sum())
                    want = int(
                        (head.draft_to_target(torch.arange(vd)) == smp.greedy_next[i + s + 1]).nonzero()
                    )
                    hits += int(chain[s][r, i].argmax()) == want
                    count += 1
        want_loss += decay**s * ce / count
        want_agree.append(hits / count)
    assert float(loss) == pytest.approx(want_loss, rel=1e-4)
    assert agree == pytest.approx(want_agree)


def test_the_heldout_figure_is_chain_drafting_with_the_dense_forward():
    """evaluate() against drafting written out with forward_dense: from each answer position, k greedy
    drafts, each fed the one before and its hidden_out, accepted while they equal the continuation. The
    answer is the head's own step-0 prediction, so first drafts are accepted and later ones vary."""
    head = random_eagle3(CFG, seed=13)
    g = torch.Generator().manual_seed(14)
    n, prompt_len, k = 16, 5, 3
    aux = torch.randn(n, 3 * CFG.target_hidden_size, generator=g).bfloat16()
    fused = head.fuse(aux.float())[None]
    tokens = torch.randint(0, CFG.target_vocab_size, (n,), generator=g)
    with torch.no_grad():
        for i in range(prompt_len - 2, n - 2):  # token i + 2 is the head's argmax at row i
            logits, _ = head.forward_dense(
                tokens[None, 1 : i + 2], fused[:, : i + 1], torch.arange(i + 1)[None]
            )
            tokens[i + 2] = head.draft_to_target(logits[0, -1].argmax())
    greedy_next = torch.cat([tokens[1:], tokens[:1]])
    sample = train_eagle.Sample(tokens, prompt_len, aux, torch.zeros(n, 1), greedy_next, True, True)
    with torch.no_grad():
        figure = train_eagle.evaluate(head, [sample], k, max_len=64)

    accepted, rows = [0] * k, 0
    with torch.no_grad():
        for i in range(prompt_len - 1, n - 1 - k):  # the target's token i + 1 is an answer token
            ids, hid, pos = tokens[None, 1 : i + 2], fused[:, : i + 1], torch.arange(i + 1)[None]
            ok = True
            for j in range(k):
                logits, out = head.forward_dense(ids, hid, pos)
                draft = head.draft_to_target(logits[0, -1].argmax())
                ok = ok and int(draft) == int(tokens[i + j + 2])
                accepted[j] += ok
                ids = torch.cat([ids, draft.view(1, 1)], dim=1)
                hid = torch.cat([hid, out[:, -1:]], dim=1)
                pos = torch.arange(ids.shape[1])[None]
            rows += 1
    assert figure["rows"] == rows
    assert figure["accepted_through_position"] == pytest.approx([a / rows for a in accepted], abs=1e-4)
    assert figure["accepted_through_position"][0] == 1.0
    assert figure["mean_acceptance_length"] == pytest.approx(1 + sum(accepted) / rows, abs=1e-3)


@pytest.mark.slow
def test_hf_answers_in_left_padded_batches_equal_one_prompt_at_a_time(tiny_target, tmp_path):
    """The CUDA path's answerer (run here on the CPU): greedy answers from a left-padded batch of prompts
    of different lengths equal each prompt decoded alone; held-out prompts are never sampled."""
    target, model = tiny_target
    tok = train_eagle.load_target(target, "cpu", torch.float32)[1]
    texts = ["Hi.", "What is a kite? Explain it simply.", "Write a short poem about rain on a tin roof."]
    prompts = [train_eagle.Prompt(t, i == 0) for i, t in enumerate(texts * 2)]
    cache = answers_mod.AnswerCache(tmp_path / "answers.jsonl")
    answers_mod.answer_with_hf(
        model, tok, prompts, list(range(6)), cache, float("inf"),
        batch=4, max_tokens=10, temperature=0.7, sampled_fraction=0.5, seed=3,
    )  # fmt: skip
    cache.close()
    got = answers_mod.AnswerCache(tmp_path / "answers.jsonl").ordered()
    assert [a.index for a in got] == list(range(6)) and got[0].greedy
    assert any(not a.greedy for a in got)
    for a in got:
        assert a.prompt_ids == answers_mod.chat_ids(tok, prompts[a.index].text)
        if a.greedy:
            alone = model.generate(
                torch.tensor([a.prompt_ids]), max_new_tokens=10, do_sample=False, pad_token_id=0
            )[0, len(a.prompt_ids) :].tolist()
            assert a.answer_ids == alone[: len(a.answer_ids)]


@pytest.mark.slow
def test_features_are_the_targets_hidden_states_computed_once(tiny_target, tmp_path):
    """Each answer's features equal HF's own forward of it alone (aux layers, the final normed state, the
    argmax); shards on disk are read back, not recomputed; a deadline already past still yields one
    training and one held-out answer."""
    _, model = tiny_target
    g = torch.Generator().manual_seed(5)
    answers = [
        answers_mod.Answer(
            i, torch.randint(0, 1000, (4 + i,), generator=g).tolist(),
            torch.randint(0, 1000, (3 + 2 * i,), generator=g).tolist(), True, i % 3 == 0,
        )
        for i in range(6)
    ]  # fmt: skip
    shards = tmp_path / "features"
    first = features_mod.compute_features(
        model, (1, 2, 3), answers, deadline=0.0, batch_tokens=32, shard_dir=shards
    )
    assert {s.holdout for s in first} == {True, False} and len(first) < len(answers)
    calls = []
    samples = features_mod.compute_features(
        model, (1, 2, 3), answers, float("inf"), batch_tokens=32, shard_dir=shards,
        on_batch=lambda n, tokens: calls.append(n),
    )  # fmt: skip
    assert sum(calls) == len(answers) - len(first)  # only the answers without a shard
    assert len(samples) == len(answers) and len(list(shards.glob("*.pt"))) > 1
    by_tokens = {tuple(s.tokens.tolist()): s for s in samples}
    with torch.no_grad():
        for a in answers:
            s = by_tokens[tuple(a.prompt_ids + a.answer_ids)]
            assert s.prompt_len == len(a.prompt_ids) and s.holdout == a.holdout
            out = model(torch.tensor([a.prompt_ids + a.answer_ids]), output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i][0] for i in (1, 2, 3)], -1)
            torch.testing.assert_close(s.aux.float(), aux, atol=2e-2, rtol=1e-2)
            want_last = model.model(torch.tensor([a.prompt_ids + a.answer_ids])).last_hidden_state[0]
            torch.testing.assert_close(s.last.float(), want_last, atol=2e-2, rtol=1e-2)
            assert torch.equal(s.greedy_next, out.logits[0].argmax(-1))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where torch sees no CUDA device")
def test_bad_flags_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit, match="--device cuda"):
        train_eagle.main(["--device", "cuda", "--out", str(tmp_path / "h")])
    for argv, field in (
        (["--device", "cuda", "--answerer", "engine", "--out", "x"], "--answerer engine"),
        (["--gen-share", "0.6", "--feature-share", "0.5", "--out", "x"], "--gen-share"),
        ([], "--out"),
    ):
        with pytest.raises(SystemExit):
            train_eagle.parse_args(argv)
        assert field in capsys.readouterr().err
