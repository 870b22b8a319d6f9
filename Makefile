# Every target creates .venv from nothing when it is missing, with exactly the versions of requirements.lock (what the
# suite last passed with): CPU torch first, by pip (it reads the machine's pip settings, which point it at the CPU
# build on disk; uv would not), then the locked packages and paradiff itself (no dependency resolution) by uv, which
# installs them in seconds where pip took about 35 s. Both write the bytecode up front: where PYTHONDONTWRITEBYTECODE
# is set (it is on this machine) nothing is cached at import time, and every process the suite starts would compile
# torch, diffusers and transformers from source again.
# pyproject.toml keeps loose ranges for library users; `make lock` resolves them again into requirements.lock, and
# `make test-latest` runs the suite on the newest releases they admit (in .venv-latest), to meet upstream breakage
# on purpose rather than in CI.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
UV := uv==0.13.9
LOCK := requirements.lock

.PHONY: demo test test-ray test-fast test-load test-latest lock bench bench-report docs-tables clean

$(STAMP): pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH) $(UV)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) -r $(LOCK)
	$(VENV)/bin/uv pip install -q --compile-bytecode --python $(PY) --no-deps -e .
	touch $(STAMP)

# requirements.lock from pyproject.toml's ranges: the newest versions they admit today, torch held at the CPU build
# that lies on this machine's disk (/opt/wheels; its dependencies, not a CUDA build's, are locked).
lock:
	test -x $(VENV)/bin/uv || ($(PYTHON) -m venv $(VENV) && $(PY) -m pip install -q $(UV))
	echo "$(TORCH)+cpu" > .torch-constraint.txt
	$(VENV)/bin/uv pip compile -q pyproject.toml --extra test --extra bench --find-links /opt/wheels \
		--constraint .torch-constraint.txt --python-version 3.11 --python-platform x86_64-unknown-linux-gnu \
		--no-header --annotation-style line -o $(LOCK)
	rm .torch-constraint.txt

# The demo prompts drawn on a tp2 x ulysses2 mesh without and with the demo LoRA (it swaps the two colours),
# each against diffusers in one process (out/demo/compare.png: without on the left, with on the right).
DEMO_LORA := src/paradiff/assets/demo/lora/colour_swap.safetensors

demo: $(STAMP)
	$(VENV)/bin/paradiff generate --tp 2 --ulysses 2 --compare --lora $(DEMO_LORA) --also-without-lora --out out/demo
	$(PY) -m paradiff.demo

# Two pytest workers, a test file each at a time (--dist loadfile: a file's module fixtures and rank cases stay on
# one worker; --no-loadscope-reorder: files in tests/conftest.py's order, slowest first): while one worker's ranks
# wait on each other or its own process computes a reference, the other's use
# the second core. Each worker starts its own rank pools and fork server.
# The Ray Serve cluster test (a local Ray cluster, two replicas, a killed rank, autoscaling: about a minute alone on
# the 2-core Intel Xeon) runs here too, first among the files after test_families.py; `make test-ray` runs it alone.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test-ray: $(STAMP)
	$(PY) -m pytest -q -m ray

# The load lane (docs/testing.md): the suite with two busy-loop processes beside it, one pinned to each core, as on a
# shared CI host. A test that passes here acts on what it has seen, not on how long things usually take.
test-load: $(STAMP)
	bash tests/load_lane.sh $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The newest releases pyproject.toml admits, in a venv of their own: what a user installing today gets.
test-latest:
	test -x .venv-latest/bin/python || $(PYTHON) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q $(TORCH) $(UV)
	.venv-latest/bin/uv pip install -q --compile-bytecode --upgrade --python .venv-latest/bin/python -e '.[test,bench]'
	.venv-latest/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -p no:cacheprovider

# The development lane: everything that runs in this one process (no rank pools, no subprocesses).
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/run_all.py
	$(PY) benchmarks/report.py

# BENCHMARKS.md from benchmarks/results/*.json (each benchmark writes its own file; benchmarks/README.md)
bench-report:
	$(PY) benchmarks/report.py

# The docs pages generated from plans/ (docs/cfg-rules.md); the coverage tables: tools/verify_plans.py --readme,
# tools/verify_pipelines.py --table
docs-tables: $(STAMP)
	$(PY) tools/docs_tables.py

clean:
	rm -rf $(VENV) .venv-latest .cache
