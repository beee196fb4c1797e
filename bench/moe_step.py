"""A mixture-of-experts decode step against a dense one with the same active parameters.

Two random-weight Qwen3 models of one shape (hidden 1024, 8 layers, 16 query / 4 KV heads): a dense MLP of
intermediate 2048, and a Qwen3-MoE MLP of 8 experts of intermediate 1024 with top-2 routing, so each token
goes through the same number of MLP weights. The experts run grouped (tokens sorted by expert, one matmul
per expert that any token chose), so the MoE step should cost little more than the dense one: the target is
<= 1.5x at batch 16. Decode forward time per step comes from the engine's own step breakdown: a run of
`--tokens` + 1 tokens minus a prefill-only run of the same prompts.

    python bench/moe_step.py [--batch 16] [--tokens 48] [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import cpu_line  # noqa: E402

from specserve import LLM, SamplingParams  # noqa: E402
from specserve.models.loader import demo_model_path, load_tokenizer  # noqa: E402

SHAPE = dict(
    hidden_size=1024,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def build(kind: str, out: Path) -> Path:
    import transformers

    tokenizer = load_tokenizer(demo_model_path())
    common = dict(SHAPE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id)
    if kind == "dense":
        config = transformers.Qwen3Config(intermediate_size=2048, **common)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            intermediate_size=2048,
            moe_intermediate_size=1024,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            **common,
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def decode_ms(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    """Forward milliseconds per decode step: a full run minus a prefill-only run."""

    def run(max_tokens: int) -> tuple[float, int]:
        t = llm.engine.step_times
        f0, s0 = t.forward, t.steps
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return t.forward - f0, t.steps - s0

    f1, s1 = run(1)
    fn, sn = run(tokens + 1)
    return 1e3 * (fn - f1) / max(sn - s1, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--tokens", type=int, default=48, help="decode steps measured per run")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    print(f"CPU: {cpu_line()} | load {os.getloadavg()[0]:.1f} | torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        llms = {kind: LLM(str(build(kind, Path(tmp) / kind)), dtype=args.dtype) for kind in ("dense", "moe")}
        gen = torch.Generator().manual_seed(1)
        prompts = [
            torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)
        ]
        for llm in llms.values():  # warm-up: first-touch of weights, kernel builds
            decode_ms(llm, prompts[:2], 4)
        times: dict[str, list[float]] = {"dense": [], "moe": []}
        for kind in ("dense", "moe", "moe", "dense"):  # ABBA: the machine is noisy
            times[kind].append(decode_ms(llms[kind], prompts, args.tokens))
            print(f"  {kind:<5} {times[kind][-1]:7.2f} ms/decode step (batch {args.batch})", flush=True)
    dense, moe = (sum(times[k]) / 2 for k in ("dense", "moe"))
    dtype = llms["dense"].engine.dtype
    print(
        f"decode step at batch {args.batch}, {dtype}: dense {dense:.2f} ms, MoE {moe:.2f} ms, "
        f"MoE/dense {moe / dense:.2f} (target <= 1.5) | load {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
