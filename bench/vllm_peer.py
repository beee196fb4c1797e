"""Run one workload through vLLM (its CPU build) and print the timing as JSON: the benchmarks' peer.

Runs in vLLM's own interpreter (a separate venv), so it imports nothing from specserve. Input: a JSON file
with model, dtype, max_num_seqs, max_num_batched_tokens, speculative_config, kv_cache_bytes, repeats,
requests ([{prompt_token_ids, max_tokens}]) and optionally batches (lists of request indices run one after
another, e.g. one request at a time). Prompts arrive as token ids so every system sees the same tokens.
Output, written to the result file: {"load_seconds", "runs": [{"seconds", "output_tokens", "proposed",
"accepted", "mean_ttft_s"}]}; mean_ttft_s only with "ttft": true in the spec, which turns vLLM's stat
logging on (off by default for offline use: it costs a little per step) to read its TTFT histogram.

Optional for constrained decoding: "structured_outputs", a JSON schema applied to every request (vLLM's
`SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`, warm-up included, so the grammar
is compiled before the timing); "ignore_eos" (default true, false when a schema is given: a finished JSON
value can only be followed by EOS); "return_outputs": true adds each run's "outputs" ([{token_ids, text}] in
request order) to check them on the caller's side.

    /work/vllm-venv/bin/python bench/vllm_peer.py spec.json result.json
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams

    spec = json.loads(open(path, encoding="utf-8").read())
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        dtype=spec.get("dtype", "bfloat16"),
        max_num_seqs=spec.get("max_num_seqs", 64),
        max_num_batched_tokens=spec.get("max_num_batched_tokens", 2048),
        speculative_config=spec.get("speculative_config"),
        # A fixed KV budget (our engine's default) instead of a fraction of the machine's free memory,
        # which on a shared machine is whatever the neighbours left.
        kv_cache_memory_bytes=spec.get("kv_cache_bytes", 2 << 30),
        seed=0,
        disable_log_stats=not spec.get("ttft", False),
    )
    load_seconds = time.perf_counter() - t0
    requests = spec["requests"]
    batches = spec.get("batches") or [list(range(len(requests)))]
    schema = spec.get("structured_outputs")
    ignore_eos = spec.get("ignore_eos", schema is None)

    def params_for(max_tokens: int) -> SamplingParams:
        extra = {}
        if schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(json=schema)
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos, **extra)

    def run_once() -> dict:
        total_seconds, total_tokens = 0.0, 0
        outputs: list[dict | None] = [None] * len(requests)
        before, ttft_before = _spec_metrics(llm), _ttft(llm, spec)
        for batch in batches:
            prompts = [{"prompt_token_ids": requests[i]["prompt_token_ids"]} for i in batch]
            params = [params_for(requests[i]["max_tokens"]) for i in batch]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            total_seconds += time.perf_counter() - start
            for i, o in zip(batch, outs):
                total_tokens += len(o.outputs[0].token_ids)
                outputs[i] = {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
        after = _spec_metrics(llm)
        proposed, accepted = (after[0] - before[0], after[1] - before[1]) if after and before else (0, 0)
        run = {
            "seconds": total_seconds,
            "output_tokens": total_tokens,
            "proposed": proposed,
            "accepted": accepted,
        }
        if spec.get("return_outputs"):
            run["outputs"] = outputs
        ttft_after = _ttft(llm, spec)
        if ttft_before is not None and ttft_after is not None and ttft_after[1] > ttft_before[1]:
            run["mean_ttft_s"] = (ttft_after[0] - ttft_before[0]) / (ttft_after[1] - ttft_before[1])
        return run

    # Warm-up on a few short requests: lazy initialisation and compilation do not belong in the timing.
    warm = [{"prompt_token_ids": requests[0]["prompt_token_ids"]}] * 2
    llm.generate(warm, params_for(8), use_tqdm=False)
    runs = [run_once() for _ in range(spec.get("repeats", 1))]
    # vLLM logs to stdout too: the result goes to its own file.
    with open(result_path, "w", encoding="utf-8") as fh:
        json.dump({"load_seconds": load_seconds, "runs": runs}, fh)
    return 0


def _ttft(llm, spec: dict) -> tuple[float, int] | None:
    """vLLM's cumulative time-to-first-token histogram as (sum of seconds, count)."""
    if not spec.get("ttft"):
        return None
    for m in llm.get_metrics():
        if m.name == "vllm:time_to_first_token_seconds":
            return m.sum, m.count
    return None


def _spec_metrics(llm) -> tuple[int, int] | None:
    """Cumulative (draft tokens proposed, accepted) from vLLM's metrics, when speculation ran."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # older builds or metrics disabled: acceptance is then simply not reported
        return None
    proposed = accepted = 0
    for m in metrics:
        if m.name == "vllm:spec_decode_num_draft_tokens":
            proposed = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens":
            accepted = int(m.value)
    return proposed, accepted


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
