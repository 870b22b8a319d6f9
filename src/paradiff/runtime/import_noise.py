"""Warnings optional backends print while they are imported, on machines where they have nothing to do.

With paradiff's `quant` and `lora` extras installed, importing diffusers imports peft, which imports torchao and
bitsandbytes; on a CPU-only machine (or one without their CUDA kernels) each process then prints that torchao's
CUDA extensions and bitsandbytes' optional `kernels` package could not be loaded, and torch warns that torchao
registers Enum constants the old way; diffusers' torchao quantizer warns that it cannot find tensor classes
torchao 0.18 moved. None of it affects a paradiff run (the CPU paths it uses do not need them),
but a `paradiff generate` on 4 ranks printed it 4 times before its first line. Only these messages are dropped;
everything else those loggers say still shows.
"""

from __future__ import annotations

import logging

# logger name -> message prefixes that are import-time noise (matched on the unformatted message)
_NOISE = {
    "torchao": ("Failed to load ",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    # diffusers looks for tensor classes torchao 0.18 moved; paradiff's quantization does not load torchao pickles
    "diffusers.quantizers.torchao.torchao_quantizer": ("Unable to import `torchao` Tensor objects",),
}


class _DropPrefixes(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def quiet_optional_backend_imports() -> None:
    """Install the filters once per process (idempotent), before diffusers is imported."""
    for name, prefixes in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropPrefixes) for f in logger.filters):
            logger.addFilter(_DropPrefixes(prefixes))
