# Every target creates .venv on first use and installs the project into it.
# torch: an already installed torch>=2.6 is kept; otherwise the CPU wheel torch==2.13.0 is installed
# (an unpinned `torch` would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

.PHONY: install pilot test lint bench mutation clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch, sys; from importlib.metadata import version; v = tuple(int(p) for p in version('torch').split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null \
		|| $(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e ".[dev]"
	$(PY) -c "from pilotrun.model.cpu_kernels import cpu_kernels_loaded as built; print('pilotrun: CPU MoE kernels', 'built' if built() else 'not built (PyTorch operators instead)')"
	touch $(STAMP)

install: $(STAMP)

pilot: $(STAMP)
	$(VENV)/bin/pilotrun pilot --workdir pilot-work

lint: $(STAMP)
	$(VENV)/bin/ruff check pilotrun tests benchmarks

test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q -rs  # -rs: name every skipped test and why

bench: $(STAMP)
	$(PY) -m benchmarks.run_all

# Plants each bug of benchmarks/mutations.py in a scratch copy and reports how many the tests kill.
mutation: $(STAMP)
	$(PY) -m benchmarks.mutation_check

clean:
	rm -rf $(VENV) pilot-work .pytest_cache
