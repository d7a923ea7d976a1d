# Every target creates .venv on first use and installs the project into it.
# torch: an already installed torch>=2.6 is kept; otherwise the CPU wheel torch==2.13.0 is installed
# (an unpinned `torch` would pull a multi-GB CUDA build).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# The extras installed with the project (pyproject.toml says what each one installs): `dev`, the default, is what
# the tests need (the test tools, `export` and `trackers`); `make install EXTRAS=dev,hub` adds the Hugging Face hub
# libraries that `--source fineweb-edu` and `--tokenizer hub:NAME` need. Each set of extras has its own stamp
# (.venv/.installed-EXTRAS, remade when pyproject.toml changes), so another EXTRAS installs what it adds.
EXTRAS ?= dev
STAMP := $(VENV)/.installed-$(EXTRAS)
# `make pilot` needs no extra: the base dependencies alone (numpy, tokenizers, pyarrow, pyyaml, matplotlib, tqdm,
# ninja and torch), its own stamp, so that neither a first `make pilot` keeps `make test` from installing the test
# tools nor the reverse.
PILOT_STAMP := $(VENV)/.installed-base

.PHONY: install pilot test test-fast lint bench mutation clean

$(VENV)/.installed-%: pyproject.toml
	@echo "[make] 1/5 creating the virtual environment $(VENV) (skipped if it exists)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[make] 2/5 upgrading pip inside $(VENV)"
	$(PY) -m pip install -q --upgrade pip
	@echo "[make] 3/5 checking for torch>=2.6; if absent, installing the CPU wheel $(TORCH_PIN) (~200 MB, minutes)"
	$(PY) -c "import torch, sys; from importlib.metadata import version; v = tuple(int(p) for p in version('torch').split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 6) else 1)" 2>/dev/null \
		|| $(PY) -m pip install -q "$(TORCH_PIN)"
	@$(PY) scripts/describe_extras.py "$*"
	$(PY) -m pip install -q -e ".$(if $(filter base,$*),,[$*])"
	@echo "[make] 5/5 compiling the CPU MoE kernels (C++, about a minute the first time)"
	$(PY) -c "from pilotrun.model.cpu_kernels import cpu_kernels_loaded as built; print('pilotrun: CPU MoE kernels', 'built' if built() else 'not built (PyTorch operators instead)')"
	touch $@
	@echo "[make] ready: $(VENV)/bin/pilotrun"

install: $(STAMP)

pilot: $(PILOT_STAMP)
	$(VENV)/bin/pilotrun pilot --workdir pilot-work

lint: $(STAMP)
	$(VENV)/bin/ruff check pilotrun tests benchmarks

# Two pytest workers (pytest-xdist), a test file each at a time so that a module's shared run is trained once:
# most tests run one torch thread, so the second core would otherwise wait (the suite took about half the time
# side by side on the busy 2-core machine).
test: $(STAMP) lint
	$(VENV)/bin/python -m pytest -q -rs -n 2 --dist loadfile  # -rs: name every skipped test and why

# The inner loop: every test not marked `slow` (no child process, no training beyond a few updates), in
# under 3 minutes on 2 cores (both used, as `make test` does). `make test` runs everything, and is what CI runs.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not slow" -rs -n 2 --dist loadfile

# `make bench NANOCHAT=PATH` adds nanochat (a checkout of it, never required) to the benchmarks that compare with it.
NANOCHAT ?=
bench: $(STAMP)
	$(PY) -m benchmarks.run_all $(if $(NANOCHAT),--nanochat $(NANOCHAT))

# Plants each bug of benchmarks/mutations.py in a scratch copy and reports how many the tests kill. The
# mutations pin exact source lines: the first command names any that a refactoring left stale (seconds).
mutation: $(STAMP)
	$(PY) -m benchmarks.mutation_check --stale-only
	$(PY) -m benchmarks.mutation_check

clean:
	rm -rf $(VENV) pilot-work .pytest_cache
