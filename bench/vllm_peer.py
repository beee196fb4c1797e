"""Run one workload through vLLM (its CPU build) and print the timing as JSON: the benchmarks' peer.

Runs in vLLM's own interpreter (a separate venv), so it imports nothing from specserve. Input: a JSON file
with model, dtype, max_num_seqs, max_num_batched_tokens, speculative_config, kv_cache_bytes, repeats,
requests ([{prompt_token_ids, max_tokens}, optionally temperature, top_p and seed: greedy without them]) and
optionally batches (lists of request indices run one after another, e.g. one request at a time). Prompts
arrive as token ids so every system sees the same tokens. Output, written to the result file:
{"load_seconds", "runs": [{"seconds", "batch_seconds", "output_tokens", "proposed", "accepted", "drafts",
"accepted_per_position", "mean_ttft_s"}]}; batch_seconds: each batch's wall time, in batch order. "ttft":
true in the spec turns vLLM's stat logging on (off by default for offline use: it costs a little per step):
mean_ttft_s comes from its TTFT histogram, and the speculation counters (draft tokens proposed and accepted,
verify steps with drafts, accepted tokens per draft position) only count with it on.

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

    def params_for(request: dict) -> SamplingParams:
        extra = {}
        if schema is not None:
            from vllm.sampling_params import StructuredOutputsParams

            extra["structured_outputs"] = StructuredOutputsParams(json=schema)
        return SamplingParams(
            max_tokens=request["max_tokens"],
            temperature=request.get("temperature", 0.0),
            top_p=request.get("top_p", 1.0),
            seed=request.get("seed"),
            ignore_eos=ignore_eos,
            **extra,
        )

    def run_once() -> dict:
        batch_seconds: list[float] = []
        total_tokens = 0
        outputs: list[dict | None] = [None] * len(requests)
        before, ttft_before = _spec_metrics(llm), _ttft(llm, spec)
        for batch in batches:
            prompts = [{"prompt_token_ids": requests[i]["prompt_token_ids"]} for i in batch]
            params = [params_for(requests[i]) for i in batch]
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            batch_seconds.append(time.perf_counter() - start)
            for i, o in zip(batch, outs):
                total_tokens += len(o.outputs[0].token_ids)
                outputs[i] = {"token_ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text}
        after = _spec_metrics(llm)
        run = {
            "seconds": sum(batch_seconds),
            "batch_seconds": batch_seconds,
            "output_tokens": total_tokens,
            **_spec_delta(before, after),
        }
        if spec.get("return_outputs"):
            run["outputs"] = outputs
        ttft_after = _ttft(llm, spec)
        if ttft_before is not None and ttft_after is not None and ttft_after[1] > ttft_before[1]:
            run["mean_ttft_s"] = (ttft_after[0] - ttft_before[0]) / (ttft_after[1] - ttft_before[1])
        return run

    # Warm-up on a few short requests: lazy initialisation and compilation do not belong in the timing.
    warm = [{"prompt_token_ids": requests[0]["prompt_token_ids"]}] * 2
    llm.generate(warm, params_for({"max_tokens": 8}), use_tqdm=False)
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


SPEC_COUNTERS = {
    "vllm:spec_decode_num_draft_tokens": "proposed",
    "vllm:spec_decode_num_accepted_tokens": "accepted",
    "vllm:spec_decode_num_drafts": "drafts",
}


def _spec_metrics(llm) -> dict | None:
    """Cumulative speculation counters from vLLM's metrics: draft tokens proposed and accepted, verify steps
    that carried drafts, and accepted tokens per draft position (a draft token counts there only when every
    one before it was accepted too)."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # older builds or metrics disabled: acceptance is then simply not reported
        return None
    out: dict = {"proposed": 0, "accepted": 0, "drafts": 0, "accepted_per_position": []}
    for m in metrics:
        if m.name in SPEC_COUNTERS:
            out[SPEC_COUNTERS[m.name]] = int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            out["accepted_per_position"] = list(m.values)
    return out


def _spec_delta(before: dict | None, after: dict | None) -> dict:
    """What one run added to the counters of _spec_metrics (all zero where they could not be read)."""
    if before is None or after is None:
        return {"proposed": 0, "accepted": 0, "drafts": 0, "accepted_per_position": []}
    prior = before["accepted_per_position"]
    per_pos = [n - (prior[j] if j < len(prior) else 0) for j, n in enumerate(after["accepted_per_position"])]
    return {**{k: after[k] - before[k] for k in SPEC_COUNTERS.values()}, "accepted_per_position": per_pos}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
