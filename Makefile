# Fresh-machine entry points. `make demo` and `make test` create .venv on first use.
# The constraints pin the CPU build of torch, so a CPU machine never downloads a CUDA build.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test bench bench-quick audit report clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m integration.demo

test: $(STAMP)
	$(PY) -m pytest -q

bench-quick: $(STAMP)
	DACA_BENCH_QUICK=1 $(PY) -m pytest benchmarks -q -p no:cacheprovider -o python_files='bench_*.py'
	$(PY) benchmarks/memory_linear_logprob.py
	$(PY) benchmarks/memory_stratified_logprob.py
	$(PY) benchmarks/memory_bgpo.py
	$(PY) benchmarks/report.py

audit: $(STAMP)
	$(PY) benchmarks/estimator_audit.py

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q -p no:cacheprovider -o python_files='bench_*.py'
	$(PY) benchmarks/report.py

report: $(STAMP)
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
