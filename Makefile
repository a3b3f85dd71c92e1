# Two commands on a fresh machine: `make demo` and `make test`. Everything else is optional.
SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := help

UV_VERSION := 0.13.9
TOOLS := .tools
UV := $(TOOLS)/bin/uv
VENV := .venv
STAMP := $(VENV)/.synced
export UV_PYTHON_DOWNLOADS := never
export UV_PROJECT_ENVIRONMENT := $(VENV)
# Keep TensorFlow (pulled in by gemma) quiet and off any accelerator it might find.
export TF_CPP_MIN_LOG_LEVEL := 3
# glibc's malloc asks for transparent huge pages for large blocks: XLA's CPU runtime maps a step's
# buffers afresh each step (bench/huge_pages.py). Read as each process starts: set here for every
# process make starts. Training runs (`make demo`: gemmalab.headless) may go further: in VMs that
# hand freed pages to their hypervisor their kernel runs on mimalloc, which keeps freed buffers
# for the next step (gemmalab.allocator); the tests stay on glibc, which hands memory back.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

DEMO_DIR ?= runs/demo

.PHONY: help env libtpu interop llamacpp peers peers-lock demo demo-tiny test test-fast test-numerics lint lock notebooks lab image image-cpu image-tpu clean \
	cluster cluster-down cluster-programs cluster-image etcd node-packages cluster-load-image

help:
	@echo "make demo   - set up, then fine-tune the embedded pretrained Gemma 3 270M offline (train.ipynb)"
	@echo "make demo-tiny - the same notebook on the 1.7M-parameter tiny preset, from random init (~3 min)"
	@echo "                 (TINY_RECIPE=gemma4-tiny or gemma4-tiny-moe: Gemma 4's tiny presets)"
	@echo "make test   - set up, then run the test suite"
	@echo "make test-fast     - the inner loop (~3.5 min on 2 cores): the tests under ~10 s each (-m \"not slow\")"
	@echo "make test-numerics - the notebook regression tests under SSE4.2/1 core and AVX2 numerics"
	@echo "make libtpu - the TPU compiler for exact memory plans (notebooks/plan.ipynb exact=True)"
	@echo "make cluster - a local Kubernetes (API server, JobSet, Kueue, fake TPU v6e nodes) to rehearse GKE runs on"
	@echo "make cluster-down - stop it (the built programs stay cached in ~/.cache/gemmalab/cluster)"
	@echo "make interop - export the tiny presets (Gemma 3 and 4), load them with transformers and peft, compare logits"
	@echo "make llamacpp - export the demo run as GGUF (bf16, q8_0), run it in the real llama.cpp, compare with gemmalab"
	@echo "make peers  - tunix and keras-hub, each in its own pinned venv under .peers/ (bench/vs_jax_peers.py)"
	@echo "make lint   - ruff"
	@echo "make notebooks - re-execute the nbval regression copies in tests/notebooks/"
	@echo "make lab    - JupyterLab on notebooks/ with the project's kernel (headless; LAB_IP, LAB_PORT)"
	@echo "make image  - the Dockerfile's image: TARGET=tpu|gpu|cpu IMAGE=<registry>/gemmalab-<target>:<tag>"
	@echo "              (docker where it runs, else buildah on a local base: make image-cpu, make image-tpu)"
	@echo "make lock   - re-resolve uv.lock and requirements.txt after editing pyproject.toml"

# uv comes from the package registry into a private venv; the project env comes from uv.lock.
$(UV):
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# --compile-bytecode: .pyc files written once here, so no process (a notebook kernel, a test's
# worker) compiles TensorFlow's and jax's sources again, even under PYTHONDONTWRITEBYTECODE.
$(STAMP): $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --compile-bytecode --python "$$(scripts/find-python312)"
	touch $(STAMP)

env: $(STAMP)

# libtpu (the TPU compiler) for the memory planner's exact mode, outside .venv: only the
# planner's compile subprocess loads it (gemmalab.plan finds it here), CPU runs never see it.
LIBTPU := .libtpu
$(LIBTPU)/.installed: $(STAMP) uv.lock
	rm -rf $(LIBTPU) && mkdir -p $(LIBTPU)
	$(UV) export --frozen --only-group tpu-compile --no-emit-project -o $(LIBTPU)/requirements.txt \
		>/dev/null
	$(UV) pip install --quiet --python $(VENV)/bin/python --target $(LIBTPU) \
		-r $(LIBTPU)/requirements.txt
	touch $@

libtpu: $(LIBTPU)/.installed

# torch, transformers, peft and safetensors for bench/interop.py, outside .venv (torch from PyPI is
# a CUDA build: ~3 GB, so never part of `make test`). The script appends .interop/ to sys.path
# after .venv's packages, so jax, numpy etc. stay the ones of .venv.
INTEROP := .interop
INTEROP_DIR ?= runs/interop
# A finished run to export too, comparing transformers' logits and greedy tokens with gemmalab's:
# by default the demo's (the fine-tuned real Gemma 3 270M), once `make demo` has run.
INTEROP_RUN ?= $(if $(wildcard $(DEMO_DIR)/summary.json),$(DEMO_DIR),)
$(INTEROP)/.installed: $(STAMP) uv.lock
	rm -rf $(INTEROP) && mkdir -p $(INTEROP)
	$(UV) export --frozen --only-group interop --no-emit-project -o $(INTEROP)/requirements.txt \
		>/dev/null
	$(UV) pip install --quiet --python $(VENV)/bin/python --target $(INTEROP) \
		-r $(INTEROP)/requirements.txt
	touch $@

interop: $(STAMP) $(INTEROP)/.installed
	rm -rf $(INTEROP_DIR)
	$(VENV)/bin/python bench/interop.py --site-packages $(INTEROP) --out $(INTEROP_DIR) \
		$(if $(INTEROP_RUN),--run $(INTEROP_RUN),)

# node-llama-cpp (llama.cpp's prebuilt linux-x64 CPU build) for bench/llamacpp_check.py, outside
# .venv and never part of `make test`: npm installs the locked 3.21.1 into .llamacpp/. Its
# postinstall step (which would build llama.cpp from source when no prebuilt binary fits) is not
# run: the prebuilt binaries come as the package's own dependencies.
LLAMACPP := .llamacpp
LLAMACPP_DIR ?= runs/llamacpp
# The fine-tuned run to check (default the demo's: `make demo` first), and a chat run whose export
# carries the chat template (default: a 2-step LoRA run on the embedded instructions, made here).
LLAMACPP_RUN ?= $(DEMO_DIR)
LLAMACPP_CHAT_RUN ?= runs/chat-demo
$(LLAMACPP)/.installed: bench/llamacpp/package.json bench/llamacpp/package-lock.json
	rm -rf $(LLAMACPP) && mkdir -p $(LLAMACPP)
	cp bench/llamacpp/package.json bench/llamacpp/package-lock.json $(LLAMACPP)/
	cd $(LLAMACPP) && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
	touch $@

$(LLAMACPP_CHAT_RUN)/summary.json: | $(STAMP)
	rm -rf $(LLAMACPP_CHAT_RUN) && mkdir -p $(LLAMACPP_CHAT_RUN)
	$(HEADLESS) notebooks/train.ipynb $(LLAMACPP_CHAT_RUN)/train.ipynb $(DEMO) \
		-p data_path embedded:instructions -p embedded_stories 400 -p max_steps 2 -p eval_every 2 \
		-p output_dir $(LLAMACPP_CHAT_RUN) --log-output --no-progress-bar

llamacpp: $(STAMP) $(LLAMACPP)/.installed $(LLAMACPP_CHAT_RUN)/summary.json
	@test -f $(LLAMACPP_RUN)/summary.json || { echo "no finished run in $(LLAMACPP_RUN):" \
		"run \`make demo\` first, or give LLAMACPP_RUN=<output_dir>"; exit 2; }
	rm -rf $(LLAMACPP_DIR)
	$(VENV)/bin/python bench/llamacpp_check.py --run $(LLAMACPP_RUN) \
		--chat-run $(LLAMACPP_CHAT_RUN) --node-dir $(LLAMACPP) --out $(LLAMACPP_DIR)

# The JAX kits a user would pick instead of gemmalab, for bench/vs_jax_peers.py: google-tunix and
# keras-hub, each in its own venv under .peers/ (never .venv, never `make test`), installed exactly
# from bench/peers/*-requirements.txt (every transitive version pinned, resolved from the *.in
# files by `make peers-lock`; jax pinned to .venv's, so all three kits run the same XLA).
# keras-hub needs TensorFlow even on JAX (tensorflow-text, imported by its tokenizers): ~2 GB.
PEERS := .peers
PEER_KITS := tunix keras-hub
$(PEERS)/%/.installed: bench/peers/%-requirements.txt | $(UV)
	rm -rf $(PEERS)/$*
	$(UV) venv --quiet --python "$$(scripts/find-python312)" $(PEERS)/$*
	$(UV) pip sync --quiet --compile-bytecode --python $(PEERS)/$*/bin/python $<
	touch $@

peers: $(foreach kit,$(PEER_KITS),$(PEERS)/$(kit)/.installed)

peers-lock: $(UV)
	$(foreach kit,$(PEER_KITS),$(UV) pip compile --quiet --python-version 3.12 \
		--python-platform x86_64-manylinux_2_28 bench/peers/$(kit).in \
		-o bench/peers/$(kit)-requirements.txt;)

# A fresh run each time: a run directory that holds checkpoints would be resumed instead.
# The notebook with no parameters but its output_dir: its default, the demo recipe
# (gemmalab/recipes.py; bench/demo_recipe.py, docs/benchmarks/demo-270m.md): the embedded Gemma 3
# 270M, LoRA r8 at its default LR 1e-3, at a size that trains in minutes on 2 CPU cores, also on
# CPUs without bf16 matmul units (16 steps of 15 s there; ~5 s with AMX). DEMO="-p ..." adds
# parameters. papermill's command line, the kernel ended as soon as the last cell is done
# (gemmalab/headless.py).
HEADLESS := $(VENV)/bin/python -m gemmalab.headless
DEMO ?=
demo: $(STAMP)
	rm -rf $(DEMO_DIR) && mkdir -p $(DEMO_DIR)
	$(HEADLESS) notebooks/train.ipynb $(DEMO_DIR)/train.ipynb $(DEMO) \
		-p output_dir $(DEMO_DIR) --log-output --no-progress-bar
	@$(VENV)/bin/python -m gemmalab.inspect.summary $(DEMO_DIR)/summary.json

# The tiny preset from random init with a tokenizer trained on the corpus: the quick look.
# TINY_RECIPE=gemma4-tiny (or gemma4-tiny-moe): Gemma 4's tiny presets the same way.
TINY_RECIPE ?= tiny
TINY := -p recipe $(TINY_RECIPE) -p max_new_tokens 64
DEMO_TINY_DIR ?= runs/demo-tiny
demo-tiny: $(STAMP)
	rm -rf $(DEMO_TINY_DIR) && mkdir -p $(DEMO_TINY_DIR)
	$(HEADLESS) notebooks/train.ipynb $(DEMO_TINY_DIR)/train.ipynb $(TINY) \
		-p output_dir $(DEMO_TINY_DIR) --log-output --no-progress-bar
	@$(VENV)/bin/python -m gemmalab.inspect.summary $(DEMO_TINY_DIR)/summary.json

# nbval regression copies: each notebook executed at small parameters, in dependency order
# (data prep builds the token cache, train writes the run that sample_compare and profile read).
# train runs the tiny preset's last two layers (num_layers): the copies check the notebooks'
# outputs, and XLA compiles a third of the six layers' program in every kernel that runs them.
NBVAL_DIR := tests/notebooks
NBVAL_ENV := XLA_FLAGS=--xla_force_host_platform_device_count=8
# float32 compute: the copies must reproduce on other CPUs within the stated tolerance.
NBVAL_DATA := -p embedded_stories 300 -p tokenizer_vocab_size 600 -p cache_dir nbval-cache \
	-p maxlen 64 -p compute_dtype float32
PAPERMILL := $(NBVAL_ENV) $(VENV)/bin/papermill --cwd $(NBVAL_DIR) --no-progress-bar

PYTEST := $(VENV)/bin/pytest -q -p no:cacheprovider --nbval-sanitize-with $(NBVAL_DIR)/sanitize.cfg

# Test files run in parallel worker processes (pytest-xdist), a file to a worker, the longest
# first (tests/conftest.py). Much of a test's time is single-threaded (imports, tracing, XLA's
# compiler, kernels starting), so two workers gain on two cores; at most four keeps the memory
# of the real-model tests (~6 GB each) within a 24 GB machine. TEST_WORKERS=0: one process.
TEST_WORKERS ?= $(shell python3 -c 'import os; print(min(4, max(2, len(os.sched_getaffinity(0)))))' 2>/dev/null || echo 2)
PARALLEL = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --no-loadscope-reorder)

test: $(STAMP) $(LIBTPU)/.installed cluster-programs cluster-image
	$(NBVAL_ENV) $(PYTEST) $(PARALLEL) tests

# The local Kubernetes (gemmalab/k8s/cluster): etcd from Debian, the rest built from the Go module
# proxy once per machine into ~/.cache/gemmalab/cluster (GEMMALAB_CLUSTER_HOME), 7-11 min cold on
# 2 cores. Loopback ports from CLUSTER_PORT (16400) up. The tests start it themselves.
CLUSTER := $(VENV)/bin/python -m gemmalab.k8s.cluster
export CLUSTER_PORT ?= 16400
etcd:
	@command -v etcd >/dev/null || scripts/install-etcd

# As root the cluster also runs one real CPU node (kubelet, containerd, CoreDNS on its own bridge
# gemmalab0, 10.245.0.0/24) with Debian's runc and CNI plugins; CLUSTER_CPU_NODE=0 leaves it out.
node-packages:
	@if [ "$$(id -u)" = 0 ] && [ "$${CLUSTER_CPU_NODE:-1}" != 0 ]; then scripts/install-node-packages; fi

cluster-programs: $(STAMP) etcd node-packages
	$(CLUSTER) build

cluster: $(STAMP) etcd node-packages
	@$(CLUSTER) up

# An OCI or docker-archive tar into the CPU node's containerd: IMAGE_ARCHIVE=path.tar
cluster-load-image: $(STAMP)
	@$(CLUSTER) load-image $(IMAGE_ARCHIVE)

cluster-down: $(STAMP)
	@$(CLUSTER) down

# The inner loop: everything but the notebooks, multi-process and server runs. It is
# compile-bound (XLA compiling tiny programs that run for milliseconds), so it compiles with LLVM
# at level 0 instead of XLA's 3: ~10% less time. Not `make test`: there the long runs lose what
# the compiles save (docs/benchmarks/make-test-cpu-time.md).
test-fast: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0" \
		$(PYTEST) $(PARALLEL) -m "not slow" tests

# The notebook copies must also pass under other CPU numerics: SSE4.2 kernels on one core, and
# AVX2 kernels on every core (different vector widths, FMA, thread counts than the default). The
# copies that compute in floating point: train (losses, perplexities, samples) and sample_compare
# (the greedy continuations, the task metric); data_prep, profile and export print integers,
# timings or exact float32 copies.
NUMERICS_COPIES := $(NBVAL_DIR)/2_train.ipynb $(NBVAL_DIR)/3_sample_compare.ipynb
PIN_ONE_CORE := $(if $(shell command -v taskset),taskset -c 0,)
test-numerics: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=SSE4_2" \
		$(PIN_ONE_CORE) $(PYTEST) $(NUMERICS_COPIES)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_cpu_max_isa=AVX2" \
		$(PYTEST) $(NUMERICS_COPIES)

notebooks: $(STAMP)
	rm -rf $(NBVAL_DIR)/nbval-cache $(NBVAL_DIR)/nbval-run $(NBVAL_DIR)/nbval-profile \
		$(NBVAL_DIR)/nbval-export
	$(PAPERMILL) notebooks/data_prep.ipynb $(NBVAL_DIR)/1_data_prep.ipynb $(NBVAL_DATA) \
		-p model gemma3-tiny -p checkpoint "" -p tokenizer local \
		-y '{compare_maxlens: [32, 64, 128]}'
	$(PAPERMILL) notebooks/train.ipynb $(NBVAL_DIR)/2_train.ipynb $(TINY) $(NBVAL_DATA) \
		-p num_layers 2 -p batch_size 8 -p max_steps 20 -p eval_every 10 \
		-p output_dir nbval-run -p max_new_tokens 24
	$(PAPERMILL) notebooks/sample_compare.ipynb $(NBVAL_DIR)/3_sample_compare.ipynb \
		-p finetuned nbval-run -p max_new_tokens 16
	$(PAPERMILL) notebooks/profile.ipynb $(NBVAL_DIR)/4_profile.ipynb $(NBVAL_DATA) \
		-p batch_size 8 -p output_dir nbval-profile -p warmup_steps 2 -p profile_steps 3
	$(PAPERMILL) notebooks/export.ipynb $(NBVAL_DIR)/5_export.ipynb -p run nbval-run \
		-p out_dir nbval-export -y '{formats: [hf, gemma], dtype: float32}'

lab: $(STAMP)
	VENV=$(VENV) scripts/lab

lint: $(STAMP)
	$(VENV)/bin/ruff check .

lock: $(UV)
	$(UV) lock --python "$$(scripts/find-python312)"
	$(UV) export --frozen --no-hashes --no-dev --no-emit-project -o requirements.txt >/dev/null

# The Dockerfile's images. Where a Docker engine runs: docker on the real python:3.12 base (push
# with `docker push $(IMAGE)`). Without one (this kind of machine: root, no registry): buildah on
# a local stand-in for that base (gemmalab/k8s/cluster/image.py; Debian's buildah comes with
# node-packages). `make image-cpu` is the CPU node's image, which `make test` builds (cached);
# `make image-tpu` the TPU one (libtpu from PyPI). The GPU target is never built here.
TARGET ?= tpu
IMAGE ?= gemmalab-$(TARGET):$(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_BUILDER ?= $(shell timeout 10 docker info >/dev/null 2>&1 && echo docker || echo buildah)
image:
ifeq ($(IMAGE_BUILDER),docker)
	docker build --target $(TARGET) -t $(IMAGE) .
else
	@$(MAKE) --no-print-directory $(STAMP) node-packages
	$(CLUSTER) image --target $(TARGET) --tag localhost/$(IMAGE)
endif
image-cpu:
	@$(MAKE) --no-print-directory image TARGET=cpu
image-tpu:
	@$(MAKE) --no-print-directory image TARGET=tpu

# make test's runs on the CPU node: its image, built with buildah once per machine and rebuilt
# from buildah's layer cache when the sources change (as root, with the node; else nothing).
cluster-image: $(STAMP) node-packages
	@if [ "$$(id -u)" = 0 ] && [ "$${CLUSTER_CPU_NODE:-1}" != 0 ]; then \
		$(CLUSTER) image --target cpu; fi

clean:
	rm -rf $(VENV) $(TOOLS) $(LIBTPU) $(INTEROP) $(LLAMACPP) $(PEERS) runs .pytest_cache .ruff_cache
