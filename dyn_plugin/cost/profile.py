"""The profile file: measured costs of one model on one device, and the cost model fitted to them.

A profile is JSON (schema ``dyn_plugin.profile``, version 4; versions 1 to 3 are read too;
docs/profile-format.md). Its
``samples`` are the measurements, one per (component, layout, recompute, tp, micro-batch);
its ``tables`` are the fits. A profile written elsewhere (another machine, a GPU) may omit
``tables``: they are fitted from ``samples`` when it is loaded.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..atomic import CHECKSUM_KEY, check_sha256, with_sha256, write_json_atomic
from ..config import ModelShape
from ..jsonfile import read_json
from .model import COMPONENTS, METRICS, features
from .sequence_parallel import SequenceParallelCost
from .table import CostTable, LinearFit, TableCostModel, fit_banded, fit_error, fit_linear, nnls_relative
from .update import UpdateCost

SCHEMA = "dyn_plugin.profile"
VERSION = 5
# Version 2 added device.dtype; a version 1 file measured in its model's dtype. Version 3 added
# model.num_heads / num_kv_heads and the sequence-parallel collectives; without them the heads
# come from the model's config where it has them and the collectives from the cluster's links.
# Version 4 added model.shape, the shape measured; an older file cannot be checked against the
# model a run trains (from_config.py). Version 5 added weight_ms, the linear layers' weight gradients
# timed apart (a split backward's W); without it W is estimated from the forward (table.weight_grad_ms).
READS = (1, 2, 3, 4, 5)
MEMORY_METRICS = ("stored_bytes", "peak_bytes")


class _Record(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Sample(_Record):
    """One measurement. ``model`` samples time a whole model of ``num_layers`` layers
    (embedding and head included); the others one component alone."""

    component: Literal["embedding", "layer", "head", "model"]
    num_layers: int | None = Field(default=None, gt=0, description="layers in the measured model (component 'model')")
    layout: Literal["padded", "packed"]
    recompute: Literal["none", "selective", "full"]
    tp: int = Field(default=1, gt=0)
    seq_lens: list[int] = Field(
        min_length=1, description="padded: the row length repeated per row; packed: document lengths"
    )
    forward_ms: float = Field(gt=0)
    backward_ms: float = Field(gt=0)
    stored_bytes: float = Field(ge=0)
    peak_bytes: float = Field(ge=0)
    weight_ms: float | None = Field(
        default=None, ge=0, description="the linear layers' weight gradients alone (a split backward's W), where timed"
    )


class Fit(_Record):
    coef: tuple[float, float, float]
    mape: float = 0.0
    max_ape: float = 0.0
    n: int = 0
    floor: float = Field(default=0.0, ge=0, description="the fit is max(floor, c0 + c1*tokens + c2*attn)")
    bands: list[tuple[float, float, float, float]] = Field(
        default=[],
        description="(upper length, c0, c1, c2): piecewise in the length attn/tokens, the first band whose upper "
        "length is not below it applies, coef beyond the last (activation memory, cost/table.py fit_banded)",
    )


class Table(_Record):
    layout: Literal["padded", "packed"]
    recompute: Literal["none", "selective", "full"]
    tp: int = Field(gt=0)
    max_tokens: float
    max_len: float
    fits: dict[
        Literal["embedding", "layer", "head"],
        dict[Literal["forward_ms", "backward_ms", "stored_bytes", "peak_bytes", "weight_ms"], Fit],
    ]


class ModelInfo(_Record):
    name: str
    num_layers: int = Field(gt=0)
    hidden_size: int | None = Field(default=None, gt=0, description="model width; sizes activations between stages")
    num_heads: int | None = Field(default=None, gt=0, description="attention (query) heads: Ulysses or ring")
    num_kv_heads: int | None = Field(default=None, gt=0, description="key/value heads; absent: as many as num_heads")
    params: dict[Literal["embedding", "layer", "head"], float]
    dtype: Literal["fp32", "fp16", "bf16"]
    config: dict[str, Any] = {}
    shape: ModelShape | None = Field(
        default=None,
        description="the shape measured (cost/shape.py); a run refuses the profile for a model of another "
        "shape. Absent in imported tables and files before version 4: unchecked",
    )

    @model_validator(mode="after")
    def _heads_from_config(self) -> "ModelInfo":
        if self.num_heads is None:  # a version 1 or 2 file of a transformers model: its config says
            heads = self.config.get("num_attention_heads") or self.config.get("n_head")
            if heads:
                self.num_heads, self.num_kv_heads = int(heads), self.config.get("num_key_value_heads")
        return self


class DeviceInfo(_Record):
    type: str = Field(description="torch device type the samples were measured on: cpu, cuda (or gpu for imports)")
    name: str
    dtype: Literal["fp32", "fp16", "bf16"] | None = Field(
        default=None,
        description="precision the samples were measured in (the config's cost_model.dtype "
        "literals); absent in version 1 files, where it is the model's dtype",
    )
    threads: int | None = None
    torch: str | None = None


class UpdateSamples(_Record):
    """Measured costs of a step's update (see update.py)."""

    backend: str = "gloo"
    optimizer: list[tuple[float, float]] = Field(default=[], description="(parameters, ms) of one AdamW step")
    allreduce: list[tuple[float, float]] = Field(default=[], description="(bytes, ms) of an all-reduce among `ranks`")
    allgather: list[tuple[float, float]] = Field(
        default=[], description="(bytes gathered per rank: the whole buffer, ms) of an all-gather among `ranks`"
    )
    reducescatter: list[tuple[float, float]] = Field(
        default=[], description="(bytes reduced per rank: the whole buffer, ms) of a reduce-scatter among `ranks`"
    )


class CollectiveSamples(_Record):
    """Measured attention collectives of sequence parallelism (sequence_parallel.py)."""

    backend: str = "gloo"
    alltoall: list[tuple[float, float]] = Field(
        default=[], description="(bytes, ms) of an all-to-all of a buffer of that many bytes per rank among `ranks`"
    )
    p2p: list[tuple[float, float]] = Field(
        default=[],
        description="(bytes, ms) of a ring exchange among `ranks`: each sends that many bytes to the "
        "next rank while it receives as many from the previous one",
    )


class Profile(_Record):
    schema_: Literal["dyn_plugin.profile"] = Field(alias="schema", default=SCHEMA)
    version: int = VERSION
    created: str = ""
    model: ModelInfo
    device: DeviceInfo
    pad_multiple: int = Field(default=8, gt=0)
    grid: dict[str, Any] = {}
    samples: list[Sample] = []
    tables: list[Table] | None = None
    packed_from_padded: bool = Field(
        default=False,
        description="price packed micro-batches with the padded fits (by their features): for tables measured "
        "on padded batches only, with kernels whose cost follows tokens and sum(s_i^2), as varlen attention does",
    )
    validation: dict[str, Any] | None = Field(default=None, description="held-out check of the fit, if one was run")
    pyramid: dict[str, Any] | None = Field(
        default=None,
        description="peak activation memory of one micro-batch at several checkpointed-layer counts, "
        "measured against the fit's prediction, if checked",
    )
    ranks: int = Field(
        default=1,
        ge=1,
        description="processes training side by side while measuring: the profiled "
        "one and ranks-1 load processes (ranks on one host slow each other down)",
    )
    update: UpdateSamples | None = Field(default=None, description="gradient all-reduce and optimizer step, measured")
    collectives: CollectiveSamples | None = Field(
        default=None,
        description="sequence-parallel all-to-all and ring exchange, measured; absent: priced from the "
        "cluster's link bandwidth",
    )

    @model_validator(mode="after")
    def _measured_dtype(self) -> "Profile":
        if self.device.dtype is None:  # a version 1 file: measured in the model's training dtype
            self.device = self.device.model_copy(update={"dtype": self.model.dtype})
        elif self.device.dtype != self.model.dtype:
            raise ValueError(
                f"device.dtype {self.device.dtype!r} differs from model.dtype {self.model.dtype!r}: "
                "a profile is measured in the precision it prices"
            )
        return self


def _fit_from_models(models: list[Sample], embedding: dict[str, LinearFit], layout, pad_multiple) -> dict:
    """Per-component fits from whole-model samples at several depths, in one regression.

    M(L) = head(f) + L * layer(f) (+ the embedding, fitted on its own samples and subtracted):
    pooling every depth and micro-batch averages out the timing noise that a per-point
    difference M(L2) - M(L1) would amplify.
    """
    feats = [features(s.seq_lens, layout, pad_multiple) for s in models]
    tok = np.array([f.slots for f in feats])
    att = np.array([f.attn for f in feats])
    depth = np.array([s.num_layers for s in models], dtype=float)
    base = np.stack([np.ones_like(tok), tok, att], axis=1)
    X = np.concatenate([base, base * depth[:, None]], axis=1)
    fits: dict[str, dict[str, LinearFit]] = {"layer": {}, "head": {}}
    for metric in ("forward_ms", "backward_ms", "stored_bytes"):
        y = np.array([getattr(s, metric) for s in models], dtype=float)
        emb = np.array([embedding[metric](f) for f in feats])
        coef = nnls_relative(X, np.maximum(y - emb, 1e-9))
        mape, max_ape = fit_error(X @ coef + emb, y)
        fits["head"][metric] = LinearFit(tuple(coef[:3]), mape, max_ape, len(y))
        fits["layer"][metric] = LinearFit(tuple(coef[3:]), mape, max_ape, len(y))
    weighed = [s for s in models if s.weight_ms is not None]
    if len({s.num_layers for s in weighed}) >= 2:  # W timed at two depths at least: separate the layers'
        rows = [i for i, s in enumerate(models) if s.weight_ms is not None]
        w = np.array([s.weight_ms for s in weighed], dtype=float)  # the embedding has none (a scatter, in I)
        coef = nnls_relative(X[rows], np.maximum(w, 1e-9))
        mape, max_ape = fit_error(X[rows] @ coef, w)
        fits["head"]["weight_ms"] = LinearFit(tuple(coef[:3]), mape, max_ape, len(w))
        fits["layer"]["weight_ms"] = LinearFit(tuple(coef[3:]), mape, max_ape, len(w))
    # The transient above the stored bytes is a whole-model figure; every component carries it.
    transient = fit_linear(tok, att, np.array([max(s.peak_bytes - s.stored_bytes, 1.0) for s in models]))
    for comp in ("layer", "head"):
        st = fits[comp]["stored_bytes"]
        fits[comp]["peak_bytes"] = LinearFit(
            tuple(a + b for a, b in zip(st.coef, transient.coef)), transient.mape, transient.max_ape, transient.n
        )
    return fits


def fit_component(samples: list[Sample], layout, pad_multiple) -> dict[str, LinearFit]:
    """Every metric of one component fitted from its own samples."""
    feats = [features(s.seq_lens, layout, pad_multiple) for s in samples]
    tok = np.array([f.slots for f in feats])
    att = np.array([f.attn for f in feats])
    out = {}
    for metric in METRICS:
        y = np.array([getattr(s, metric) for s in samples], dtype=float)
        if not np.all(y > 0):  # a component that keeps no memory (the embedding's stored bytes) fits to zero
            out[metric] = LinearFit((0.0, 0.0, 0.0))
        elif metric in MEMORY_METRICS and samples[0].component == "layer":
            out[metric] = fit_banded(tok, att, y)
        else:
            out[metric] = fit_linear(tok, att, y, floor=True)
    return out


def fit_tables(samples: list[Sample], pad_multiple: int = 8) -> list[Table]:
    """One table per (layout, recompute, tp): from whole-model samples where there are any,
    else from per-component samples (layer and head; the embedding may be absent)."""
    groups: dict[tuple, dict[str, list[Sample]]] = defaultdict(lambda: defaultdict(list))
    for s in samples:
        groups[(s.layout, s.recompute, s.tp)][s.component].append(s)
    zero = {m: LinearFit((0.0, 0.0, 0.0)) for m in METRICS}
    tables = []
    for (layout, recompute, tp), by_comp in sorted(groups.items()):
        key = f"{layout}/{recompute}/tp{tp}"
        embedding = fit_component(by_comp["embedding"], layout, pad_multiple) if by_comp.get("embedding") else zero
        if by_comp.get("model"):
            if any(s.num_layers is None for s in by_comp["model"]):
                raise ValueError(f"profile samples {key}: every 'model' sample needs num_layers")
            if len({s.num_layers for s in by_comp["model"]}) < 2:
                raise ValueError(f"profile samples {key}: 'model' samples need at least two depths to separate layers")
            fits = _fit_from_models(by_comp["model"], embedding, layout, pad_multiple)
        elif by_comp.get("layer") and by_comp.get("head"):
            fits = {c: fit_component(by_comp[c], layout, pad_multiple) for c in ("layer", "head")}
        else:
            raise ValueError(f"profile samples {key}: need 'model' samples, or both 'layer' and 'head' samples")
        fits["embedding"] = embedding
        used = [s for c in by_comp.values() for s in c]
        feats = [features(s.seq_lens, layout, pad_multiple) for s in used]
        fit_records = {
            c: {
                m: Fit(coef=f.coef, mape=f.mape, max_ape=f.max_ape, n=f.n, floor=f.floor, bands=list(f.bands))
                for m, f in fits[c].items()
            }
            for c in COMPONENTS
        }
        tables.append(
            Table(
                layout=layout,
                recompute=recompute,
                tp=tp,
                fits=fit_records,
                max_tokens=max(f.slots for f in feats),
                max_len=max(f.max_len for f in feats),
            )
        )
    return tables


def load_profile(source: str | os.PathLike | dict[str, Any]) -> Profile:
    """Read and check a profile; fit its tables if it carries only samples."""
    if isinstance(source, dict):
        raw, where = source, "profile dict"
    else:
        where = str(source)
        raw = read_json(source, "profile")
    if not isinstance(raw, dict) or raw.get("schema") != SCHEMA:
        raise ValueError(f'{where} is not a dyn_plugin profile (expected "schema": "{SCHEMA}")')
    if raw.get("version") not in READS:
        raise ValueError(
            f"{where} has profile schema version {raw.get('version')!r}; this dyn-plugin reads versions "
            f"{', '.join(map(str, READS))}. Re-run `dynplugin profile` or upgrade dyn-plugin"
        )
    # a file's checksum (save_profile writes one) is checked; a dict is the caller's, perhaps edited
    raw = check_sha256(raw, f"profile {where}") if not isinstance(source, dict) else raw
    raw = {k: v for k, v in raw.items() if k != CHECKSUM_KEY}
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"{where} does not follow the profile schema:\n{exc}") from None
    if profile.tables is None:
        if not profile.samples:
            raise ValueError(f"{where} has neither samples nor tables")
        profile = profile.model_copy(update={"tables": fit_tables(profile.samples, profile.pad_multiple)})
    return profile


def save_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Written whole or not at all, with the checksum ``load_profile`` checks (``dyn_plugin.atomic``)."""
    write_json_atomic(path, with_sha256(profile.model_dump(mode="json", by_alias=True)), separators=(",", ":"))


def cost_model_from_profile(profile: Profile, *, allow_extrapolation: bool = False) -> TableCostModel:
    tables = {}
    for t in profile.tables or fit_tables(profile.samples, profile.pad_multiple):
        fits = {
            c: {m: LinearFit(f.coef, f.mape, f.max_ape, f.n, f.floor, tuple(f.bands)) for m, f in ms.items()}
            for c, ms in t.fits.items()
        }
        layouts = ("padded", "packed") if profile.packed_from_padded and t.layout == "padded" else (t.layout,)
        for layout in layouts:
            tables[(layout, t.recompute, t.tp)] = CostTable(layout, t.recompute, t.tp, fits, t.max_tokens, t.max_len)
    return TableCostModel(
        name=f"{profile.model.name}@{profile.device.name}",
        num_layers=profile.model.num_layers,
        tables=tables,
        params=dict(profile.model.params),
        dtype=profile.model.dtype,
        pad_multiple=profile.pad_multiple,
        allow_extrapolation=allow_extrapolation,
        hidden_size=profile.model.hidden_size,
        update=UpdateCost.fit(
            profile.update.optimizer,
            profile.update.allreduce,
            max(profile.ranks, 2),
            profile.update.allgather,
            profile.update.reducescatter,
        )
        if profile.update
        else UpdateCost(),
        num_heads=profile.model.num_heads,
        num_kv_heads=profile.model.num_kv_heads,
        collectives=SequenceParallelCost.fit(
            profile.collectives.alltoall, profile.collectives.p2p, max(profile.ranks, 2)
        )
        if profile.collectives
        else SequenceParallelCost(),
    )
