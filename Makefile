# pyserini-aligner: `make run` (the main job) and `make test`. Both set themselves up through `make install`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
DATASET ?= beir/scifact/test
RUN_DIR ?= runs/$(subst /,_,$(DATASET))

# Data: the BEIR zips beside the checkout, linked into a writable ir_datasets home (see README).
BEIR_DIR_DEFAULT := $(abspath ../shared/data/beir)
export PYSERINI_ALIGNER_BEIR_DIR ?= $(if $(wildcard $(BEIR_DIR_DEFAULT)/*.zip),$(BEIR_DIR_DEFAULT),)
export IR_DATASETS_HOME ?= $(abspath .cache/ir_datasets)

.PHONY: install run test clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.cfg setup.py pyproject.toml pyserini_aligner.pth
	@echo "==> [1/4] virtualenv $(VENV)"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip uv
	@echo "==> [2/4] torch 2.13.0 (CPU build)"
	$(BIN)/python -m pip install torch==2.13.0
	@echo "==> [3/4] pyserini-aligner and its dependencies (Pyserini, FAISS, transformers, ranx, ...)"
	# uv resolves the same releases as pip and downloads and unpacks them in parallel (52 s faster than pip on 2 cores);
	# torch comes from pip above, which finds the CPU build on disk, and uv keeps it. Both write the bytecode of what
	# they install (pip by default, uv with --compile-bytecode), and the project's own modules are compiled after:
	# where Python may not write it (PYTHONDONTWRITEBYTECODE), every process would otherwise compile Pyserini,
	# transformers, SciPy and pandas from source as it imports them (seconds a process)
	UV_LINK_MODE=copy $(BIN)/python -m uv pip install --python $(BIN)/python --compile-bytecode -e ".[test]"
	$(BIN)/python -m compileall -q -j 0 pyserini_aligner eval tests > /dev/null
	@echo "==> [4/4] saving Pyserini's --help pages"
	# Pyserini's faiss and hybrid --help print from a copy the first call saves (seconds of JVM start-up): save it now
	$(BIN)/python -m pyserini.search.faiss --help > /dev/null
	$(BIN)/python -m pyserini.search.hybrid --help > /dev/null
	@echo "==> installed: source $(VENV)/bin/activate"
	touch $@

run: install
	$(BIN)/python -m eval.beir --dataset $(DATASET) --output $(RUN_DIR)
	$(BIN)/python -m eval.sweeps --dataset $(DATASET) --output $(RUN_DIR)/sweeps
	cat $(RUN_DIR)/results.md

# ranx compiles its numba kernels on first use and caches them in the virtualenv. `make run` compiles the few it uses
# in its one process; the test workers would compile the same kernels at once, and numba's cache index is not safe
# for processes writing it at once, so every kernel the tests use is compiled here first, in one process.
$(VENV)/.ranx-compiled: $(VENV)/.installed
	@echo "==> compiling ranx's numba kernels"
	$(BIN)/python -c "from pyserini_aligner.metrics import warm_up; warm_up()"
	touch $@

test: $(VENV)/.ranx-compiled
	$(BIN)/python -m pytest tests -q -n auto --dist loadscope

clean:
	rm -rf $(VENV) .cache runs build *.egg-info
