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

DEMO_DIR ?= runs/demo

.PHONY: help env demo test lint lock notebook-test clean

help:
	@echo "make demo   - set up, then fine-tune offline on the embedded corpus (notebooks/train.ipynb)"
	@echo "make test   - set up, then run the test suite"
	@echo "make lint   - ruff"
	@echo "make lock   - re-resolve uv.lock and requirements.txt after editing pyproject.toml"

# uv comes from the package registry into a private venv; the project env comes from uv.lock.
$(UV):
	python3 -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

$(STAMP): $(UV) pyproject.toml uv.lock
	$(UV) sync --frozen --python "$$(scripts/find-python312)"
	touch $(STAMP)

env: $(STAMP)

demo: $(STAMP)
	mkdir -p $(DEMO_DIR)
	$(VENV)/bin/papermill notebooks/train.ipynb $(DEMO_DIR)/train.ipynb \
		-p output_dir $(DEMO_DIR) --log-output --no-progress-bar
	@$(VENV)/bin/python -m gemmalab.summary $(DEMO_DIR)/summary.json

test: $(STAMP)
	$(VENV)/bin/pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

lock: $(UV)
	$(UV) lock --python "$$(scripts/find-python312)"
	$(UV) export --frozen --no-hashes --no-dev --no-emit-project -o requirements.txt >/dev/null

clean:
	rm -rf $(VENV) $(TOOLS) runs .pytest_cache .ruff_cache
