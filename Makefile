# `make run`: set up this machine and start the server on the embedded tiny model.
# `make test`: set up the same way and run the whole test suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml scripts/setup-venv.sh
	scripts/setup-venv.sh $(VENV)
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/appliance serve

# Two workers: the CPU suite is hundreds of small torch ops per token, single-threaded per worker.
# Without CUDA the Triton kernels run under the interpreter (tests/conftest.py sets TRITON_INTERPRET).
test: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests

clean:
	rm -rf $(VENV) build *.egg-info
