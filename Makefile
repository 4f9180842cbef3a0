# make all   runs every numbered script with this machine's defaults (writes results/): before
#            each, [k/N] and how long it took last time; after all, a summary table
#            (results/SUMMARY.md), and the README's and docs/' tables and headlines refreshed.
#            A script that fails does not stop the others; make all then exits 1 naming it.
# make levers the memory levers' tables (bf16 in 05 and 07, sequence parallelism in 08,
#            recomputation in 09, all of them on one mesh of 10), each verified first, into
#            results/NN_*/ folders (about 5 minutes; not in `all`, which must stay under 15)
# make checkpoints sharded checkpoints (07's save_sharded, sync and async) beside
#            torch.distributed.checkpoint's save and async_save on FSDP2 (results/07_checkpoint;
#            about 30 seconds; not in `all`)
# make cp-sweep one attention from 1k to 32k tokens, one process beside every context-parallel
#            method at cp 2 and 4: time and peak memory (results/11_sweep/; about 6 minutes)
# make per-param what each hook-driven class (04, 05, 06, 07) costs a parameter a step beside torch DDP
#            and FSDP2, on a probe of many small parameters at 1 rank and 2, the recorder off, on and
#            checking (about 4 minutes; not in `all`)
# make recorder-cost what the flight recorder (every job runs under it) and --check-collectives cost a step:
#            05's DDPBucketed and 10's pp 2 x dp 2 mesh, steps alternating (about 1 minute; not in `all`)
# make setup-memory (13) each rank's peak host memory while it sets up the medium LM on 8 ranks, built whole
#            or on the meta device (ours, FSDP2's), then the large LM (whole on 8 ranks: 22 GiB) built on
#            meta and trained a step (about 2 minutes; not in `all`)
# make data-bench (13) its corpus prepared by every core beside a nanoGPT-style datasets.map(num_proc), and
#            each rank's peak memory and data time a step at 1x, 10x and 100x a 10 MB corpus
#            (results/13_data_bench_*.md; about 2 minutes; not in `all`)
# make tp-families (08) every text family transformers ships a tensor-parallel plan for, built tiny, split at
#            tp 2 by its own plan (08's model_plan) and checked beside one process: PASS, refused or skipped
#            a family (results/tp_families.md; about a minute; not in `all`)
# make hf-checkpoint (13) the medium LM as a sharded safetensors folder, set up from it and saved again on 8
#            ranks (ours on pp 2 x fsdp 2 x tp 2 and fsdp 8, torch.distributed.checkpoint's Hugging Face
#            reader and writer on FSDP2): each rank's peak host memory and the time (about 30 s; not in `all`)
# make 14   replicas that survive a loss (in `all`): 3 replicas of 2 ranks through a kill -9, a kill during a
#            heal, a SIGSTOP and two lost at once, replayed in one process; then a step beside torch DDP,
#            a kill and a heal at 2, 3 and 4 replicas (about 30 s)
# make torchft-bench 14's benchmark with torchft's Manager beside ours on the same model and batches,
#            then 13's run on 3 replicas of fsdp 2, ours beside torchft's (installs torchft 0.2.0 from
#            requirements-torchft.txt into .venv; results/14_torchft/; about 2 minutes; not in `all`)
# make train 13's default run: its own tiny Llama-style model (a byte-level BPE tokenizer trained on
#            Python's help text) trained on that text on fsdp 2, checked against one process first,
#            saved as a Hugging Face folder (runs/13_train/final) with a sample, the summary in
#            results/13_train.md (about 1 minute; needs transformers, from requirements-test.txt,
#            which it installs; `all` runs it as 13); make train-bench: its step beside torch's own (FSDP2 and
#            torch.distributed.checkpoint) on that model and on one twice as wide and deep
#            (results/13_train_bench.md; about 1 minute)
# make test  runs the test suite (two workers; TEST_WORKERS=N for more), with transformers
#            (requirements-test.txt) installed for the models people bring
# make docs  refreshes the tables and headlines of README.md and docs/ from results/
# Each sets up .venv from requirements.txt first when it is missing or out of date.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
SCRIPTS := 01 02 03 04 05 06 07 08 09 10 11 12 13 14

.PHONY: all test setup docs train train-bench torchft-bench data-bench tp-families clean-results collectives levers cp-sweep checkpoints per-param recorder-cost setup-memory hf-checkpoint $(SCRIPTS)

all: $(STAMP)
	@MAKE="$(MAKE)" $(PY) tools/report.py all $(SCRIPTS)

docs:
	@$(PYTHON) tools/report.py inject

# pip installs without byte-compiling (it compiles one file after another: torch's 10,000
# took 19 s of a 34 s install here); compileall then does it on every core (11 s on 2 cores),
# skipping what is compiled already and, as pip does, the few files that do not compile
# (torch's Python 3.12 test helpers)
COMPILE = $(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
$(STAMP): requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --no-compile -r requirements.txt
	$(COMPILE)
	touch $(STAMP)

setup: $(STAMP)

# make test also installs requirements-test.txt (transformers, for the models people bring)
TEST_STAMP := $(VENV)/.installed-test
$(TEST_STAMP): requirements-test.txt $(STAMP)
	$(PY) -m pip install --no-compile -r requirements-test.txt
	$(COMPILE)
	touch $(TEST_STAMP)

# two workers, each file on one of them (a file's tests share their spawned jobs), the files in
# conftest.py's order (the longest first; xdist would start the files with the most tests
# first, and left the longest for the end), the slowest 25 tests listed at the end so the next
# slow one is seen
TEST_WORKERS ?= 2
test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

train: $(TEST_STAMP)
	rm -rf runs/13_train
	$(PY) 13_train.py --out results

# make all's 13 is make train (transformers, from requirements-test.txt, installed for it)
13: train

train-bench: $(TEST_STAMP)
	$(PY) 13_train.py --bench --out results

# 3 timed iterations a size after 1 warm-up (the script's default is 10 after 5; a 1 GB
# all-reduce at 6 ranks takes 2.5 s here): make all stays under 15 minutes
01: $(STAMP)
	$(PY) 01_allreduce_bench.py --iters 2 --warmup 1 --out results

# Every collective, ring and tree all-reduce from scratch (about 2 minutes; not in `all`,
# which must stay under 15 minutes on 2 cores)
collectives: $(STAMP)
	$(PY) 01_allreduce_bench.py --ops all --iters 5 --warmup 2 --out results

02: $(STAMP)
	$(PY) 02_naive_ddp.py --out results

clean-results:
	rm -rf results

03: $(STAMP)
	$(PY) 03_flat_ddp.py --out results

04: $(STAMP)
	$(PY) 04_overlap_ddp.py --out results

# 5 paired steps a setting (the script's default is 20): make all stays under 15 minutes
05: $(STAMP)
	$(PY) 05_bucketed_ddp.py --steps 5 --out results

# with its ZeRO stage table (stages 0 to 3, ours beside torch's); 5 paired steps (the
# script's default is 10): make all stays under 15 minutes
06: $(STAMP)
	$(PY) 06_sharded_optimizer.py --steps 5 --out results

07: $(STAMP)
	$(PY) 07_fsdp.py --out results

per-param: $(STAMP)
	$(PY) 05_bucketed_ddp.py --per-param --no-verify --steps 30 --out results

recorder-cost: $(STAMP)
	$(PY) 05_bucketed_ddp.py --recorder-cost --bucket-mb 25 --no-verify --steps 40 --out results
	$(PY) 10_nd_parallel.py --recorder-cost --no-verify --steps 40 --out results

setup-memory: $(STAMP)
	$(PY) 13_train.py --setup-memory --out results

hf-checkpoint: $(STAMP)
	$(PY) 13_train.py --hf-checkpoint --out results

# 13's corpus: preparation beside a nanoGPT-style datasets.map (datasets installed for it), and
# each rank's memory and data time at 1x, 10x, 100x (tools/data_bench.py; about 2 minutes)
data-bench: $(TEST_STAMP)
	$(PY) -m pip install --no-compile -q datasets
	test -f runs/13_tiny_model/config.json || $(MAKE) train
	$(PY) tools/data_bench.py --out results

# 08's model_plan on every transformers text family with a tp plan, tiny, at tp 2 beside one process
# (tools/tp_families.py; about a minute)
tp-families: $(TEST_STAMP)
	$(PY) tools/tp_families.py --out results

checkpoints: $(STAMP)
	$(PY) 07_fsdp.py --no-verify --checkpoint-bench --out results

# 2 ranks (TP 2 against DP 2 and torch's TP): make all stays under 15 minutes on 2 cores.
# The script's default adds 4 ranks (TP 4, TP 2 x DP 2), about 2 minutes more here:
#   python 08_tensor_parallel.py --warmup 3 --out results/08_world_sizes_2_4
08: $(STAMP)
	$(PY) 08_tensor_parallel.py --warmup 3 --world-sizes 2 --out results

# 2 stages at m = 1 and 8, the bubble's two ends, every schedule (interleaved at m = 8 only:
# groups of p), 5 paired steps: make all stays under 15 minutes on 2 cores. The write-up's tables add 4 stages:
#   python 09_pipeline_parallel.py --warmup 3 --microbatches 1 8 --out results/09_stages_2_4
#   python 09_pipeline_parallel.py --warmup 3 --microbatches 4 8 --steps 20 --no-verify --out results/09_schedules
09: $(STAMP)
	$(PY) 09_pipeline_parallel.py --warmup 2 --steps 5 --microbatches 1 8 --stages 2 --out results

# the suite: every verified mesh at 4, 6 and 8 ranks, timed beside torch's composition (5 paired
# steps: make all stays under 15 minutes), and the XXL plan
10: $(STAMP)
	$(PY) 10_nd_parallel.py --warmup 2 --steps 5 --out results

# The memory levers, each verified, then measured beside float32 / no lever and torch's twin:
# bf16 autocast in 05 (25 MB buckets, ours and torch DDP) and 07 (FSDP reducing in float32
# beside FSDP2's MixedPrecisionPolicy); sequence parallelism in 08 (beside torch's
# SequenceParallel); each recomputation mode in 09 (2 stages, 1F1B, m 8); and all three on
# one mesh of 10 (pp 2 x tp 2)
levers: $(STAMP)
	$(PY) 05_bucketed_ddp.py --steps 10 --dtype bf16 --bucket-mb 25 --models lm --no-baselines --out results/05_bf16
	$(PY) 07_fsdp.py --dtype bf16 --out results/07_bf16
	$(PY) 08_tensor_parallel.py --warmup 3 --world-sizes 2 --sp --out results/08_sp
	$(PY) 09_pipeline_parallel.py --warmup 3 --microbatches 8 --stages 2 --schedule 1f1b \
	    --recompute none selective full --out results/09_recompute
	$(PY) 10_nd_parallel.py --warmup 3 --pp 2 --tp 2 --sp --recompute selective --dtype bf16 --out results/10_levers

# cp 2: every method and layout verified, timed at 512 and 2048 tokens; the write-up adds cp 4:
#   python 11_context_parallel.py --cp 4 --out results/11_cp_4
11: $(STAMP)
	$(PY) 11_context_parallel.py --warmup 3 --out results

# One attention from 1k to 32k tokens: one process, then ring, allgather and ulysses at cp 2
# and 4, time and peak memory per rank, into results/11_sweep/ (about 6 minutes; not in `all`)
cp-sweep: $(STAMP)
	@mkdir -p results/11_sweep
	$(PY) 11_context_parallel.py --sweep --no-verify --steps 2 --warmup 1 --out results/11_sweep

# ep 2 (8 experts, top-2, capacity 1.25): every case verified, EP beside the replicated MoE and a dense model
12: $(STAMP)
	$(PY) 12_expert_parallel.py --warmup 3 --experts 8 --out results

14: $(STAMP)
	$(PY) 14_fault_tolerant_dp.py --out results

# 14's benchmark with torchft's Manager beside ours (torchft installed from requirements-torchft.txt
# into .venv first; its lighthouse and servers on loopback): results/14_torchft/; then 13's run on
# 3 replicas of fsdp 2 (its own tiny model and text), ours beside torchft's Manager on each rank
TORCHFT_STAMP := $(VENV)/.installed-torchft
$(TORCHFT_STAMP): requirements-torchft.txt $(TEST_STAMP)
	$(PY) -m pip install --no-compile -r requirements-torchft.txt
	$(COMPILE)
	touch $(TORCHFT_STAMP)

torchft-bench: $(TORCHFT_STAMP)
	$(PY) 14_fault_tolerant_dp.py --no-verify --out results/14_torchft
	$(PY) 13_train.py --replicas 3 --fsdp 2 --bench --run-dir runs/13_torchft --out results/14_torchft

# ---- GPU measurements (README, "GPU runs"). On a machine with one GPU and torch installed:
#   make gpu-check PY=python3              # first: kernels, a measured table, every smoke job (8 min)
#   make gpu PY=python3                    # or gpu-01 ... gpu-09, one at a time
# NCCL refuses two ranks on one GPU, so each DDP script runs twice: NCCL at 1 rank and gloo
# over CUDA tensors at 2 ranks; 08 and 09 need 2 ranks, so gloo only. Every run is
# time-boxed (GPU_BOX seconds) and a failed or killed run does not stop the next one. Dry
# runs on a CPU machine:
#   make gpu GPU_DEV=cpu GPU_NCCL=gloo GPU_SIZE=nano GPU_OUT=/tmp/gpu-dry
#   make gpu-check GPU_DEV=cpu GPU_NCCL=gloo GPU_SIZE=nano GPU_OUT=/tmp/gpu-dry
GPU_OUT  ?= results/gpu
GPU_BOX  ?= 540
GPU_DEV  ?= cuda
GPU_NCCL ?= nccl
GPU_SIZE ?=
GPU_DEPS := $(if $(filter $(VENV)/bin/python,$(PY)),$(STAMP))
GPU_RUN   = -timeout -k 10 $(GPU_BOX) $(PY)
GPU_LM    = --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),xl) --warmup 5 --steps 10
GPU_ONE   = --backend $(GPU_NCCL) --world-size 1 $(GPU_LM) --out $(GPU_OUT)/nccl_1rank
GPU_TWO   = --backend gloo --world-size 2 $(GPU_LM) --out $(GPU_OUT)/gloo_cuda_2ranks
# where two ranks share one 80 GB GPU and XL does not fit or split: torch DDP's own buckets
# take two XL ranks past 40 GiB each (05), and XL's 25 heads do not split over 2 ranks (08)
GPU_TWO_LARGE = $(subst --model-size $(or $(GPU_SIZE),xl),--model-size $(or $(GPU_SIZE),large),$(GPU_TWO))

.PHONY: gpu gpu-smoke gpu-01 gpu-02 gpu-03 gpu-04 gpu-05 gpu-06 gpu-07 gpu-08 gpu-09 gpu-10 gpu-11 gpu-12

# most wanted first: a session's 30 minutes of device time may not cover all of it
gpu: gpu-01 gpu-04 gpu-05 gpu-06 gpu-07 gpu-08 gpu-09 gpu-10 gpu-11 gpu-12 gpu-02 gpu-03

gpu-01: $(GPU_DEPS)
	$(GPU_RUN) 01_allreduce_bench.py --configs $(GPU_NCCL)-$(GPU_DEV) gloo-$(GPU_DEV) \
	    --world-sizes 1 2 4 6 --time-box 60 --out $(GPU_OUT)

# 06 at XL: its ZeRO stage table (ZeRO-2 beside stages 1 and 3, torch's beside ours); 07 in
# bf16 too (its FSDP reducing in float32 beside FSDP2's MixedPrecisionPolicy)
gpu-04 gpu-06: gpu-0%: $(GPU_DEPS)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_ONE)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_TWO)

# 07 over gloo at 2 ranks: every collective staged through host memory (a large LM did not
# finish 5 steps in 2 minutes on an H200), so FSDP beside FSDP2 at medium, boxed at 90 s
gpu-07: $(GPU_DEPS)
	$(GPU_RUN) 07_fsdp.py $(GPU_ONE) --dtype bf16
	$(GPU_RUN) 07_fsdp.py --backend gloo --world-size 2 --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),medium) \
	    --methods fsdp recomputed --warmup 2 --steps 3 --time-box 90 --out $(GPU_OUT)/gloo_cuda_2ranks

# 04's table times naive (02) and flat (03) DDP beside the overlapped one, on the same
# ranks, so on the GPU 02 and 03 only verify themselves there
gpu-02 gpu-03: gpu-0%: $(GPU_DEPS)
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_ONE) --no-bench
	$(GPU_RUN) $(wildcard 0$*_*.py) $(GPU_TWO) --no-bench

# At 1 rank, 20 steps: plain training, ours and torch DDP are within a few per cent there.
# At 2 ranks the sweep alone (ours, torch DDP and plain at 4 caps) nearly fills a time box:
# gpu-03 and gpu-04 time the unbucketed baselines on the same setting, and no bucket size
# starts after GPU_SWEEP_BOX seconds (each finished size is saved at once). results/gpu/
# has the 2-rank sweep at XL from an H200.
GPU_SWEEP_BOX ?= 400
gpu-05: $(GPU_DEPS)
	$(GPU_RUN) 05_bucketed_ddp.py $(GPU_ONE) --steps 20
	$(GPU_RUN) 05_bucketed_ddp.py $(subst nccl_1rank,nccl_1rank_bf16,$(GPU_ONE)) --steps 20 --dtype bf16 \
	    --bucket-mb 25 --models lm --no-baselines
	$(GPU_RUN) 05_bucketed_ddp.py $(GPU_TWO_LARGE) --no-baselines --time-box $(GPU_SWEEP_BOX)

gpu-08: $(GPU_DEPS)
	$(GPU_RUN) 08_tensor_parallel.py $(GPU_TWO_LARGE) --world-sizes 2 --sp

gpu-09: $(GPU_DEPS)
	$(GPU_RUN) 09_pipeline_parallel.py $(GPU_TWO) --stages 2 --recompute none selective full

# 8 ranks over gloo on the one GPU, the small LM: memory and MFU, not link speeds
gpu-10: $(GPU_DEPS)
	$(GPU_RUN) 10_nd_parallel.py --backend gloo --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),small) \
	    --fsdp 2 --tp 2 --pp 2 --warmup 5 --steps 10 --out $(GPU_OUT)/gloo_cuda_8ranks

# cp 2 over gloo on the one GPU (ring staged through host memory), beside torch's own
# context_parallel (which runs on CUDA only); then the sweep of one attention from 1k to 32k
# tokens at cp 2 and 4, torch's context_parallel beside every method
gpu-11: $(GPU_DEPS)
	$(GPU_RUN) 11_context_parallel.py --backend gloo --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),small) \
	    --cp 2 --seq-lens 1024 4096 --warmup 5 --steps 10 --dtype bf16 --out $(GPU_OUT)/gloo_cuda_2ranks
	$(GPU_RUN) 11_context_parallel.py --backend gloo --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),small) \
	    --sweep --no-verify --steps 2 --warmup 1 --out $(GPU_OUT)/sweep

# ep 2 over gloo on the one GPU (all-to-alls staged through host memory: 5 steps, so the time
# model's 14 rounds and the capacity table's 20 steps a factor fit the box), and NCCL at ep 1
# in bf16 (torch._grouped_mm)
gpu-12: $(GPU_DEPS)
	$(GPU_RUN) 12_expert_parallel.py --backend gloo --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),small) \
	    --ep 2 --experts 8 --warmup 3 --steps 5 --out $(GPU_OUT)/gloo_cuda_2ranks
	$(GPU_RUN) 12_expert_parallel.py --backend $(GPU_NCCL) --device $(GPU_DEV) --model-size $(or $(GPU_SIZE),small) \
	    --ep 1 --experts 8 --warmup 5 --steps 10 --dtype bf16 --out $(GPU_OUT)/nccl_1rank

# ---- make gpu-check: everything a lent GPU should run, one command of at most 8 minutes
# (tools/gpu_check.py): the CUDA kernel tests, a short measured table at 1 NCCL rank (05 vs
# torch DDP, 07 vs FSDP2, 12 grouped vs loop in bf16) and every script's smoke job, writing
# GPU_OUT/check/SUMMARY.md as it goes. make gpu-smoke: the smoke jobs alone (verification
# and a few steps of each script at a small size, SMOKE_JOBS at once, each time-boxed; one
# log per job and SUMMARY.md under SMOKE_OUT). Each fails if a job did. Dry runs on a CPU
# machine (gloo in NCCL's place; the smoke jobs then run under the device audit):
#   make gpu-check GPU_DEV=cpu GPU_NCCL=gloo GPU_SIZE=nano GPU_OUT=/tmp/gpu-dry
# SMOKE: the scripts whose smoke jobs run (and measured jobs, unless MEASURE names others)
SMOKE      ?= 01 02 03 04 05 06 07 08 09 10 11 12 13 14
MEASURE    ?=
SMOKE_OUT  ?= $(GPU_OUT)/smoke
# (empty: sized to this machine's CPU count, tools/gpu_check.py --help)
SMOKE_JOBS ?=
SMOKE_BOX  ?=
# seconds after which no job of make gpu-check starts or runs on (empty: 450 on 8 cores or more)
CHECK_BUDGET ?=
# a .tgz that GPU_OUT/check (CHECK_ARCHIVE) or GPU_OUT/train (TRAIN_ARCHIVE) is packed into every
# 15 s and at the end, whole at every moment: a lease's call cut short still brings it back
CHECK_ARCHIVE ?=
TRAIN_ARCHIVE ?=
GPU_CHECK   = $(PY) tools/gpu_check.py --device $(GPU_DEV) --nccl $(GPU_NCCL) $(if $(GPU_SIZE),--size $(GPU_SIZE)) \
              --python $(PY) --scripts $(SMOKE) $(if $(MEASURE),--measure $(MEASURE)) $(if $(SMOKE_JOBS),--jobs $(SMOKE_JOBS)) $(if $(SMOKE_BOX),--box $(SMOKE_BOX))
.PHONY: gpu-check
gpu-check: $(GPU_DEPS)
	@$(GPU_CHECK) $(if $(CHECK_BUDGET),--budget $(CHECK_BUDGET)) $(if $(CHECK_ARCHIVE),--archive $(CHECK_ARCHIVE)) \
	    --out $(GPU_OUT)/check

gpu-smoke: $(GPU_DEPS)
	@rm -rf $(SMOKE_OUT)
	@$(GPU_CHECK) --parts smoke --out $(SMOKE_OUT)

# ---- make gpu-train: 13's run at about 1 B parameters on one GPU (context 2048, bf16, compile;
# recompute where it runs out of memory) beside torch's FSDP2 + compile on the same model and
# batches: tokens/s, MFU, peak memory (tools/gpu_train.py; GPU_OUT/train). Dry run on a CPU:
#   make gpu-train GPU_DEV=cpu TRAIN_SIZE=tiny GPU_OUT=/tmp/gpu-dry
TRAIN_SIZE ?= 1b
TRAIN_BOX  ?= 420
# GPUs (ranks) to use (empty: every GPU there is; 1 on GPU_DEV=cpu): 2 or more add fsdp over all
# of them and tp 2 inside dp over the rest, after the one-GPU run
TRAIN_RANKS ?=
.PHONY: gpu-train
gpu-train: $(GPU_DEPS)
	@$(PY) tools/gpu_train.py --device $(GPU_DEV) --size $(TRAIN_SIZE) --python $(PY) --box $(TRAIN_BOX) \
	    $(if $(TRAIN_ARCHIVE),--archive $(TRAIN_ARCHIVE)) $(if $(TRAIN_RANKS),--ranks $(TRAIN_RANKS)) --out $(GPU_OUT)/train
