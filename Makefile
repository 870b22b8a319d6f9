# Every target creates .venv from nothing when it is missing: CPU torch first, by pip (it reads the machine's pip
# settings, which point it at the CPU build; uv would not), then paradiff with its test extras by uv, which resolves
# and installs them in seconds where pip took about 35 s (torch, already there, is kept). Both write the bytecode
# up front: where PYTHONDONTWRITEBYTECODE is set (it is on this machine) nothing is cached at import time, and every
# process the suite starts would compile torch, diffusers and transformers from source again.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 uv
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -e '.[test,bench]'
	touch $(STAMP)

# The demo prompts drawn on a tp2 x ulysses2 mesh without and with the demo LoRA (it swaps the two colours),
# each against diffusers in one process (out/demo/compare.png: without on the left, with on the right).
DEMO_LORA := src/paradiff/assets/demo/lora/colour_swap.safetensors

demo: $(STAMP)
	$(VENV)/bin/paradiff generate --tp 2 --ulysses 2 --compare --lora $(DEMO_LORA) --also-without-lora --out out/demo
	$(PY) -m paradiff.demo

# Two pytest workers, a test file each at a time (--dist loadfile: a file's module fixtures and rank cases stay on
# one worker): while one worker's ranks wait on each other or its own process computes a reference, the other's use
# the second core. Each worker starts its own rank pools and fork server.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

# The development lane: everything that runs in this one process (no rank pools, no subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) .cache
