# Fresh-machine entry points. `make demo` and `make test` create .venv on first use.
# On a CPU machine the constraints pin the CPU build of torch (never a CUDA download);
# on a machine whose torch is already installed, run the targets with VENV_PIP_ARGS= as needed.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: venv demo test bench bench-quick report clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e '.[dev]'
	touch $(STAMP)

demo: bench-quick

test: $(STAMP)
	$(PY) -m pytest -q

bench-quick: $(STAMP)
	DACA_BENCH_QUICK=1 $(PY) -m pytest benchmarks -q -p no:cacheprovider --benchmark-min-rounds=3
	$(PY) benchmarks/memory_linear_logprob.py
	$(PY) benchmarks/report.py

bench: $(STAMP)
	$(PY) -m pytest benchmarks -q -p no:cacheprovider
	$(PY) benchmarks/report.py

report: $(STAMP)
	$(PY) benchmarks/report.py

clean:
	rm -rf $(VENV) .pytest_cache .benchmarks
