"""Train an EAGLE-3 head for a target model by self-distillation, and write it in speculators' format.

    python tools/train_eagle.py --target <HF dir, hub id or .gguf; default the demo SmolLM2> --out <dir>

1. Prompts: open-chat requests (questions, advice, stories, emails, explanations) built from the text of
   installed third-party packages (their READMEs, package descriptions and docstrings in site-packages),
   never CPython's standard library, which the benchmarks are cut from. Every tenth prompt is held out.
2. The target answers each chat-templated prompt (greedy, a share sampled at T=0.7) and one teacher-forced
   forward records, per token, its three aux hidden states (vLLM's layer ids), its final hidden state and
   its greedy next token. Shards on disk under --work: the costly part, kept across runs.
3. The draft vocabulary: the target's most frequent answer tokens, as many as reach --vocab-coverage of
   the answers (bounded by --min-vocab / --max-vocab), giving d2t / t2d.
4. The head starts from the target (embedding, final norm, lm_head rows of the draft vocabulary, the last
   decoder layer's weights where shapes allow; fc passes the highest aux state through) and learns the
   target's next-token distribution restricted to the draft vocabulary (soft cross-entropy), on its own
   chain of --ttt-steps drafts (EAGLE-3's training-time test: Eagle3Head.forward_chain).
5. The held-out figure: chain drafting of --k tokens (greedy) from every answer position of the held-out
   greedy answers, against the target's greedy continuation: acceptance per draft position and the mean
   acceptance length, in <out>/train_report.json and the log.

Resumable (--resume continues from the last checkpoint, written every --checkpoint-min), bounded by
--time-budget-min, with a progress bar (tqdm when installed).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import re
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specserve.spec.eagle3.head import (  # noqa: E402
    Eagle3Config,
    Eagle3Head,
    default_layer_ids,
    save_eagle3,
    vocab_maps,
)

# prompt i is held out when i % 10 == 0: the first batch, always greedy, holds one, so even a run cut
# short after it has a held-out figure
HOLDOUT_EVERY = 10
TOPIC_TEMPLATES = (
    "What is {t}? Explain it simply.",
    "Give me three practical tips about {t}.",
    "Write a short story in which someone discovers {t}.",
    "Write a polite email to a colleague asking for help with {t}.",
    "I'm feeling stuck learning about {t}. Any advice?",
    "Write a short poem about {t}.",
    "What are the pros and cons of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "What are common mistakes people make with {t}?",
    "Plan a one-week study schedule for {t}.",
)
SNIPPET_TEMPLATES = (
    "Explain the following to someone new to the subject:\n\n{s}",
    "Summarize this in a few sentences:\n\n{s}",
    "Write a short email to my team that explains this:\n\n{s}",
    "What are the main points here, and why do they matter?\n\n{s}",
    "{s}\n\nWhat questions would a beginner ask about this? Answer two of them.",
)


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


def load_target(target: str | None):
    """(model fp32 eval, tokenizer, name) through transformers; a .gguf through its gguf_file loading."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specserve.models.loader import demo_model_path
    from specserve.models.loader.resolve import resolve_model

    path = demo_model_path() if target is None else resolve_model(target)
    if path.is_file() and path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.eval().requires_grad_(False)
    return model, tokenizer, str(target if target is not None else path.name)


def text_config(model):
    config = model.config
    return getattr(config, "text_config", None) or config


def decoder_layers(model):
    return model.model.layers


# -- prompts ----------------------------------------------------------------------------------------------


def _package_roots() -> list[Path]:
    """site-packages directories (third-party code), never the standard library's own directory."""
    import site

    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    roots = {Path(p).resolve() for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]]}
    return sorted(r for r in roots if r.is_dir() and r != stdlib)


def _text_files(roots: list[Path]) -> list[Path]:
    files: list[Path] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("__pycache__", "tests", "test"))
            for f in sorted(filenames):
                if f.endswith((".md", ".rst", ".py")) or f == "METADATA":
                    files.append(Path(dirpath) / f)
    return files


def _clean(paragraph: str) -> str | None:
    text = re.sub(r"\s+", " ", paragraph).strip()
    if not 160 <= len(text) <= 700:
        return None
    letters = sum(c.isalpha() or c == " " for c in text)
    if letters / len(text) < 0.85 or re.search(r"[{}<>=_\\|]|://|\.\. |::", text):
        return None
    return text


def _texts_of(path: Path) -> tuple[list[str], list[str]]:
    """(paragraphs, topics) of one file: prose paragraphs; headings and one-line summaries of docs."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")[:200_000]
    except OSError:
        return [], []
    topics: list[str] = []
    if path.suffix == ".py":
        try:
            tree = ast.parse(raw)
        except (SyntaxError, ValueError):
            return [], []
        docs = [
            ast.get_docstring(n) or ""
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        ]
        raw = "\n\n".join(d for d in docs if len(d) > 160)
    else:
        lines = raw.splitlines()
        for j, line in enumerate(lines):
            line = line.strip()
            under = lines[j + 1].strip() if j + 1 < len(lines) else ""
            m = re.match(r"^(?:#{1,3} +|Summary: +)?([A-Za-z][A-Za-z ,'-]{6,60})$", line)
            heading = line.startswith(("#", "Summary:")) or (len(under) >= 4 and set(under) <= set("=-~^"))
            if m and heading and 2 <= len(m.group(1).split()) <= 7:
                topics.append(m.group(1).strip().rstrip(".").lower())
    paragraphs = [p for p in (_clean(x) for x in re.split(r"\n\s*\n", raw)) if p]
    return paragraphs, topics


def build_prompts(count: int, seed: int, scan_s: float = 60.0) -> list[str]:
    """`count` distinct open-chat prompts from the installed packages' text, in a fixed order (docs first,
    then docstrings, until there is enough text or `scan_s` has passed)."""
    rng = random.Random(seed)
    files = _text_files(_package_roots())
    docs = [f for f in files if f.suffix != ".py"]
    code = [f for f in files if f.suffix == ".py"]
    rng.shuffle(docs)
    rng.shuffle(code)
    paragraphs: list[str] = []
    topics: set[str] = set()
    stop = time.monotonic() + scan_s
    for f in docs + code:
        p, t = _texts_of(f)
        paragraphs.extend(p)
        topics.update(t)
        if (len(paragraphs) >= count and len(topics) >= count // 2) or time.monotonic() > stop:
            break
    paragraphs = sorted(set(paragraphs))
    topic_list = sorted(topics)
    rng.shuffle(paragraphs)
    rng.shuffle(topic_list)
    if not paragraphs and not topic_list:
        raise RuntimeError("no prose found in site-packages to build prompts from")
    prompts: list[str] = []
    seen: set[str] = set()
    i = 0
    while len(prompts) < count and i < 20 * count:
        if topic_list and (rng.random() < 0.6 or not paragraphs):
            p = rng.choice(TOPIC_TEMPLATES).format(t=topic_list[i % len(topic_list)])
        else:
            p = rng.choice(SNIPPET_TEMPLATES).format(s=paragraphs[i % len(paragraphs)])
        i += 1
        if p not in seen:
            seen.add(p)
            prompts.append(p)
    return prompts


# -- generating the target's answers ------------------------------------------------------------------------


@dataclass
class Sample:
    tokens: torch.Tensor  # [L] int64: the chat-templated prompt and the target's answer
    prompt_len: int
    aux: torch.Tensor  # [L, 3 * hidden] bf16: the aux hidden states, layer-id order
    last: torch.Tensor  # [L, hidden] bf16: the final hidden state (after the target's norm)
    greedy_next: torch.Tensor  # [L] int64: the target's argmax at each position
    greedy: bool  # answered greedily (the held-out figure reads only these)
    holdout: bool


@torch.inference_mode()
def answer(model, tokenizer, prompts: list[str], greedy: bool, max_new_tokens: int, temperature: float):
    """The target's answers: [(prompt ids, answer ids)] with the answer ending at its EOS."""
    encoded = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
        )
        for p in prompts
    ]
    encoded = [e["input_ids"] if isinstance(e, dict) or hasattr(e, "keys") else e for e in encoded]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    kwargs = dict(temperature=temperature, top_p=1.0, top_k=0) if not greedy else {}
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        pad_token_id=pad,
        **kwargs,
    )
    eos = {tokenizer.eos_token_id} | set(_as_list(model.generation_config.eos_token_id))
    results = []
    for e, row in zip(encoded, out[:, width:].tolist()):
        end = next((j + 1 for j, t in enumerate(row) if t in eos), len(row))
        results.append((list(e), row[:end]))
    return results


def _as_list(x) -> list[int]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [int(x)]


@torch.inference_mode()
def teacher(model, layer_ids: tuple[int, ...], sequences: list[list[int]]):
    """Per sequence: (aux [L, 3H], last [L, H], greedy next [L]) from one forward (right-padded batch)."""
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (width - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i] for i in layer_ids], dim=-1)
    argmax = out.logits.argmax(-1)
    return [
        (aux[b, : len(s)].bfloat16(), hs[-1][b, : len(s)].bfloat16(), argmax[b, : len(s)])
        for b, s in enumerate(sequences)
    ]


def generate(args, model, tokenizer, layer_ids, prompts: list[str], deadline: float) -> None:
    """Answers for prompts not yet in a shard, written in shards of --gen-batch; stops at the deadline."""
    samples_dir = Path(args.work) / "samples"
    samples_dir.mkdir(parents=True, exist_ok=True)
    done = {int(p.stem.split("_")[1]) for p in samples_dir.glob("shard_*.pt")}
    batch = args.gen_batch
    starts = [s for s in range(0, len(prompts), batch) if s not in done]
    bar = progress(len(prompts), "target answers", initial=len(prompts) - len(starts) * batch)
    rng = random.Random(args.seed + 1)
    # the first batch is greedy: a run cut short still has greedy held-out answers for its figure
    sampled = {s for s in range(batch, len(prompts), batch) if rng.random() < args.sampled_fraction}
    written = 0
    for start in starts:
        # past the time share, stop, but never before one shard exists: the run needs answers to train on
        if time.monotonic() > deadline and (done or written):
            log(f"generation: time share spent, {len(list(samples_dir.glob('shard_*.pt')))} shards on disk")
            break
        chunk = prompts[start : start + batch]
        greedy = start not in sampled
        pairs = answer(model, tokenizer, chunk, greedy, args.max_new_tokens, args.temperature)
        seqs = [p + a for p, a in pairs]
        rows = teacher(model, layer_ids, seqs)
        shard = []
        for j, ((p, _), seq, (aux, last, nxt)) in enumerate(zip(pairs, seqs, rows)):
            shard.append(
                {
                    "tokens": torch.tensor(seq, dtype=torch.int32),
                    "prompt_len": len(p),
                    "aux": aux,
                    "last": last,
                    "greedy_next": nxt.int(),
                    "greedy": greedy,
                    "holdout": (start + j) % HOLDOUT_EVERY == 0,
                }
            )
        tmp = samples_dir / f"shard_{start:06d}.tmp"
        torch.save(shard, tmp)
        tmp.rename(samples_dir / f"shard_{start:06d}.pt")  # a killed run never leaves half a shard
        written += 1
        bar.update(len(chunk))
        bar.set_postfix_str(f"{sum(len(s) for s in seqs)} tokens")
    bar.close()


def load_samples(work: Path) -> list[Sample]:
    out = []
    for f in sorted((work / "samples").glob("shard_*.pt")):
        for r in torch.load(f, weights_only=True):
            out.append(
                Sample(
                    tokens=r["tokens"].long(),
                    prompt_len=int(r["prompt_len"]),
                    aux=r["aux"],
                    last=r["last"],
                    greedy_next=r["greedy_next"].long(),
                    greedy=bool(r["greedy"]),
                    holdout=bool(r["holdout"]),
                )
            )
    return out


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
    b, th = len(group), group[0].aux.shape[-1]
    ids = torch.zeros(b, width, dtype=torch.long)
    aux = torch.zeros(b, width, th, dtype=torch.bfloat16)
    last = torch.zeros(b, width + 1, group[0].last.shape[-1], dtype=torch.bfloat16)
    answer = torch.zeros(b, width + 1, dtype=torch.bool)  # position p holds an answer token
    nxt = torch.zeros(b, width + 1, dtype=torch.long)
    toks = torch.zeros(b, width + 1, dtype=torch.long)
    for r, s in enumerate(group):
        n = min(len(s.tokens), width + 1)
        ids[r, : n - 1] = s.tokens[1:n]
        aux[r, : n - 1] = s.aux[: n - 1]
        last[r, :n] = s.last[:n]
        answer[r, s.prompt_len : n] = True
        nxt[r, :n] = s.greedy_next[:n]
        toks[r, :n] = s.tokens[:n]
    positions = torch.arange(width).expand(b, width)
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
    starts = [int(a.nonzero()[0]) if a.any() else w for a in answer]
    first = min(w - 1, max(0, min(starts) - steps - 1))
    chain = head.forward_chain(ids, head.fuse(aux.float()), positions, steps, first_row=first)
    probs = teacher_probs(head, lm_rows, last)  # [B, W + 1, Vd]: row p predicts token p + 1
    t2d_ids = torch.full((head.cfg.target_vocab_size,), -1, dtype=torch.long)
    t2d_ids[head.draft_to_target(torch.arange(head.cfg.draft_vocab_size))] = torch.arange(
        head.cfg.draft_vocab_size
    )
    total = torch.zeros(())
    agree = []
    for s, logits in enumerate(chain):
        # step s at row i drafts the token at position i + s + 2, which the target predicts at i + s + 1
        rows = w - s - first
        if rows <= 1:
            break
        lo = first + s + 1
        target = probs[:, lo : lo + rows]
        mask = torch.zeros(ids.shape[0], rows, dtype=torch.bool)  # the last row's token is past the end
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
    head.train()
    while time.monotonic() < deadline and (args.max_steps is None or step < args.max_steps):
        for group in batches(train_set, args.batch_tokens, args.max_len, rng):
            if time.monotonic() >= deadline or (args.max_steps is not None and step >= args.max_steps):
                break
            t0 = time.monotonic()
            for g in opt.param_groups:
                g["lr"] = lr_at(args, step, trained_s / max(1.0, budget_s))
            loss, agree = ttt_loss(
                head, lm_rows, collate(group, head, args.max_len), args.ttt_steps, args.ttt_decay
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            trained_s += time.monotonic() - t0
            bar.update(1)
            bar.set_postfix_str(f"loss {loss.item():.3f} top1/step " + " ".join(f"{a:.2f}" for a in agree))
            if time.monotonic() - last_ckpt > 60 * args.checkpoint_min:
                save_state(ckpt_path, head, opt, step, trained_s)
                last_ckpt = time.monotonic()
    bar.close()
    head.eval()
    save_state(ckpt_path, head, opt, step, trained_s)
    return step, trained_s


def save_state(path: Path, head: Eagle3Head, opt, step: int, trained_s: float) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(
        {"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "trained_s": trained_s}, tmp
    )
    tmp.rename(path)
    log(f"checkpoint: step {step}, {trained_s / 60:.1f} min of training")


# -- the held-out figure ----------------------------------------------------------------------------------


@torch.inference_mode()
def evaluate(head: Eagle3Head, samples: list[Sample], k: int, max_len: int) -> dict:
    """Chain drafting of k tokens (greedy) from every answer position of the held-out greedy answers:
    draft j counts as accepted when drafts 1..j all equal the target's greedy continuation."""
    accepted_at = torch.zeros(k)  # how often drafts 1..j were all accepted
    rows = 0
    for s in samples:
        if not (s.holdout and s.greedy):
            continue
        ids, aux, positions, last, answer, nxt, toks = collate([s], head, max_len)
        n = ids.shape[1]
        # verification at row i: the target's own token at i + 1 is in the answer, and its greedy
        # continuation (positions i + 2 .. i + k + 1) is there to compare with
        valid = [i for i in range(n - k) if answer[0, i + 1]]
        if not valid:
            continue
        first = valid[0]
        chain = head.forward_chain(ids, head.fuse(aux.float()), positions, k, first_row=first)
        v = torch.tensor(valid)
        ok = torch.ones(len(valid), dtype=torch.bool)
        for j, logits in enumerate(chain):
            draft = head.draft_to_target(logits[0, v - first].argmax(-1))
            # the continuation is the target's: its greedy token after position i + j + 1, which the
            # answer holds when the answer was greedy (checked against the teacher's argmax too)
            want = toks[0, v + j + 2]
            ok &= (draft == want) & (nxt[0, v + j + 1] == want)
            accepted_at[j] += ok.sum()
        rows += len(valid)
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


# -- main -------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=None, help="HF directory, hub id or .gguf (default: the demo SmolLM2)")
    p.add_argument("--out", required=True, help="where the head is written (speculators' layout)")
    p.add_argument("--work", default=None, help="answers and checkpoints (default: <out>/work)")
    p.add_argument("--resume", action="store_true", help="continue from --work's checkpoint")
    p.add_argument(
        "--verifier-name", default=None, help="the target's name in config.json (default: --target)"
    )
    p.add_argument(
        "--with-embed",
        action="store_true",
        help="write the (frozen, the target's own) embedding too; without it loaders take the target's",
    )
    p.add_argument("--time-budget-min", type=float, default=120.0)
    p.add_argument(
        "--gen-share", type=float, default=0.45, help="share of the budget for the target's answers"
    )
    p.add_argument("--eval-reserve-min", type=float, default=3.0, help="kept back for the held-out figure")
    p.add_argument("--checkpoint-min", type=float, default=3.0)
    p.add_argument("--num-prompts", type=int, default=4000)
    p.add_argument("--prompt-scan-s", type=float, default=60.0, help="time spent reading package text")
    p.add_argument("--gen-batch", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--sampled-fraction", type=float, default=0.25)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--layer-ids", type=str, default=None, help="three aux layer ids (default: vLLM's)")
    p.add_argument("--vocab-coverage", type=float, default=0.99)
    p.add_argument("--min-vocab", type=int, default=4096)
    p.add_argument("--max-vocab", type=int, default=16384)
    p.add_argument("--ttt-steps", type=int, default=4)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--k", type=int, default=4, help="draft length of the held-out figure")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--batch-tokens", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    start = time.monotonic()
    end = start + 60 * args.time_budget_min
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    args.work = str(Path(args.work) if args.work else out / "work")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not args.resume and (work / "train_state.pt").exists():
        raise SystemExit(f"{work} holds a run: pass --resume to continue it, or another --work / --out")

    model, tokenizer, name = load_target(args.target)
    num_layers = len(decoder_layers(model))
    layer_ids = (
        tuple(int(x) for x in args.layer_ids.split(",")) if args.layer_ids else default_layer_ids(num_layers)
    )
    log(f"target {name}: {num_layers} layers, aux layer ids {layer_ids}")

    prompts_file = work / "prompts.json"
    if prompts_file.exists():
        prompts = json.loads(prompts_file.read_text())
    else:
        prompts = build_prompts(args.num_prompts, args.seed, args.prompt_scan_s)
        prompts_file.write_text(json.dumps(prompts, indent=0))
    digest = hashlib.sha256("\n".join(prompts).encode()).hexdigest()[:12]
    log(f"{len(prompts)} prompts ({digest}), every {HOLDOUT_EVERY}th held out")

    gen_deadline = start + 60 * args.time_budget_min * args.gen_share
    generate(args, model, tokenizer, layer_ids, prompts, gen_deadline)
    samples = load_samples(work)
    train_set = [s for s in samples if not s.holdout]
    held = [s for s in samples if s.holdout]
    answer_tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    log(
        f"{len(samples)} answers ({answer_tokens} answer tokens): "
        f"{len(train_set)} train, {len(held)} held out"
    )
    if not train_set:
        raise SystemExit("no training answers yet: give a larger --time-budget-min")

    vocab_size = text_config(model).vocab_size
    vocab_file = work / "vocab.pt"
    if vocab_file.exists():
        saved = torch.load(vocab_file, weights_only=False)
        draft_ids, coverage = saved["ids"], saved["coverage"]
    else:
        draft_ids, coverage = choose_vocab(
            train_set + held, vocab_size, args.vocab_coverage, args.min_vocab, args.max_vocab
        )
        torch.save({"ids": draft_ids, "coverage": coverage}, vocab_file)
    log(f"draft vocabulary {len(draft_ids)} of {vocab_size}; answer-token coverage by size: {coverage}")

    cfg = head_config(model, len(draft_ids), layer_ids, args.k)
    head = init_head(model, cfg, draft_ids, args.seed)
    lm_rows = model.get_output_embeddings().weight[draft_ids].detach().float()
    state: dict = {}
    if (work / "train_state.pt").exists():
        state = torch.load(work / "train_state.pt", weights_only=False)
        head.load_state_dict(state["head"])
        log(f"resumed at step {state['step']} ({state['trained_s'] / 60:.1f} min trained)")
    del model  # the teacher lives on in the shards

    train_deadline = end - 60 * args.eval_reserve_min
    steps, trained_s = train(args, head, lm_rows, train_set, train_deadline, state)
    figure = evaluate(head, held, args.k, args.max_len)
    save_eagle3(head, out, verifier_name=args.verifier_name or name, with_embed=args.with_embed)
    report = {
        "target": name,
        "layer_ids": list(layer_ids),
        "draft_vocab_size": len(draft_ids),
        "vocab_coverage": coverage,
        "answers": len(samples),
        "answer_tokens": answer_tokens,
        "train_steps": steps,
        "train_minutes": round(trained_s / 60, 2),
        "wall_minutes_this_run": round((time.monotonic() - start) / 60, 2),
        "ttt_steps": args.ttt_steps,
        "heldout": figure,
    }
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(f"held-out (k={args.k}, greedy): {json.dumps(figure)}")
    log(f"head written to {out}")
    return report


if __name__ == "__main__":
    main()
