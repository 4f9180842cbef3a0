# make all   runs every numbered script with this machine's defaults (writes results/)
# make test  runs the test suite
# Both set up .venv from requirements.txt first when it is missing or out of date.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all test setup clean-results 01 02 03 04 05 06 07

all: 01 02 03 04 05 06 07

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

03: $(STAMP)
	$(PY) 03_flat_ddp.py

04: $(STAMP)
	$(PY) 04_overlap_ddp.py

05: $(STAMP)
	$(PY) 05_bucketed_ddp.py

06: $(STAMP)
	$(PY) 06_sharded_optimizer.py

07: $(STAMP)
	$(PY) 07_fsdp.py
