"""What does the administrator know about a device that sysfs cannot tell?

Media class (a CXL controller doesn't say whether DDR4 or DDR5 sits behind it), whether the
DIMMs are recycled, where they came from and what they cost. Read from the agent's TOML
config, keyed by memdev serial (survives renumbering) or by pool-device uid::

    [memdev.3]                      # or [memdev."0x3"]
    media = "ddr4"
    recycled = true
    provenance = "decommissioned db-17, 2019 DIMMs"
    cost_per_gib_month = 0.4

    [device."cxl:ram:serials=3,4:ways=2:gran=4096:size=536870912"]
    media = "ddr4"

The agent config's ``[annotations]`` table also takes the short form, one table per memdev
serial or device uid (:func:`from_agent_config`)::

    [annotations.3]
    media = "ddr4"
    [annotations."rack1-h7/numa:node2"]   # a wire uid: the host prefix is dropped
    recycled = true
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class Annotation(BaseModel):
    """What an administrator says about one memdev or device."""

    model_config = ConfigDict(extra="forbid")

    media: str | None = Field(default=None, pattern=r"^[a-z0-9_\-]+$", max_length=32)
    recycled: bool | None = None
    provenance: str | None = None
    cost_per_gib_month: float | None = Field(default=None, ge=0)


class Annotations(BaseModel):
    """All annotations from one config."""

    model_config = ConfigDict(extra="forbid")

    memdev: dict[int, Annotation] = Field(default_factory=dict)
    device: dict[str, Annotation] = Field(default_factory=dict)

    @field_validator("memdev", mode="before")
    @classmethod
    def _serial_keys(cls, value: Any) -> Any:
        """TOML keys are strings: accept "3" and "0x3" alike."""
        if isinstance(value, Mapping):
            return {int(k, 0) if isinstance(k, str) else k: v for k, v in value.items()}
        return value


class AnnotationError(ValueError):
    """The annotations config is not valid TOML or has unknown keys/bad values."""


def parse_annotations(data: Mapping[str, Any]) -> Annotations:
    """Validate an already-parsed table (the agent config's ``[annotations]``, or a file)."""
    try:
        return Annotations.model_validate(dict(data))
    except (ValidationError, ValueError) as exc:
        raise AnnotationError(str(exc)) from exc


def load_annotations(path: Path) -> Annotations:
    """Read annotations from a TOML file; an absent file means no annotations."""
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return Annotations()
    except tomllib.TOMLDecodeError as exc:
        raise AnnotationError(f"{path}: {exc}") from exc
    return parse_annotations(data.get("annotations", data))


def merge_for_device(annotations: Annotations, uid: str, serials: list[int]) -> Annotation:
    """The annotation that applies to a device built from ``serials`` (pure).

    A device-level entry wins field by field. Otherwise the memdevs speak: one media class
    if they agree ("mixed" if not), recycled if any part is, provenances joined, and the
    mean cost (interleaving spreads capacity evenly over the parts).
    """
    parts = [annotations.memdev[s] for s in serials if s in annotations.memdev]
    merged = Annotation()
    if parts:
        media = {p.media for p in parts if p.media}
        if media:
            merged.media = media.pop() if len(media) == 1 else "mixed"
        recycled = [p.recycled for p in parts if p.recycled is not None]
        if recycled:
            merged.recycled = any(recycled)
        provenance = sorted({p.provenance for p in parts if p.provenance})
        if provenance:
            merged.provenance = "; ".join(provenance)
        costs = [p.cost_per_gib_month for p in parts if p.cost_per_gib_month is not None]
        if costs and len(costs) == len(serials):
            merged.cost_per_gib_month = sum(costs) / len(costs)
    device = annotations.device.get(uid)
    if device is not None:
        for field in ("media", "recycled", "provenance", "cost_per_gib_month"):
            value = getattr(device, field)
            if value is not None:
                setattr(merged, field, value)
    return merged


def _is_serial(key: str) -> bool:
    try:
        int(key, 0)
    except ValueError:
        return False
    return True


def from_agent_config(table: Mapping[str, Any], host: str | None = None) -> Annotations:
    """The agent config's ``[annotations]`` table as :class:`Annotations`.

    Keys ``memdev`` and ``device`` hold the long form (as in an annotations file). Any
    other key is one memdev serial ("3", "0x3") or one device uid; a uid the way poold
    shows it, prefixed with ``<host>/``, is accepted too.
    """
    memdev: dict[Any, Any] = {}
    device: dict[str, Any] = {}
    for key, value in table.items():
        if key == "memdev" and isinstance(value, Mapping):
            memdev.update(value)
        elif key == "device" and isinstance(value, Mapping):
            device.update(value)
        elif _is_serial(key):
            memdev[key] = value
        else:
            if host and key.startswith(f"{host}/"):
                key = key[len(host) + 1 :]
            device[key] = value
    return parse_annotations({"memdev": memdev, "device": device})
