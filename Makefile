# Fresh-machine entry points. `make demo` and `make test` create .venv on first use.
# The constraints pin the CPU build of torch, so a CPU machine never downloads a CUDA build.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
# Where the CPU build of torch that the constraints pin is published. pip retries an unreachable
# index for minutes per package on an offline machine: no retries by default (PIP_RETRIES=5 on a
# flaky network).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_RETRIES ?= 0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The oldest supported stack (constraints/oldest.txt: torch 2.6.0 from PyPI, triton 3.2.0,
# transformers 4.57.1, TRL 1.16.0), which `make test` also runs.
OLDEST_VENV ?= .venv-oldest
OLDEST_CONSTRAINTS ?= constraints/oldest.txt
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_STAMP := $(OLDEST_VENV)/.installed-stamp

# On a GPU machine torch and triton are already installed: its own python runs the GPU targets.
GPU_PYTHON ?= python3

.PHONY: venv venv-oldest demo results results-full docs test test-newest test-oldest test-fast roofline bench bench-block bench-rollout bench-quick bench-save bench-compare versus-trl audit report gpu-report gpu-stack-check gpu-wheels clean

venv: $(STAMP)

# DeepSpeed (in the dev extra) is a source distribution: built first, without build isolation, with
# the pinned setuptools and wheel, so that the dev install finds it installed.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --retries $(PIP_RETRIES) -c $(CONSTRAINTS) setuptools wheel
	$(PY) -m pip install --quiet --retries $(PIP_RETRIES) --extra-index-url $(TORCH_INDEX) -c $(CONSTRAINTS) --no-build-isolation deepspeed
	$(PY) -m pip install --quiet --retries $(PIP_RETRIES) --extra-index-url $(TORCH_INDEX) -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

venv-oldest: $(OLDEST_STAMP)

$(OLDEST_STAMP): pyproject.toml $(OLDEST_CONSTRAINTS)
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --retries $(PIP_RETRIES) -c $(OLDEST_CONSTRAINTS) -e '.[test,bench,integration,trl]'
	touch $(OLDEST_STAMP)

demo: $(STAMP)
	$(PY) -m integration.demo

# Every committed result that a CPU regenerates in about half an hour, from the current code, each
# file stamped with its commit and command (integration/provenance.py): the demo, the DPS credit
# audit, the quick ablation, the estimator audit and the quick benchmarks with their report. The runs
# go to a fresh RESULTS_RUNS, so no checkpoint or run of older code is read back. Commit from a clean
# tree first: a stamp of a tree with uncommitted changes says -dirty (the benchmark report refuses it).
RESULTS_RUNS ?= runs/results
results: $(STAMP)
	rm -rf $(RESULTS_RUNS)
	$(PY) -m integration.demo --runs $(RESULTS_RUNS)/demo --cache $(RESULTS_RUNS)/cache
	$(PY) -m integration.credit_audit --prompts 64 --steps 60 --lr 0.0001 --runs $(RESULTS_RUNS)/credit_audit --cache $(RESULTS_RUNS)/cache
	$(PY) -m integration.ablation --task sort --quick --timing-rounds 3 --runs $(RESULTS_RUNS)/ablation --cache $(RESULTS_RUNS)/cache
	$(PY) benchmarks/estimator_audit.py
	$(PY) benchmarks/run.py --size quick
	$(PY) benchmarks/memory_linear_logprob.py
	$(PY) benchmarks/memory_stratified_logprob.py
	$(PY) benchmarks/memory_bgpo.py
	$(PY) benchmarks/report.py

# The results that take hours on 2 CPU cores (the 8-seed ablations, about 3 hours; the objective
# comparison, about 1.5 hours): `make results` leaves them, each stamped with the commit that made it.
results-full: results
	$(PY) -m integration.ablation --task sort --seeds 0 1 2 3 4 5 6 7 --steps 60 --lr 0.0001 --eval-prompts 512 --timing-rounds 20 --runs $(RESULTS_RUNS)/ablation --cache $(RESULTS_RUNS)/cache
	$(PY) -m integration.ablation --task constraints --seeds 0 1 2 3 4 5 6 7 --steps 60 --lr 0.0001 --eval-prompts 512 --timing-rounds 10 --runs $(RESULTS_RUNS)/ablation --cache $(RESULTS_RUNS)/cache
	$(PY) -m integration.ablation --task sudoku4 --seeds 0 1 2 3 4 5 6 7 --steps 40 --lr 0.0001 --eval-prompts 512 --timing-rounds 5 --runs $(RESULTS_RUNS)/ablation --cache $(RESULTS_RUNS)/cache
	$(PY) -m integration.compare_objectives --quick --tasks sort sudoku4 constraints json_schema --seeds 0 1 2 --runs $(RESULTS_RUNS)/objectives --cache $(RESULTS_RUNS)/cache

# The documentation site (mkdocs.yml) in site/, a few seconds: any warning fails it (a broken link
# or anchor, a docstring the API reference cannot read).
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# The site is built without --quiet: mkdocs does not count the warnings it does not print, so
# --strict --quiet passes a build with warnings.
# Tests run on two processes (pytest-xdist): the machines CI uses have two cores. `make test` runs
# the whole suite on the newest stack, then the suite without the tests marked slow on the oldest
# (what that stack cannot run skips with the reason).
test: test-newest test-oldest

test-newest: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mkdocs build --strict --site-dir site
	$(PY) -m pytest -q -n 2

# The slow tests of tests/released (training, saving and resuming the families' released code) run
# on the oldest stack too: that is the transformers line the released files were written for.
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_PY) -m pytest -q -n 2 -m "not slow"
	$(OLDEST_PY) -m pytest -q -n 2 -m slow tests/released

# The suite without the tests marked slow (end-to-end training, ahead-of-time compilation): a
# quick check while working; CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mkdocs build --strict --site-dir site
	$(PY) -m pytest -q -n 2 -m "not slow"

# The static H100 model of the hot kernels from their sm_90 SASS (no GPU): predicted ceilings vs bars.
roofline: $(STAMP)
	$(PY) -m daca_kernels.tools.roofline

bench-quick: $(STAMP)
	$(PY) benchmarks/run.py --size quick
	$(PY) benchmarks/memory_linear_logprob.py
	$(PY) benchmarks/memory_stratified_logprob.py
	$(PY) benchmarks/memory_bgpo.py
	$(PY) benchmarks/report.py

audit: $(STAMP)
	$(PY) benchmarks/estimator_audit.py

bench: $(STAMP)
	$(PY) benchmarks/run.py --size full
	$(PY) benchmarks/report.py

report: $(STAMP)
	$(PY) benchmarks/report.py

# The suites under pytest-benchmark (quick shapes on CPU, full on CUDA): save a run under
# .benchmarks/, or save one and compare it with the previous saved run.
bench-save: $(STAMP)
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-autosave

bench-compare: $(STAMP)
	$(PY) -m pytest benchmarks/ --benchmark-only --benchmark-autosave --benchmark-compare

# Block-wise decoding of SDAR / LLaDA2 doubles: KV cache against recomputing the prefix (CPU).
bench-block: $(STAMP)
	$(PY) benchmarks/block_rollout.py

# Full-attention rollouts (released Dream, LLaDA-8B, LLaDA-MoE code, scaled): exact sampler against the
# prefix / dual KV cache and parallel decoding; forward tokens, CPU wall-clock, agreement, sampling gap.
bench-rollout: $(STAMP)
	$(PY) benchmarks/full_rollout.py --output benchmarks/results/full_rollout.md

# linear_logprob against TRL's chunked head: time and peak memory side by side.
versus-trl: $(STAMP)
	$(PY) benchmarks/versus_trl.py

# Wheels, gpu tests, full benchmarks and report in under 9 minutes; offline, the project on
# PYTHONPATH (not installed); exits 2 without CUDA.
gpu-report:
	$(GPU_PYTHON) benchmarks/gpu_report.py

# A GPU image's software stack checked on a CPU machine, before a GPU is at hand (docs/measurements.md):
# GPU_PYTHON is a python with that image's torch, triton, transformers and pytest and nothing else.
# Collection of the whole suite, gpu-report's steps on CPU, the sm_80/sm_90 compile, the roofline.
gpu-stack-check:
	$(GPU_PYTHON) -m pytest --collect-only -qq -p no:cacheprovider
	$(GPU_PYTHON) benchmarks/gpu_report.py --cpu-check
	env -u TRITON_INTERPRET $(GPU_PYTHON) -m daca_kernels.tools.ahead_of_time --targets 80 90
	env -u TRITON_INTERPRET $(GPU_PYTHON) -m daca_kernels.tools.roofline

# On a machine with the package index: Liger-Kernel and Cut Cross-Entropy wheels for gpu-report.
gpu-wheels:
	$(GPU_PYTHON) benchmarks/download_wheels.py

clean:
	rm -rf $(VENV) $(OLDEST_VENV) .pytest_cache site
