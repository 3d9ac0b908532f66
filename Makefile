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
# Tests go out a few at a time in collection order, slow ones first (tests/conftest.py), so the two
# workers finish together; an xdist_group keeps tests that share an expensive fixture on one worker.
test: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests
	$(PY) -m pytest -n 2 --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests

clean:
	rm -rf $(VENV) build *.egg-info
