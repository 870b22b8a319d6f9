"""Optional backends' import-time warnings on machines without their kernels are dropped; their other messages
still show."""

from __future__ import annotations

import logging

import paradiff  # noqa: F401 - installs the filters


def _shown(logger_name: str, message: str) -> bool:
    logger = logging.getLogger(logger_name)
    record = logger.makeRecord(logger_name, logging.WARNING, __file__, 1, message, (), None)
    return all(f.filter(record) for f in logger.filters)


def test_kernel_load_failures_of_optional_backends_are_dropped():
    assert not _shown("torchao", "Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
    assert not _shown("bitsandbytes.backends.cpu.ops",
                      "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...")
    assert not _shown("torch.utils._pytree", "%s is an Enum subclass and is now natively supported by torch.compile")
    assert not _shown("diffusers.quantizers.torchao.torchao_quantizer",
                      "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized")
    # every FLUX.1 load without torchvision (its feature extractor)
    assert not _shown("transformers.utils.import_utils",
                      "`CLIPImageProcessor` requires torchvision (not installed); falling back to "
                      "`CLIPImageProcessorPil` for backward compatibility. Install torchvision to use ...")
    assert not _shown("transformers.utils.import_utils",
                      "`SiglipImageProcessor` requires torchvision (not installed); falling back to "
                      "`SiglipImageProcessorPil` for backward compatibility. Install torchvision to use ...")


def test_the_fork_server_installs_the_filters_before_the_libraries_it_preloads():
    """The fork server (`python -m paradiff.demo`'s and check-plan's ranks, the test pools) is a fresh interpreter
    that imports WORKER_PRELOAD in order: paradiff, whose import installs the filters, must come first."""
    from paradiff.distributed.spawn import WORKER_PRELOAD

    assert WORKER_PRELOAD[0] == "paradiff"


def test_other_messages_of_those_loggers_still_show():
    assert _shown("torchao", "Skipping import of cpp extensions due to incompatible torch version")
    assert _shown("bitsandbytes.backends.cpu.ops", "something else went wrong")
    assert _shown("diffusers", "Failed to load something")
    assert _shown("transformers.utils.import_utils", "`CLIPImageProcessor` requires torchvision: install it")
