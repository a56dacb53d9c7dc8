# Every target installs what it needs first. CPU machines get the CPU build of torch; on a CUDA machine:
#   make install TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# DeepSpeed picks its accelerator from the installed torch (cuda when it sees a GPU, else cpu); set
# DS_ACCELERATOR to override.
# DeepSpeed's JIT-built ops live in the venv (pipeline/train/runtime/ops.py says why; the pipeline sets the same folder
# itself whatever the entry point), built by the venv's own ninja (two ninja versions rebuild each other's ops).
export TORCH_EXTENSIONS_DIR ?= $(abspath $(VENV))/torch_extensions
export PATH := $(abspath $(BIN)):$(PATH)

RUN ?= runs/demo
CKPT ?= $(RUN)
SPLIT ?= val
# A file of prompts for `make eval` (one per line); empty: the starts of a few samples of the evaluated split.
PROMPTS ?=
# Extra `pipeline evaluate` options, e.g. EVAL_ARGS="--hostfile hostfiles/8node" for a model larger than one GPU.
EVAL_ARGS ?=
# lm-evaluation-harness tasks for `make eval` (comma-separated), e.g. TASKS=pipeline_demo_ppl (bundled, offline:
# configs/lm_eval/) or TASKS=hellaswag,arc_easy (downloaded by the harness). The harness lives in its own venv.
TASKS ?=
HARNESS_ARGS ?=
HARNESS_VENV ?= .venv-lm-eval
HARNESS_SPEC ?= lm-eval[hf]==0.4.13

.PHONY: install ops test test-fast test-dist test-gguf lint format data demo eval harness-install llama-cpp bench bench-cpu clean

install: $(STAMP)

# pip byte-compiles what it installs on one core; compileall does the same on every core (63 s -> 49 s here).
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-compile $(TORCH_SPEC)
	$(BIN)/python -m pip install -q --no-compile -e '.[test,lint]' ninja
	$(BIN)/python -m compileall -qq -j 0 "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	touch $(STAMP)

# Two workers (pytest-xdist): a launch leaves a core idle a third of its time (the launcher's start, the ranks'
# exit), which the other worker's tests fill; three are no faster (770 s either way, 2026-12-05). The tests that
# read the shared ZeRO runs stay on one worker (tests/multiproc/conftest.py). TEST_WORKERS=0 runs them one after
# another.
TEST_WORKERS ?= 2

test: install ops
	$(BIN)/python -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadgroup tests

# DeepSpeed's ops built ahead, in parallel (on a fresh machine about 4 minutes instead of 6 one after another
# inside the first tests that load them); a no-op once they are built.
ops: install
	$(BIN)/python -m pipeline.train.runtime.ops

# The inner loop: everything but the tests marked slow (multi-process runs, stages run as processes of their own)
# and dist, in under a minute.
test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow and not dist" -n $(TEST_WORKERS) tests

# In-process multi-rank tests over gloo (tests/distributed): barriers, broadcasts, resume decisions; about a minute.
test-dist: install
	$(BIN)/python -m pytest -q -ra -m dist tests

# Style is mechanical: `make format` rewrites, `make lint` (in .ci/run) refuses what the formatter would change.
lint: install
	$(BIN)/ruff format --check pipeline tests bench
	$(BIN)/ruff check pipeline tests bench
	$(BIN)/mypy pipeline

format: install
	$(BIN)/ruff format pipeline tests bench
	$(BIN)/ruff check --fix pipeline tests bench

# The whole pipeline on the bundled Shakespeare corpus, through the deepspeed launcher, on what this machine has.
# Each stage runs when its input is newer than its output, so a second `make demo` resumes the run (finished:
# it evaluates again) instead of re-tokenizing into shards that the run would refuse as other data.
# Ranks for the demo: two CPU processes on a CPU machine, one per GPU (at most two) on a GPU machine.
DEMO_RANKS ?= $(shell $(BIN)/python -c "import torch; n = torch.cuda.device_count(); print(min(n, 2) or 2)" 2>/dev/null || echo 2)

demo: data/shards-256/manifest.json
	OMP_NUM_THREADS=1 $(BIN)/pipeline pretrain --config configs/demo.yaml --num-gpus $(DEMO_RANKS)
	$(MAKE) eval CKPT=$(RUN) PROMPTS=configs/demo_prompts.txt

data: data/shakespeare.jsonl

data/shakespeare.jsonl: | install
	$(BIN)/python -m pipeline.data.demo data

# Stage 0, curate: exact and near duplicates out (the web-text quality rules would drop most plays: off here).
data/curated/report.json: data/shakespeare.jsonl
	$(BIN)/pipeline curate data/shakespeare.jsonl --output data/curated --no-quality --workers 2

data/shakespeare.manifest.json: data/curated/report.json
	$(BIN)/pipeline tokenize data/curated/documents --output-prefix data/shakespeare --train-tokenizer \
		--vocab-size 4096 --workers 2

data/shards-256/manifest.json: data/shakespeare.manifest.json
	$(BIN)/pipeline shard data/shakespeare --output data/shards-256 --seq-len 256 --split 90,5,5 --overwrite

eval: install $(if $(TASKS),harness-install)
	$(BIN)/pipeline evaluate --checkpoint $(CKPT) --split $(SPLIT) $(if $(PROMPTS),--prompts $(PROMPTS)) $(EVAL_ARGS)
	$(if $(TASKS),$(BIN)/pipeline harness --checkpoint $(CKPT) --tasks $(TASKS) --lm-eval $(HARNESS_VENV)/bin/lm_eval $(HARNESS_ARGS))

# The harness pins its own dependencies, so it gets its own venv (with the same torch build as the main one).
# --no-compile: byte-compiling every installed file is two thirds of pip's time here (36 of 54 s), and
# the harness imports a small part of them, compiled on first use.
harness-install: $(HARNESS_VENV)/.installed

$(HARNESS_VENV)/.installed:
	test -x $(HARNESS_VENV)/bin/python || $(PYTHON) -m venv $(HARNESS_VENV)
	$(HARNESS_VENV)/bin/python -m pip install -q --upgrade pip
	$(HARNESS_VENV)/bin/python -m pip install -q --no-compile $(TORCH_SPEC)
	$(HARNESS_VENV)/bin/python -m pip install -q --no-compile '$(HARNESS_SPEC)'
	touch $@

# llama.cpp itself, for checking the GGUF export against it (`make test-gguf`). llama-cpp-python has no wheel in the
# package index, so its first install builds llama.cpp from source (about 15 minutes on 2 cores) into a wheel kept
# in LLAMA_CPP_WHEELS, outside the checkout: every later venv, a fresh clone's too, installs that wheel in seconds.
# Generic x86-64 code (GGML_NATIVE=OFF: the wheel runs wherever it is copied), without llama.cpp's server, tools or
# multimodal library.
LLAMA_CPP_VENV ?= .venv-llama-cpp
LLAMA_CPP_SPEC ?= llama-cpp-python==0.3.36
LLAMA_CPP_WHEELS ?= $(HOME)/.cache/pipeline/wheels
LLAMA_CPP_CMAKE ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
LLAMA_CPP_PIP = $(LLAMA_CPP_VENV)/bin/python -m pip

llama-cpp: $(LLAMA_CPP_VENV)/.installed

$(LLAMA_CPP_VENV)/.installed:
	test -x $(LLAMA_CPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMA_CPP_VENV)
	$(LLAMA_CPP_PIP) install -q --find-links $(LLAMA_CPP_WHEELS) --only-binary llama-cpp-python '$(LLAMA_CPP_SPEC)' || { \
	  echo "building llama.cpp from source, once (about 15 minutes on 2 cores), into $(LLAMA_CPP_WHEELS)"; \
	  mkdir -p $(LLAMA_CPP_WHEELS) && CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" $(LLAMA_CPP_PIP) wheel --no-deps \
	    -w $(LLAMA_CPP_WHEELS) '$(LLAMA_CPP_SPEC)' && \
	  $(LLAMA_CPP_PIP) install -q --find-links $(LLAMA_CPP_WHEELS) --only-binary llama-cpp-python '$(LLAMA_CPP_SPEC)'; }
	touch $@

# The GGUF export checked by llama.cpp itself: token ids and logits against transformers on the Hugging Face
# export, for each family (tests/unit/evaluate/test_to_gguf_llama_cpp.py; `make test` runs it too where llama.cpp is installed).
test-gguf: install llama-cpp
	$(BIN)/python -m pytest -q -ra tests/unit/evaluate/test_to_gguf_llama_cpp.py

bench: install
	$(BIN)/python bench/tokenize_bench.py
	$(BIN)/python bench/data_bench.py
	$(BIN)/python bench/cpu_bench.py
	$(BIN)/python bench/slices_bench.py

bench-cpu: install
	$(BIN)/python bench/cpu_bench.py

clean:
	rm -rf runs out
