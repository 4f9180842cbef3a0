# make all   runs every numbered script with this machine's defaults (writes results/)
# make test  runs the test suite
# Both set up .venv from requirements.txt first when it is missing or out of date.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all test setup clean-results 01 02

all: 01 02

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

01: $(STAMP)
	$(PY) 01_allreduce_bench.py

02: $(STAMP)
	$(PY) 02_naive_ddp.py

clean-results:
	rm -rf results
