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

test: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests
	TRITON_INTERPRET=1 $(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check appliance kernels graphs server tests

clean:
	rm -rf $(VENV) build *.egg-info
