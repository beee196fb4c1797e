#!/usr/bin/env bash
# What the lent GPU machine runs, from the checkout's root, with bench/gpu/pack.sh's folders beside it.
#   bash bench/gpu/device.sh kernels   first call (carries .gpu/): the ceilings and the kernel part
#   bash bench/gpu/device.sh model     second call on the same warm machine (carries .gpu-b/): the demo model
#                                      joined, then the engine, graph, throughput and worker parts (~8 min)
#   bash bench/gpu/device.sh eagle     a third call, where device time is left: an EAGLE-3 head trained
# PARTS and BUDGET (seconds) choose the model call's parts and time, e.g. PARTS=env,worker,graphs BUDGET=300
# for a rerun of what an earlier report lacks; EAGLE_MIN (whole minutes) and GEN_BATCH size the training,
# EAGLE_PROMPTS names its prompts file under .gpu (eagle_prompts.jsonl: package prose; eagle_prompts_mixed.jsonl).
# On an H200 the parts took: kernels 57 s (38 Triton variants compiled), the engine's comparisons 14 s a
# family, the worker 26 s to start (the model dequantized, 55 graphs captured): the shares in run.py.
# Everything worth keeping lands in $OUT (the device tool brings back at most 8 files of 16 MiB).
set -u
stage=${1:?stage: kernels, model or eagle}
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .gpu/whl/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  TRANSFORMERS_VERBOSITY=error HF_HUB_DISABLE_PROGRESS_BARS=1 TQDM_DISABLE=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,temperature.gpu --format=csv
GGUF=.gpu/SmolLM2-135M-Instruct.Q4_1.gguf
case $stage in
  kernels)
    timeout 200 python3 bench/gpu/run.py --out "$OUT" --parts env,kernels --budget-s 120
    ;;
  model)
    if [ -f .gpu/model.part-a ] && [ -f .gpu-b/model.part-b ]; then
      cat .gpu/model.part-a .gpu-b/model.part-b > "$GGUF"
      echo "$(cat .gpu/model.sha256)  $GGUF" | sha256sum -c - || rm -f "$GGUF"
    fi
    budget=${BUDGET:-530}
    timeout $((budget + 30)) python3 bench/gpu/run.py --out "$OUT" --model "$GGUF" --workload .gpu/w1_256.jsonl \
      --parts "${PARTS:-env,engine,graphs,throughput,worker}" --budget-s "$budget"
    ;;
  eagle)
    prompts=.gpu/${EAGLE_PROMPTS:-eagle_prompts.jsonl}
    if [ -f "$GGUF" ] && [ -f "$prompts" ]; then
      minutes=${EAGLE_MIN:-6}
      timeout $((minutes * 60 + 60)) python3 tools/train_eagle.py --device cuda --target "$GGUF" \
        --prompts "$prompts" --out /tmp/eagle3 --work /tmp/eagle3-work \
        --gen-batch "${GEN_BATCH:-256}" --verifier-name HuggingFaceTB/SmolLM2-135M-Instruct \
        --time-budget-min "$minutes" > "$OUT/eagle-train.log" 2>&1
      (cd /tmp && tar cf eagle3.tar eagle3 && split -b 15M eagle3.tar "$OUT/eagle3.tar.")
    fi
    ;;
esac
ls -la "$OUT"
