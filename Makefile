# kvscope task entry point. `make help` lists the targets.
# Everything installs into ./.venv; the first run takes ~3 min (the vLLM CPU build is ~3.5 GB).
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
PYTEST_ARGS ?=
BENCH_ARGS ?=

.PHONY: help demo test test-fast bench lint install system-deps clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s '	'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[vllm,test]'
	@# The PyPI torchvision does not import beside the CPU torch (environment.md); vLLM runs without them.
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

install: $(STAMP)  ## create .venv with kvscope, the vLLM CPU build and the test tools

system-deps:  ## Debian packages the tests need (headless Chromium)
	@command -v chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }

demo: $(STAMP)  ## README command 1: real vLLM demo fleet + gateway + workload + live dashboard
	$(BIN)/kvscope demo

test: $(STAMP) system-deps  ## README command 2: the whole test suite (starts vLLM servers and a broker itself)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)  ## tests that need no vLLM server, broker or browser
	$(BIN)/python -m pytest -m "not vllm and not broker and not browser" $(PYTEST_ARGS)

bench: $(STAMP)  ## fleet-scale figures beside their goals (10^6 and 10^7 requests, KV evidence at 10^6; ~45 min; docs/scale.md)
	$(BIN)/python -m bench.run $(BENCH_ARGS)

lint: $(STAMP)  ## ruff
	$(BIN)/ruff check .

clean:  ## remove the venv and demo state
	rm -rf $(VENV) .kvscope
