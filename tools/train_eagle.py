"""Train an EAGLE-3 head for a target model by self-distillation, and write it in speculators' format.

    python tools/train_eagle.py --target <HF dir, hub id or .gguf; default the demo SmolLM2> --out <dir>

Four phases, each with its share of --time-budget-min, each cached under --work and resumable:

1. Prompts: open-chat requests built from installed third-party packages' prose, never CPython's standard
   library (eagle3_train/prompts.py), user turns the target writes itself from its chat template
   (eagle3_train/self_prompts.py), or half of each (--prompt-source); or read from --prompts (a file
   --export-prompts wrote, for a machine whose packages differ). Held-out prompts are marked in the file.
2. Answers: the target answers each chat-templated prompt, greedy, a share sampled at --temperature; on
   the CPU through specserve's engine, on CUDA through HF generate in large batches (eagle3_train/answers.py).
3. Features: one target forward per answer records its aux hidden states, its final hidden state and its
   greedy next token (eagle3_train/features.py); shards on disk on the CPU, GPU memory on CUDA.
4. Training from the features only: the head starts from the target, learns the target's next-token
   distribution over the draft vocabulary (the most frequent answer tokens: d2t / t2d) on its own chain of
   --ttt-steps drafts (EAGLE-3's training-time test: Eagle3Head.forward_chain). Then the held-out figure:
   chain drafting (greedy) of k = 4 and k = 6 tokens from every answer position of the held-out answers,
   acceptance per draft position and mean acceptance length, in <out>/eval.json and the log.

Every file written to --out stays under --max-file-mib (the weights sharded HF-style past it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from eagle3_train.answers import AnswerCache, answer_with_engine, answer_with_hf  # noqa: E402
from eagle3_train.features import Sample, compute_features  # noqa: E402
from eagle3_train.prompts import HOLDOUT_EVERY, Prompt, build_prompts, read_prompts, write_prompts  # noqa: E402
from eagle3_train.self_prompts import write_with_engine, write_with_hf  # noqa: E402

from specserve.spec.eagle3.head import (  # noqa: E402
    CONFIG_FILE,
    Eagle3Config,
    Eagle3Head,
    default_layer_ids,
    vocab_maps,
)

EVAL_KS = (4, 6)


# -- progress ---------------------------------------------------------------------------------------------


class _PlainBar:
    def __init__(self, total: int | None, desc: str) -> None:
        self.total, self.desc, self.n, self.last = total, desc, 0, 0.0
        self.postfix = ""

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last > 10:
            self.last = time.monotonic()
            total = f"/{self.total}" if self.total else ""
            print(f"{self.desc}: {self.n}{total} {self.postfix}", file=sys.stderr, flush=True)

    def set_postfix_str(self, s: str) -> None:
        self.postfix = s

    def close(self) -> None:
        self.last = 0.0
        self.update(0)


def progress(total: int | None, desc: str, initial: int = 0):
    try:
        from tqdm import tqdm
    except ImportError:
        bar = _PlainBar(total, desc)
        bar.n = initial
        return bar
    # a log file gets a line every 30 s rather than a carriage-return stream
    return tqdm(total=total, desc=desc, initial=initial, mininterval=0.5 if sys.stderr.isatty() else 30)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- the target -------------------------------------------------------------------------------------------


def target_path(target: str | None) -> Path:
    from specserve.models.loader import demo_model_path
    from specserve.models.loader.resolve import resolve_model

    return demo_model_path() if target is None else resolve_model(target)


def load_target(path: Path, device: str, dtype: torch.dtype):
    """(model eval on `device` in `dtype`, tokenizer) through transformers; a .gguf dequantized to `dtype`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if path.is_file() and path.suffix == ".gguf":
        kwargs = {}
        try:
            from transformers import GgufConfig
        except ImportError:  # transformers before GgufConfig always dequantized a GGUF
            pass
        else:
            # plain dense weights: init_head copies them, and the features' matmuls run in `dtype` rather
            # than through float32 kernels over the packed blocks
            kwargs["quantization_config"] = GgufConfig(gguf_file=path.name, dequantize=True)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    model.to(device).eval().requires_grad_(False)
    return model, tokenizer


def target_dtype(name: str, device: str) -> torch.dtype:
    """`auto`: bf16 on CUDA and on CPUs with native bf16 (the engine's own rule), float32 elsewhere."""
    from specserve.engine.config import EngineConfig

    return EngineConfig(dtype=name).torch_dtype(torch.device(device))


def text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def decoder_layers(model):
    return model.model.layers


# -- the draft vocabulary ---------------------------------------------------------------------------------


def choose_vocab(samples: list[Sample], vocab_size: int, coverage: float, lo: int, hi: int):
    """The most frequent answer tokens of the training split, as many as reach `coverage` of them (within
    [lo, hi]); below `lo` distinct tokens, filled with the lowest unused ids (BPE's earliest merges, its
    most frequent pieces). Returns (sorted target ids, {size: coverage} on train and held-out answers)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    held = torch.zeros(vocab_size, dtype=torch.long)
    for s in samples:
        answer_ids = s.tokens[s.prompt_len :]
        (held if s.holdout else counts).index_add_(0, answer_ids, torch.ones_like(answer_ids))
    seen = int((counts > 0).sum())
    by_count = counts.argsort(descending=True, stable=True)[:seen]
    unused = torch.ones(vocab_size, dtype=torch.bool)
    unused[by_count] = False
    order = torch.cat([by_count, unused.nonzero().flatten()])
    cum = counts[order].cumsum(0).double() / max(1, int(counts.sum()))
    size = int((cum < coverage).sum()) + 1
    size = max(lo, min(hi, size, vocab_size))
    ids = order[:size]
    table = {}
    for n in sorted({1024, 2048, 4096, 8192, 12288, 16384, 24576, 32768, size}):
        if n <= vocab_size:
            table[n] = {
                "train": round(float(counts[order[:n]].sum()) / max(1, int(counts.sum())), 4),
                "heldout": round(float(held[order[:n]].sum()) / max(1, int(held.sum())), 4),
            }
    return ids.sort().values, table


# -- the head ---------------------------------------------------------------------------------------------


def head_config(model, draft_size: int, layer_ids: tuple[int, ...], k: int) -> Eagle3Config:
    c = text_config(model)
    rope = getattr(c, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": getattr(c, "rope_theta", 1e4),
    }
    if "rope_type" not in rope and "full_attention" in rope:  # per-layer-type ropes (Gemma 3): the global one
        rope = rope["full_attention"]
    heads = c.num_attention_heads
    return Eagle3Config(
        hidden_size=c.hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
        intermediate_size=c.intermediate_size,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        draft_vocab_size=draft_size,
        target_vocab_size=c.vocab_size,
        target_hidden_size=c.hidden_size,
        target_layer_ids=tuple(layer_ids),
        hidden_act=getattr(c, "hidden_act", None) or getattr(c, "hidden_activation", None) or "silu",
        rope_parameters=dict(rope),
        speculative_tokens=k,
    )


def init_head(model, cfg: Eagle3Config, draft_ids: torch.Tensor, seed: int) -> Eagle3Head:
    """A head started from the target: what it shares exactly (embedding, final norm, lm_head rows) and the
    last decoder layer's weights where shapes match, its q/k/v reading the hidden half; fc passes the
    highest aux state through."""
    torch.manual_seed(seed)
    head = Eagle3Head(cfg)
    d2t, t2d = vocab_maps(draft_ids, cfg.target_vocab_size)
    h = cfg.hidden_size
    # Llama-style norms multiply by w; Gemma-style ones by (1 + w) and would need their offset added
    llama_norms = text_config(model).model_type in ("llama", "mistral", "qwen2", "qwen3", "granite")
    last = decoder_layers(model)[-1]
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.embed_tokens.weight.copy_(model.get_input_embeddings().weight)
        head.lm_head.weight.copy_(model.get_output_embeddings().weight[draft_ids])
        if llama_norms:
            head.norm.weight.copy_(model.model.norm.weight)
        layer = head.layers[0]
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(layer.self_attn, name).weight, getattr(last.self_attn, name).weight
            ours.normal_(0.0, 0.02 / math.sqrt(2))
            if ours[:, h:].shape == theirs.shape:
                ours[:, h:].copy_(theirs)
        pairs = [("self_attn.o_proj", "self_attn.o_proj")]
        pairs += [(f"mlp.{n}", f"mlp.{n}") for n in ("gate_proj", "up_proj", "down_proj")]
        if llama_norms:
            pairs += [
                ("input_layernorm", "input_layernorm"),
                ("hidden_norm", "input_layernorm"),
                ("post_attention_layernorm", "post_attention_layernorm"),
            ]
        for ours_name, theirs_name in pairs:
            ours, theirs = layer.get_submodule(ours_name).weight, last.get_submodule(theirs_name).weight
            if ours.shape == theirs.shape:
                ours.copy_(theirs)
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * cfg.target_hidden_size :].copy_(torch.eye(h, cfg.target_hidden_size))
    head.embed_tokens.weight.requires_grad_(False)
    return head


# -- training ---------------------------------------------------------------------------------------------


def batches(samples: list[Sample], batch_tokens: int, max_len: int, rng: random.Random):
    """Lists of samples of similar length, about batch_tokens tokens each, in a shuffled order."""
    order = sorted(samples, key=lambda s: (min(len(s.tokens), max_len), rng.random()))
    groups, cur, width = [], [], 0
    for s in order:
        n = min(len(s.tokens), max_len)
        if cur and max(width, n) * (len(cur) + 1) > batch_tokens:
            groups.append(cur)
            cur, width = [], 0
        cur.append(s)
        width = max(width, n)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def collate(group: list[Sample], head: Eagle3Head, max_len: int):
    """Rows i = 0..L-2 of each sample (token i + 1, fused aux state i, position i), right-padded, with the
    teacher's final hidden state and argmax per position and a mask of the answer tokens."""
    width = min(max_len, max(len(s.tokens) for s in group)) - 1
    b, th, dev = len(group), group[0].aux.shape[-1], group[0].aux.device
    ids = torch.zeros(b, width, dtype=torch.long, device=dev)
    aux = torch.zeros(b, width, th, dtype=torch.bfloat16, device=dev)
    last = torch.zeros(b, width + 1, group[0].last.shape[-1], dtype=torch.bfloat16, device=dev)
    answer = torch.zeros(b, width + 1, dtype=torch.bool, device=dev)  # position p holds an answer token
    nxt = torch.zeros(b, width + 1, dtype=torch.long, device=dev)
    toks = torch.zeros(b, width + 1, dtype=torch.long, device=dev)
    for r, s in enumerate(group):
        n = min(len(s.tokens), width + 1)
        ids[r, : n - 1] = s.tokens[1:n]
        aux[r, : n - 1] = s.aux[: n - 1]
        last[r, :n] = s.last[:n]
        answer[r, s.prompt_len : n] = True
        nxt[r, :n] = s.greedy_next[:n]
        toks[r, :n] = s.tokens[:n]
    positions = torch.arange(width, device=dev).expand(b, width)
    return ids, aux, positions, last, answer, nxt, toks


def teacher_probs(head: Eagle3Head, lm_rows: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The target's next-token distribution restricted to the draft vocabulary (renormalised)."""
    return (last.float() @ lm_rows.T).softmax(-1)


def ttt_loss(head: Eagle3Head, lm_rows: torch.Tensor, batch, steps: int, decay: float):
    """Soft cross-entropy of each chain step against the target at the position it drafts; the loss and
    the per-step top-1 agreement with the target's argmax (answer positions only)."""
    ids, aux, positions, last, answer, nxt, _ = batch
    w = ids.shape[1]
    # a row before the first answer token minus the chain's reach drafts no answer token at any step: it
    # serves as context only
    has = answer.any(1)
    start = int(torch.where(has, answer.int().argmax(1), w).min())
    first = min(w - 1, max(0, start - steps - 1))
    chain = head.forward_chain(ids, head.fuse(aux.float()), positions, steps, first_row=first)
    probs = teacher_probs(head, lm_rows, last)  # [B, W + 1, Vd]: row p predicts token p + 1
    dev, vd = ids.device, head.cfg.draft_vocab_size
    t2d_ids = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long, device=dev)
    t2d_ids[head.draft_to_target(torch.arange(vd, device=dev))] = torch.arange(vd, device=dev)
    total = torch.zeros((), device=dev)
    agree = []
    for s, logits in enumerate(chain):
        # step s at row i drafts the token at position i + s + 2, which the target predicts at i + s + 1
        rows = w - s - first
        if rows <= 1:
            break
        lo = first + s + 1
        target = probs[:, lo : lo + rows]
        mask = torch.zeros(
            ids.shape[0], rows, dtype=torch.bool, device=dev
        )  # the last row's token is past the end
        mask[:, : rows - 1] = answer[:, lo + 1 :]
        logp = logits[:, :rows].float().log_softmax(-1)
        ce = -(target * logp).sum(-1)
        n = mask.sum().clamp(min=1)
        total = total + (decay**s) * (ce * mask).sum() / n
        want = t2d_ids[nxt[:, lo : lo + rows]]
        hit = (logits[:, :rows].argmax(-1) == want) & mask
        agree.append(float(hit.sum()) / float(n))
    return total, agree


def lr_at(args, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / args.warmup)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train(
    args, head: Eagle3Head, lm_rows: torch.Tensor, train_set: list[Sample], deadline: float, state: dict
):
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    if state.get("opt"):
        opt.load_state_dict(state["opt"])
    step, trained_s = state.get("step", 0), state.get("trained_s", 0.0)
    budget_s = trained_s + max(0.0, deadline - time.monotonic())
    rng = random.Random(args.seed + 2 + step)
    ckpt_path = Path(args.work) / "train_state.pt"
    last_ckpt = time.monotonic()
    bar = progress(None, "training", initial=step)
    dev = lm_rows.device
    # bf16 autocast on CUDA, where the tensor cores want it; the CPU trains in float32, the reference
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else nullcontext()
    tokens = state.get("tokens", 0)
    head.train()
    while time.monotonic() < deadline and (args.max_steps is None or step < args.max_steps):
        for group in batches(train_set, args.batch_tokens, args.max_len, rng):
            if time.monotonic() >= deadline or (args.max_steps is not None and step >= args.max_steps):
                break
            t0 = time.monotonic()
            for g in opt.param_groups:
                g["lr"] = lr_at(args, step, trained_s / max(1.0, budget_s))
            batch = collate(group, head, args.max_len)
            with autocast:
                loss, agree = ttt_loss(head, lm_rows, batch, args.ttt_steps, args.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            tokens += batch[0].numel()
            trained_s += time.monotonic() - t0
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.3f} top1/step " + " ".join(f"{a:.2f}" for a in agree))
            if time.monotonic() - last_ckpt > 60 * args.checkpoint_min:
                save_state(ckpt_path, head, opt, step, trained_s, tokens)
                last_ckpt = time.monotonic()
        if not train_set:
            break
    bar.close()
    head.eval()
    save_state(ckpt_path, head, opt, step, trained_s, tokens)
    return step, trained_s, tokens


def save_state(path: Path, head: Eagle3Head, opt, step: int, trained_s: float, tokens: int) -> None:
    tmp = path.with_suffix(".tmp")
    state = {"head": head.state_dict(), "opt": opt.state_dict()}
    torch.save({**state, "step": step, "trained_s": trained_s, "tokens": tokens}, tmp)
    tmp.rename(path)
    log(f"checkpoint: step {step}, {trained_s / 60:.1f} min of training")


# -- the held-out figure ----------------------------------------------------------------------------------


@torch.inference_mode()
def evaluate(head: Eagle3Head, samples: list[Sample], k: int, max_len: int) -> dict:
    """Chain drafting of k tokens (greedy) from every answer position of the held-out greedy answers:
    draft j counts as accepted when drafts 1..j all equal the target's greedy continuation."""
    accepted_at = torch.zeros(k, device=head.d2t.device)  # how often drafts 1..j were all accepted
    rows = 0
    for s in samples:
        if not (s.holdout and s.greedy):
            continue
        ids, aux, positions, last, answer, nxt, toks = collate([s], head, max_len)
        n = ids.shape[1]
        # verification at row i: the target's own token at i + 1 is in the answer, and its greedy
        # continuation (positions i + 2 .. i + k + 1) is there to compare with
        v = answer[0, 1 : max(1, n - k + 1)].nonzero().flatten()
        if not len(v):
            continue
        first = int(v[0])
        chain = head.forward_chain(ids, head.fuse(aux.float()), positions, k, first_row=first)
        ok = torch.ones(len(v), dtype=torch.bool, device=v.device)
        for j, logits in enumerate(chain):
            draft = head.draft_to_target(logits[0, v - first].argmax(-1))
            # the continuation is the target's: its greedy token after position i + j + 1, which the
            # answer holds when the answer was greedy (checked against the teacher's argmax too)
            want = toks[0, v + j + 2]
            ok &= (draft == want) & (nxt[0, v + j + 1] == want)
            accepted_at[j] += ok.sum()
        rows += len(v)
    if rows == 0:
        return {"rows": 0}
    cumulative = (accepted_at / rows).tolist()
    per_position = [cumulative[0]] + [
        cumulative[j] / cumulative[j - 1] if cumulative[j - 1] > 0 else 0.0 for j in range(1, k)
    ]
    mean_accepted = float(accepted_at.sum() / rows)
    return {
        "rows": rows,
        "k": k,
        "acceptance_per_position": [round(x, 4) for x in per_position],
        "accepted_through_position": [round(x, 4) for x in cumulative],
        "mean_accepted_drafts": round(mean_accepted, 4),
        "mean_acceptance_length": round(1.0 + mean_accepted, 4),  # with the target's own token per step
    }


# -- writing the head -------------------------------------------------------------------------------------


def save_head(
    head: Eagle3Head, out: Path, verifier_name: str, with_embed: bool, max_file_bytes: int
) -> list[Path]:
    """config.json and the weights in bf16, in one model.safetensors or, past max_file_bytes, in HF's
    sharded layout (model-0000i-of-0000n.safetensors and model.safetensors.index.json), which load_eagle3
    and vLLM both read."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("*.safetensors")) + list(out.glob("*.safetensors.index.json")):
        old.unlink()  # a shard of an earlier write would be read as part of this head
    state = {
        n: (t.to(torch.bfloat16) if t.is_floating_point() else t).detach().cpu().contiguous()
        for n, t in head.state_dict().items()
    }
    if not with_embed:
        state.pop("embed_tokens.weight")
    # the room each file's JSON header takes: a name, a dtype, a shape and offsets per tensor
    room = max_file_bytes - 1024 - 256 * len(state)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(state, key=lambda n: -state[n].nbytes):  # largest first: fewest shards
        t = state[name]
        if t.nbytes > room:
            raise ValueError(f"{name}: {t.nbytes} bytes alone exceeds --max-file-mib")
        if shards[-1] and size + t.nbytes > room:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    written = []
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        written.append(out / "model.safetensors")
    else:
        index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": {}}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(shard, name))
            written.append(out / name)
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    cfg = replace(head.cfg, verifier_name=verifier_name)
    (out / CONFIG_FILE).write_text(cfg.to_json(), encoding="utf-8")
    return written


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF directory, hub id or .gguf (default: the demo SmolLM2)")
    p.add_argument("--out", help="where the head is written (speculators' layout)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--work",
        default=None,
        help="prompts, answers, features, checkpoints (default: <out>-work; --out holds the head only)",
    )
    p.add_argument("--resume", action="store_true", help="continue from --work's checkpoint")
    p.add_argument("--prompts", default=None, help="a prompts file (--export-prompts' format) to use")
    p.add_argument("--export-prompts", default=None, help="write the prompts to this file and stop")
    p.add_argument(
        "--verifier-name", default=None, help="the target's name in config.json (default: --target)"
    )
    p.add_argument(
        "--with-embed",
        action="store_true",
        help="write the (frozen, the target's own) embedding too; without it loaders take the target's",
    )
    p.add_argument("--time-budget-min", type=float, default=120.0)
    p.add_argument("--gen-share", type=float, default=0.4, help="of the budget, for the answers")
    p.add_argument("--feature-share", type=float, default=None, help="of the budget (cpu 0.2, cuda 0.1)")
    p.add_argument("--eval-reserve-min", type=float, default=None, help="kept for eval (cpu 3, cuda 0.3)")
    p.add_argument("--eval-max-answers", type=int, default=200, help="held-out answers the figure reads")
    p.add_argument("--checkpoint-min", type=float, default=3.0)
    p.add_argument("--num-prompts", type=int, default=6000)
    p.add_argument(
        "--prompt-source",
        choices=("packages", "self", "mixed"),
        default="packages",
        help="packages: built from installed packages' prose; self: user turns the target writes from its "
        "chat template; mixed: half of each",
    )
    p.add_argument(
        "--prompt-share",
        type=float,
        default=0.1,
        help="of the budget, taken from --gen-share's, for the target's own user turns",
    )
    p.add_argument("--prompt-scan-s", type=float, default=60.0, help="time spent reading package text")
    p.add_argument(
        "--answerer",
        choices=("auto", "engine", "hf"),
        default="auto",
        help="who generates the answers (auto: specserve's engine on cpu, HF generate on cuda)",
    )
    p.add_argument("--in-flight", type=int, default=48, help="CPU: prompts the engine answers at once")
    p.add_argument("--gen-batch", type=int, default=256, help="CUDA: prompts per HF generate batch")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--sampled-fraction", type=float, default=0.25)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--feature-batch-tokens", type=int, default=None, help="cpu 4096, cuda 65536")
    p.add_argument("--layer-ids", type=str, default=None, help="three aux layer ids (default: vLLM's)")
    p.add_argument("--vocab-coverage", type=float, default=0.99)
    p.add_argument("--min-vocab", type=int, default=4096)
    p.add_argument("--max-vocab", type=int, default=8192)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--k", type=int, default=4, help="speculative_tokens written in the head's config")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-tokens", type=int, default=None, help="per training step (cpu 2048, cuda 32768)")
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--max-file-mib", type=float, default=16.0, help="the largest file written to --out")
    p.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help="the target's (auto: best)"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cuda = args.device == "cuda"
    defaults = {
        "feature_share": 0.1 if cuda else 0.2,
        "eval_reserve_min": 0.3 if cuda else 3.0,
        "feature_batch_tokens": 65536 if cuda else 4096,
        "batch_tokens": 32768 if cuda else 2048,
    }
    if cuda and args.answerer == "engine":
        p.error("--answerer engine: specserve's engine answers on the CPU here (it is unchecked on CUDA)")
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.export_prompts is None and args.out is None:
        p.error("--out is required (unless --export-prompts)")
    if args.gen_share + args.feature_share >= 1.0:
        p.error("--gen-share + --feature-share must leave time for training (< 1)")
    if not 0.0 < args.prompt_share < args.gen_share:
        p.error("--prompt-share must lie between 0 and --gen-share (it is taken from the answers' time)")
    return args


def engine_writes(args) -> bool:
    """Whether specserve's engine writes the target's text (answers, its own user turns), or HF generate."""
    return args.answerer == "engine" or (args.answerer == "auto" and args.device == "cpu")


def get_prompts(args, work: Path | None, deadline: float) -> list[Prompt]:
    """--prompts' file, else the copy in --work from an earlier run, else new ones from --prompt-source."""
    if args.prompts:
        return read_prompts(Path(args.prompts))
    saved = work / "prompts.jsonl" if work is not None else None
    if saved is not None and saved.exists():
        return read_prompts(saved)
    prompts = new_prompts(args, deadline)
    if saved is not None:
        write_prompts(saved, prompts)
    return prompts


def new_prompts(args, deadline: float) -> list[Prompt]:
    """--num-prompts prompts from --prompt-source: the target's own user turns (written until `deadline`,
    so there may be fewer), package prose filling the rest where the source allows; the two interleaved,
    so that the held-out prompts (every HOLDOUT_EVERY-th) sample both."""
    wanted = {"packages": 0, "self": args.num_prompts, "mixed": args.num_prompts // 2}[args.prompt_source]
    written: list[str] = []
    if wanted:
        path = target_path(args.target)
        if engine_writes(args):
            written = write_with_engine(
                str(path),
                wanted,
                deadline,
                in_flight=args.in_flight,
                dtype=args.dtype,
                seed=args.seed,
                log=log,
            )
        else:
            model, tokenizer = load_target(path, args.device, target_dtype(args.dtype, args.device))
            written = write_with_hf(
                model, tokenizer, wanted, deadline, batch=args.gen_batch, seed=args.seed, log=log
            )
            del model
    built: list[str] = []
    if args.prompt_source != "self":
        built = [
            p.text for p in build_prompts(args.num_prompts - len(written), args.seed, args.prompt_scan_s)
        ]
    texts = [t for pair in zip(written, built) for t in pair]
    texts += written[len(built) :] + built[len(written) :]
    return [Prompt(t, i % HOLDOUT_EVERY == 0) for i, t in enumerate(texts)]


class Phases:
    """Wall time and volume of each phase, for the log and eval.json."""

    def __init__(self) -> None:
        self.rows: dict[str, dict] = {}

    def record(self, name: str, seconds: float, **counts) -> None:
        rates = {f"{k}_per_s": round(v / seconds, 2) for k, v in counts.items() if seconds > 0}
        self.rows[name] = {"seconds": round(seconds, 1), **counts, **rates}
        log(f"{name}: {json.dumps(self.rows[name])}")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    end = start + 60 * args.time_budget_min
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    if args.export_prompts:
        prompts = get_prompts(args, None, start + 60 * args.time_budget_min * args.prompt_share)
        write_prompts(Path(args.export_prompts), prompts)
        log(f"{len(prompts)} prompts ({sum(p.holdout for p in prompts)} held out) in {args.export_prompts}")
        return {"prompts": len(prompts)}
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    out = Path(args.out)
    work = Path(args.work) if args.work else out.with_name(out.name + "-work")
    args.work = str(work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.resume and (work / "train_state.pt").exists():
        raise SystemExit(f"{work} holds a run: pass --resume to continue it, or another --work / --out")
    phases = Phases()
    path = target_path(args.target)
    name = args.target or path.name

    t = time.monotonic()
    prompts = get_prompts(args, work, start + 60 * args.time_budget_min * args.prompt_share)
    digest = hashlib.sha256("\n".join(p.text for p in prompts).encode()).hexdigest()[:12]
    log(f"{len(prompts)} prompts ({digest}), {sum(p.holdout for p in prompts)} held out")
    phases.record("prompts", time.monotonic() - t, prompts=len(prompts))

    # answers: the cache is keyed by prompt index, so it belongs to one prompts list
    digest_file = work / "prompts.digest"
    if digest_file.exists() and digest_file.read_text() != digest:
        raise SystemExit(f"{work} holds answers to other prompts: give another --work")
    digest_file.write_text(digest)
    cache = AnswerCache(work / "answers.jsonl")
    todo = [i for i in range(len(prompts)) if i not in cache.answers]
    gen_deadline = start + 60 * args.time_budget_min * args.gen_share
    t, before = time.monotonic(), len(cache.answers)
    bar = progress(len(prompts), "target answers", initial=before)
    tokens = [0]

    def on_answer(a) -> None:
        tokens[0] += len(a.answer_ids)
        bar.update(1)

    gen = dict(
        max_tokens=args.max_new_tokens,
        temperature=args.temperature,
        sampled_fraction=args.sampled_fraction,
        seed=args.seed,
        on_answer=on_answer,
    )
    dtype = target_dtype(args.dtype, args.device)
    model = None
    engine = engine_writes(args)
    # held-out prompts past what the figure reads are never answered: answered first (so a run cut short
    # has its figure), 600 of them took three quarters of a 3-minute GPU budget's answers from training
    held_todo = [i for i in todo if prompts[i].holdout]
    skip = set(held_todo[max(0, args.eval_max_answers - sum(a.holdout for a in cache.ordered())) :])
    todo = [i for i in todo if i not in skip]
    # past the deadline, a cache with answers in it is enough: no target loaded only to stop at once
    if time.monotonic() > gen_deadline and cache.answers:
        todo = []
    if todo and engine:
        answer_with_engine(
            str(path),
            prompts,
            todo,
            cache,
            gen_deadline,
            in_flight=args.in_flight,
            dtype=args.dtype,
            log=log,
            **gen,
        )
    elif todo:
        model, tokenizer = load_target(path, args.device, dtype)
        answer_with_hf(model, tokenizer, prompts, todo, cache, gen_deadline, batch=args.gen_batch, **gen)
    bar.close()
    cache.close()
    answers = cache.ordered()
    phases.record("answers", time.monotonic() - t, answers=len(answers) - before, answer_tokens=tokens[0])
    if not any(not a.holdout for a in answers):
        raise SystemExit("no training answers yet: give a larger --time-budget-min or --gen-share")

    # the draft vocabulary, from the answers alone
    if model is None:
        model, _ = load_target(path, args.device, dtype)
    num_layers = len(decoder_layers(model))
    layer_ids = (
        tuple(int(x) for x in args.layer_ids.split(",")) if args.layer_ids else default_layer_ids(num_layers)
    )
    log(f"target {name} ({dtype}, {args.device}): {num_layers} layers, aux layer ids {layer_ids}")
    vocab_size = text_config(model).vocab_size
    vocab_file = work / "vocab.pt"
    if vocab_file.exists():
        saved = torch.load(vocab_file, weights_only=False)
        draft_ids, coverage = saved["ids"], saved["coverage"]
    else:
        draft_ids, coverage = choose_vocab(
            answers, vocab_size, args.vocab_coverage, args.min_vocab, args.max_vocab
        )
        torch.save({"ids": draft_ids, "coverage": coverage}, vocab_file)
    log(f"draft vocabulary {len(draft_ids)} of {vocab_size}; answer-token coverage by size: {coverage}")

    # features: one target forward per answer
    t = time.monotonic()
    feature_deadline = start + 60 * args.time_budget_min * (args.gen_share + args.feature_share)
    fbar = progress(len(answers), "target features")
    counted = {"answers": 0, "tokens": 0}

    def on_batch(n: int, tokens: int) -> None:
        counted["answers"] += n
        counted["tokens"] += tokens
        fbar.update(n)

    samples = compute_features(
        model,
        layer_ids,
        answers,
        feature_deadline,
        batch_tokens=args.feature_batch_tokens,
        shard_dir=work / "features" if args.device == "cpu" else None,
        on_batch=on_batch,
    )
    fbar.close()
    phases.record("features", time.monotonic() - t, **counted)
    train_set = [s for s in samples if not s.holdout]
    held = [s for s in samples if s.holdout][: args.eval_max_answers]
    log(f"{len(samples)} answers with features: {len(train_set)} train, {len(held)} held out")
    if not train_set:
        raise SystemExit("no training features yet: give a larger --time-budget-min")

    cfg = head_config(model, len(draft_ids), layer_ids, args.k)
    head = init_head(model.float(), cfg, draft_ids, args.seed).to(args.device)
    lm_rows = model.get_output_embeddings().weight[draft_ids.to(args.device)].detach().float()
    state: dict = {}
    if (work / "train_state.pt").exists():
        state = torch.load(work / "train_state.pt", weights_only=False, map_location=args.device)
        head.load_state_dict(state["head"])
        log(f"resumed at step {state['step']} ({state['trained_s'] / 60:.1f} min trained)")
    del model  # the teacher lives on in the features

    t = time.monotonic()
    train_deadline = end - 60 * args.eval_reserve_min
    steps, trained_s, trained_tokens = train(args, head, lm_rows, train_set, train_deadline, state)
    phases.record("training", time.monotonic() - t, steps=steps, tokens=trained_tokens)

    # the figure is the written head's: its weights rounded to bf16 as save_head writes them
    t = time.monotonic()
    head.to(torch.bfloat16).float()
    figures = {f"k{k}": evaluate(head, held, k, args.max_len) for k in EVAL_KS}
    phases.record("eval", time.monotonic() - t, answers=len(held))
    files = save_head(head, out, args.verifier_name or name, args.with_embed, int(args.max_file_mib * 2**20))
    report = {
        "target": name,
        "device": args.device,
        "dtype": str(dtype).removeprefix("torch."),
        "layer_ids": list(layer_ids),
        "draft_vocab_size": len(draft_ids),
        "vocab_coverage": coverage,
        "answers": len(samples),
        "answer_tokens": sum(len(s.tokens) - s.prompt_len for s in samples),
        "train_steps": steps,
        "train_minutes": round(trained_s / 60, 2),
        "wall_minutes_this_run": round((time.monotonic() - start) / 60, 2),
        "ttt_steps": args.ttt_steps,
        "phases": phases.rows,
        "heldout": figures,
        "weights": [f.name for f in files],
    }
    (out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    for k, figure in figures.items():
        log(f"held-out ({k}, greedy chain): {json.dumps(figure)}")
    log(f"head written to {out}: {', '.join(f.name for f in files)}")
    return report


if __name__ == "__main__":
    main()
