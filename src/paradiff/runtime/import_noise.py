"""Warnings optional backends print while they are imported, on machines where they have nothing to do.

With paradiff's `quant` and `lora` extras installed, importing diffusers imports peft, which imports torchao and
bitsandbytes; on a CPU-only machine (or one without their CUDA kernels) each process then prints that torchao's
CUDA extensions and bitsandbytes' optional `kernels` package could not be loaded, and torch warns that torchao
registers Enum constants the old way; diffusers' torchao quantizer warns that it cannot find tensor classes
torchao 0.18 moved. Loading a pipeline with a CLIP image processor (FLUX.1's feature extractor, used only for IP
adapters) without torchvision makes transformers say it falls back to the PIL processor, which does the same job.
None of it affects a paradiff run (the CPU paths it uses do not need them), but a `paradiff generate` on 4 ranks
printed it 4 times before its first line. Only these messages are dropped; everything else those loggers say still
shows.

A logger's filters see only the records logged by that very logger (not its children's), so each entry names the
logger the library logs through. The filters must be installed before those libraries are imported: importing
`paradiff` does it, so every process paradiff starts imports `paradiff` first (distributed/spawn.py: WORKER_PRELOAD).
"""

from __future__ import annotations

import logging
import re

# logger name -> patterns of import-time noise (matched at the start of the unformatted message)
_NOISE = {
    "torchao": (r"Failed to load ",),
    "bitsandbytes.backends.cpu.ops": (r"Failed to load CPU gemm_4bit_forward from kernels-community",),
    "torch.utils._pytree": (r"%s is an Enum subclass and is now natively supported",),
    # diffusers looks for tensor classes torchao 0.18 moved; paradiff's quantization does not load torchao pickles
    "diffusers.quantizers.torchao.torchao_quantizer": (r"Unable to import `torchao` Tensor objects",),
    # transformers 5 without torchvision: `CLIPImageProcessor` and the like resolve to their PIL twins
    "transformers.utils.import_utils": (r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back",),
}


class _DropMatching(logging.Filter):
    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{pattern})" for pattern in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        return self.pattern.match(str(record.msg)) is None


def quiet_optional_backend_imports() -> None:
    """Install the filters once per process (idempotent), before diffusers is imported."""
    for name, patterns in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMatching) for f in logger.filters):
            logger.addFilter(_DropMatching(patterns))
