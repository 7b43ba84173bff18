"""Loading the checkpoint in a policy's ``profiling.model_dir`` (snapkv's window queries, the
``answer`` evaluator): safetensors weights only, never a pickle (``pytorch_model.bin``: code
runs as it loads), never code the checkpoint ships (``auto_map``, ``trust_remote_code``),
never the hub; whatever a transformers or torch version defaults to (issue 27.8: torch>=2.4
is allowed, and before 2.6 ``torch.load`` unpickles anything). Any failure is an
``InvalidArgumentError`` naming the directory: a profile fails, the daemon goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtierd.errors import InvalidArgumentError

SAFETENSORS = ("model.safetensors", "model.safetensors.index.json")


def check_checkpoint(model_dir: str) -> None:
    """Raise unless ``model_dir`` holds a config and safetensors weights, and no remote code."""
    folder = Path(model_dir)
    config = folder / "config.json"
    if not config.is_file():
        raise InvalidArgumentError(
            f"cannot load a causal LM from {model_dir!r}: it has no config.json"
        )
    if not any((folder / name).is_file() for name in SAFETENSORS):
        raise InvalidArgumentError(
            f"cannot load a causal LM from {model_dir!r}: it has no {' or '.join(SAFETENSORS)}; "
            "kvtierd loads safetensors "
            "weights only, never a pickle checkpoint (pytorch_model.bin)"
        )
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidArgumentError(f"{config}: not readable JSON: {e}") from e
    if not isinstance(doc, dict) or "auto_map" in doc:
        raise InvalidArgumentError(
            f"cannot load a causal LM from {model_dir!r}: its config.json names code of its own "
            "(auto_map), which kvtierd never runs"
        )


def load_causal_lm(model_dir: str, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM`` from ``model_dir``, safely (module docstring)."""
    check_checkpoint(model_dir)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            model_dir,
            local_files_only=True,
            use_safetensors=True,
            trust_remote_code=False,
            **kwargs,
        )
    except Exception as e:  # any library error: a clear one, never INTERNAL
        raise InvalidArgumentError(
            f"cannot load a causal LM from {model_dir!r}: {type(e).__name__}: {e}"
        ) from e


def load_tokenizer(model_dir: str) -> Any:
    """``AutoTokenizer`` from ``model_dir``, never remote code."""
    check_checkpoint(model_dir)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(
            model_dir, local_files_only=True, trust_remote_code=False
        )
    except Exception as e:
        raise InvalidArgumentError(
            f"cannot load the tokenizer in {model_dir!r}: {type(e).__name__}: {e}"
        ) from e
