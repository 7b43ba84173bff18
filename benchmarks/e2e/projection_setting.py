"""A projection setting: a deployment described by published figures (``configs/sim/*.yaml``).

Unlike a calibration (``kvtierd/sim/calibration.py``, fitted from probes of a running stack),
a setting says what a deployment *is*: the model's geometry, the GPU's peak FLOP rate and the
share of it prefill reaches (a roofline: attention grows with the context, which a measured line
cannot carry over from 1-4k to 100k tokens), the GPU memory's bandwidth (restoring a loaded
variant), and the tiers with their capacities, bandwidths and per-load overheads. Every figure
carries its source in a comment of the file; ``configs/sim/llama31-8b-h100.yaml`` is the
EvicPress paper's deployment. Errors name the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from kvtierd.errors import InvalidArgumentError
from kvtierd.sim.timing import RooflinePrefill
from kvtierd.sim.workload import ModelPreset
from kvtierd.sim.yaml_doc import YamlDoc
from kvtierd.types import TierModel

_TOP = ("model", "prefill", "hbm_bandwidth_bytes_per_s", "decode_s", "tiers")
_PREFILL = ("peak_flops_per_s", "utilisation")
_TIER = ("name", "capacity_bytes", "bandwidth_bytes_per_s", "overhead_s")


@dataclass(frozen=True, slots=True)
class Setting:
    """A deployment: model, prefill roofline, GPU memory bandwidth, tiers (fastest first)."""

    model: ModelPreset
    peak_flops_per_s: float
    utilisation: float
    hbm_bandwidth_bytes_per_s: float
    decode_s: float
    tiers: tuple[TierModel, ...]
    source: str

    @property
    def prefill(self) -> RooflinePrefill:
        return RooflinePrefill(self.model, self.peak_flops_per_s * self.utilisation)

    def summary(self) -> dict[str, Any]:
        m = self.model
        return {
            "source": self.source,
            "model": m.name,
            "kv_bytes_per_token": m.kv_bytes_per_token,
            "prefill_flops_per_s": self.peak_flops_per_s * self.utilisation,
            "hbm_bandwidth_bytes_per_s": self.hbm_bandwidth_bytes_per_s,
            "decode_s": self.decode_s,
            "tiers": [
                {"name": t.name, "capacity_bytes": t.capacity_bytes,
                 "bandwidth_bytes_per_s": t.load_bandwidth_bytes_per_s,
                 "overhead_s": t.load_overhead_s}
                for t in self.tiers
            ],
        }  # fmt: skip


class _Doc(YamlDoc):
    """A setting document: every key is required, a number is > 0 unless said otherwise."""

    def table(
        self, value: object, where: str, keys: tuple[str, ...], *, required: bool = True
    ) -> dict[str, Any]:
        return super().table(value, where, keys, required=required)

    def number(self, value: object, where: str, *, positive: bool = True) -> float:
        return super().number(value, where, positive=positive)


def parse_setting(text: str, source: str) -> Setting:
    """Validate a setting document (module docstring)."""
    doc = _Doc(source)
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise doc.fail("document", f"not valid YAML: {e}") from e
    top = doc.table(raw, "document", _TOP)
    model = _model(doc, top["model"])
    pre = doc.table(top["prefill"], "prefill", _PREFILL)
    share = doc.number(pre["utilisation"], "prefill.utilisation")
    if share > 1:
        raise doc.fail("prefill.utilisation", f"a share of the peak is in (0, 1], got {share}")
    tiers_raw = top["tiers"]
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise doc.fail("tiers", "expected a list of tiers, fastest first")
    tiers = tuple(_tier(doc, t, f"tiers[{i}]") for i, t in enumerate(tiers_raw))
    if len({t.name for t in tiers}) != len(tiers):
        raise doc.fail("tiers", f"tier names repeat: {[t.name for t in tiers]}")
    return Setting(
        model=model,
        peak_flops_per_s=doc.number(pre["peak_flops_per_s"], "prefill.peak_flops_per_s"),
        utilisation=share,
        hbm_bandwidth_bytes_per_s=doc.number(
            top["hbm_bandwidth_bytes_per_s"], "hbm_bandwidth_bytes_per_s"
        ),
        decode_s=doc.number(top["decode_s"], "decode_s", positive=False),
        tiers=tiers,
        source=source,
    )


def load_setting(path: str | Path) -> Setting:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise InvalidArgumentError(f"setting {path}: cannot read: {e.strerror}") from e
    return parse_setting(text, str(path))


def _model(doc: _Doc, raw: object) -> ModelPreset:
    names = tuple(f.name for f in fields(ModelPreset))
    t = doc.table(raw, "model", names)
    ints = {n: t[n] for n in names if n not in ("name", "active_params")}
    for n, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise doc.fail(f"model.{n}", f"expected a whole number > 0, got {v!r}")
    return ModelPreset(
        name=str(t["name"]),
        active_params=doc.number(t["active_params"], "model.active_params"),
        **ints,
    )


def _tier(doc: _Doc, raw: object, where: str) -> TierModel:
    t = doc.table(raw, where, _TIER)
    if not isinstance(t["name"], str) or not t["name"]:
        raise doc.fail(f"{where}.name", "expected the tier's name")
    capacity = t["capacity_bytes"]
    return TierModel(
        t["name"],
        None if capacity is None else int(doc.number(capacity, f"{where}.capacity_bytes")),
        doc.number(t["bandwidth_bytes_per_s"], f"{where}.bandwidth_bytes_per_s"),
        doc.number(t["overhead_s"], f"{where}.overhead_s", positive=False),
    )
