# make all   runs every numbered script with this machine's defaults (writes results/)
# make test  runs the test suite
# Both set up .venv from requirements.txt first when it is missing or out of date.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: all test setup clean-results collectives 01 02 03 04 05 06 07 08 09

all: 01 02 03 04 05 06 07 08 09

$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

01: $(STAMP)
	$(PY) 01_allreduce_bench.py

# Every collective, ring and tree all-reduce from scratch (about 2 minutes; not in `all`,
# which must stay under 15 minutes on 2 cores)
collectives: $(STAMP)
	$(PY) 01_allreduce_bench.py --ops all --iters 5 --warmup 2

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

08: $(STAMP)
	$(PY) 08_tensor_parallel.py --warmup 3

09: $(STAMP)
	$(PY) 09_pipeline_parallel.py --warmup 3

# ---- GPU measurements (README, "GPU runs"). On a machine with one GPU and torch installed:
#   make gpu PY=python3                    # or gpu-01 ... gpu-07, one at a time
# NCCL refuses two ranks on one GPU, so each DDP script runs twice: NCCL at 1 rank and gloo
# over CUDA tensors at 2 ranks. Every run is time-boxed (GPU_BOX seconds) and a failed or
# killed run does not stop the next one. Dry run of the plan on a CPU machine:
#   make gpu GPU_DEV=cpu GPU_NCCL=gloo GPU_SIZE=nano GPU_OUT=/tmp/gpu-dry
GPU_OUT  ?= results/gpu
GPU_BOX  ?= 540
GPU_DEV  ?= cuda
GPU_NCCL ?= nccl
GPU_SIZE ?= xl
GPU_DEPS := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
GPU_RUN   = -timeout -k 10 $(GPU_BOX) $(PY)
GPU_LM    = --device $(GPU_DEV) --model-size $(GPU_SIZE) --warmup 5 --steps 10
GPU_ONE   = --backend $(GPU_NCCL) --world-size 1 $(GPU_LM) --out $(GPU_OUT)/nccl_1rank
GPU_TWO   = --backend gloo --world-size 2 $(GPU_LM) --out $(GPU_OUT)/gloo_cuda_2ranks

.PHONY: gpu gpu-01 gpu-02 gpu-03 gpu-04 gpu-05 gpu-06 gpu-07

# most wanted first: a session's 30 minutes of device time may not cover all of it
gpu: gpu-01 gpu-04 gpu-05 gpu-06 gpu-02 gpu-03 gpu-07

gpu-01: $(GPU_DEPS)
	$(GPU_RUN) 01_allreduce_bench.py --configs $(GPU_NCCL)-$(GPU_DEV) gloo-$(GPU_DEV) \
	    --world-sizes 1 2 4 6 --time-box 60 --out $(GPU_OUT)

gpu-04 gpu-06 gpu-07: gpu-0%: $(GPU_DEPS)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_ONE)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_TWO)

# 04's table times naive (02) and flat (03) DDP beside the overlapped one, on the same
# ranks, so on the GPU 02 and 03 only verify themselves there
gpu-02 gpu-03: gpu-0%: $(GPU_DEPS)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_ONE) --no-bench
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_TWO) --no-bench

# At 1 rank, 20 steps: plain training, ours and torch DDP are within a few per cent there.
# At 2 ranks the sweep alone (ours, torch DDP and plain at 4 caps) nearly fills a time box:
# gpu-03 and gpu-04 time the unbucketed baselines on the same setting, and no bucket size
# starts after GPU_SWEEP_BOX seconds (each finished size is saved at once). Two XL ranks
# with AdamW need 38-41 GiB each: on an 80 GB GPU the 2-rank run fails (out of memory);
# results/gpu/ has it from an H200.
GPU_SWEEP_BOX ?= 400
gpu-05: $(GPU_DEPS)
	$(GPU_RUN) 05_bucketed_ddp.py $(GPU_ONE) --steps 20
	$(GPU_RUN) 05_bucketed_ddp.py $(GPU_TWO) --no-baselines --time-box $(GPU_SWEEP_BOX)
