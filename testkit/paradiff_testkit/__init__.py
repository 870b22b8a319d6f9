"""The test suite's fixtures, outside the paradiff package: tiny pipelines (`zoo`, `pipelines`), their text encoders
and tokenizers, VAEs, LoRA, quantized and GGUF checkpoints, fault injection, and the helpers that run the `paradiff`
command and server (`command`, `serve`). Used by tests/, benchmarks/ and tools/; never by the product, and not in
paradiff's wheel. It needs the `test` extra's packages (transformers, peft, gguf, httpx ...).

pyproject's pytest `pythonpath` puts this folder's parent on the suite's path, and tests/conftest.py on the
PYTHONPATH of every process the suite starts; scripts under benchmarks/ and tools/ add it to their path themselves.
"""

# What the suite's rank pools and forked commands preload besides paradiff.testing.dist.PRELOAD: the fixtures the rank
# cases import. Both fork from one server per process, whichever starts it first, so both name the same modules.
PRELOAD = ("paradiff_testkit.families",)
