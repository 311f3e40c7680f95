"""The ``"dyn_plugin"`` section of a DeepSpeed JSON config, validated.

DeepSpeed ignores unknown top-level keys, so one file serves both: DeepSpeed reads its own
keys, the plugin reads ``"dyn_plugin"``. Every mistake is reported with the full key path,
the offending value and what is allowed; a misspelled key comes with the closest valid one.
"""

from __future__ import annotations

import difflib
import logging
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Mapping
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .checks import MAX_RANKS, MAX_TOKENS
from .jsonfile import read_json

SECTION = "dyn_plugin"
# how close a top-level key must be to SECTION to be taken for a misspelling of it (difflib
# ratio): "dyn_plugn", "dynplugin", "dyn-plugin" are above, DeepSpeed's own keys far below
SECTION_LOOKALIKE = 0.8
STRICT_HINTS = {  # strict mode refuses "8" for 8 and "true" for true: say what to write instead
    "int_type": "write a JSON integer (no quotes, no decimal point)",
    "float_type": "write a JSON number (no quotes)",
    "bool_type": "write true or false (no quotes)",
}

logger = logging.getLogger(__name__)
MIN_SECRET_BYTES = 16  # shortest shared secret the plan store accepts
MAX_INT = 2**53  # any integer field: far above a real value, far below int64
ZERO_STAGES = (0, 1, 2, 3)


# the precisions a run trains in, by the names every config, profile and flag uses
Precision = Literal["fp32", "fp16", "bf16"]


class ConfigError(ValueError):
    """A config that cannot be used; the message names each bad field and how to fix it."""


class _Section(BaseModel):
    # "8" for 8 is a mistake, not a value; so is Infinity or NaN (JSON writers emit them), which
    # would pass every "> 0" check and then price every plan at 0 ms or refuse all of them
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _within_int64(cls, value: Any) -> Any:
        # a count beyond int64 wraps to a negative number in numpy and the C++ planners
        for v in value if isinstance(value, list) else (value,):
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
                raise ValueError(f"beyond any real count or size (at most 2**53 = {MAX_INT:,})")
        return value


class ModelShape(_Section):
    """Transformer shape, for the analytic cost model and model-state memory (``cost/shape.py``
    reads it from a transformers config)."""

    hidden_size: int = Field(gt=0, description="model width h")
    num_layers: int = Field(gt=0, description="transformer layers")
    num_heads: int = Field(gt=0, description="attention heads")
    num_kv_heads: int | None = Field(default=None, gt=0, description="key/value heads (GQA); default num_heads")
    head_dim: int | None = Field(default=None, gt=0, description="width of one head; default hidden_size / num_heads")
    ffn_hidden_size: int = Field(gt=0, description="MLP inner width (of the dense layers of a mixture of experts)")
    vocab_size: int = Field(gt=0, description="vocabulary size")
    gated_mlp: bool = Field(default=True, description="SwiGLU-style MLP (Llama) rather than GELU (GPT)")
    num_experts: int = Field(default=0, ge=0, description="routed MLP experts per layer (mixture of experts); 0: dense")
    experts_per_token: int = Field(default=0, ge=0, description="routed experts each token runs through")
    expert_ffn_hidden_size: int | None = Field(
        default=None, gt=0, description="inner width of one routed expert; default ffn_hidden_size"
    )
    shared_expert_ffn_hidden_size: int = Field(
        default=0, ge=0, description="inner width of the experts every token runs through besides the routed ones"
    )
    dense_layers: int = Field(
        default=0, ge=0, description="layers of a mixture of experts with a dense MLP of ffn_hidden_size instead"
    )
    tied_embeddings: bool = Field(default=False, description="the head's weights are the input embedding's")
    flash_attention: bool = Field(default=True, description="attention memory linear in length (flash/varlen kernels)")

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelShape":
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads} (or set head_dim)"
            )
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} must be divisible by num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be within 1..num_experts {self.num_experts}"
            )
        if not self.num_experts and (self.experts_per_token or self.dense_layers):
            raise ValueError("experts_per_token and dense_layers describe a mixture of experts: set num_experts")
        if self.dense_layers > self.num_layers:
            raise ValueError(f"dense_layers {self.dense_layers} exceeds num_layers {self.num_layers}")
        return self

    @property
    def query_width(self) -> int:
        """Width of the queries (and of the attention's output): heads times their width."""
        return self.num_heads * (self.head_dim or self.hidden_size // self.num_heads)

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values)."""
        return (self.num_kv_heads or self.num_heads) * (self.head_dim or self.hidden_size // self.num_heads)


# What the caching allocator needs above the bytes tensors hold at the peak, measured on an H200
# (benchmarks/gpu-memory-2026-11-26: variable-length training steps with the allocator capped):
# the default allocator ran with 6.3% (out of memory at 3%), expandable segments at 1% (at 0%).
CACHING_ALLOCATOR_MARGIN = 0.065
EXPANDABLE_SEGMENTS_MARGIN = 0.01


class DeviceSpec(_Section):
    """One accelerator (or CPU socket) as the planners see it."""

    name: str = Field(default="cpu", description="free-form device name")
    memory_mb: float = Field(default=16000, gt=0, description="device memory in MB")
    memory_fraction: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="share of memory_mb plans may use; ranks see different free memory and an OOM on one rank deadlocks the rest",
    )
    allocator_margin: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="what the memory allocator needs above the bytes plans price, as a fraction of them; default "
        "measured: 0.065 for PyTorch's caching allocator, 0.01 with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    )
    peak_tflops: float = Field(default=1.0, gt=0, description="peak dense TFLOP/s at the training precision")
    achieved_fraction: float = Field(default=0.5, gt=0, le=1, description="fraction of peak_tflops kernels reach")
    layer_overhead_ms: float = Field(default=0.05, ge=0, description="fixed cost per layer per pass (launches)")

    @property
    def margin(self) -> float:
        """``allocator_margin``, else the measured one of the allocator this process is set up with."""
        if self.allocator_margin is not None:
            return self.allocator_margin
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
        return EXPANDABLE_SEGMENTS_MARGIN if "expandable_segments:true" in conf else CACHING_ALLOCATOR_MARGIN

    @property
    def plannable_mb(self) -> float:
        """The memory a plan's own estimate may reach: the usable share of the device, less the
        allocator's margin above it, so estimate x (1 + margin) stays within the share."""
        return self.memory_mb * self.memory_fraction / (1 + self.margin)


class ClusterConfig(_Section):
    devices_per_node: int = Field(default=1, gt=0, le=MAX_RANKS, description="devices in one node")
    num_nodes: int = Field(default=1, gt=0, le=MAX_RANKS, description="nodes")
    device: DeviceSpec = DeviceSpec()
    intra_node_gb_per_s: float = Field(
        default=100.0, gt=0, description="device-to-device bandwidth inside a node, GB/s"
    )
    inter_node_gb_per_s: float = Field(default=12.5, gt=0, description="bandwidth between nodes per device, GB/s")
    latency_us: float = Field(default=10.0, ge=0, description="latency of one point-to-point message, microseconds")

    @property
    def world_size(self) -> int:
        return self.devices_per_node * self.num_nodes


class CostModelConfig(_Section):
    kind: Literal["analytic", "profile"] = Field(
        default="analytic", description="'analytic' (from model shape and device) or 'profile' (fitted to measurements)"
    )
    profile: str | None = Field(default=None, description="path to a profile JSON written by `dynplugin profile`")
    model: ModelShape | None = Field(
        default=None, description="model shape for kind='analytic'; adapters fill it from the live model when absent"
    )
    dtype: Precision = Field(default="bf16", description="training precision")
    allow_extrapolation: bool = Field(
        default=False, description="price micro-batches larger than the profile measured instead of refusing them"
    )

    @model_validator(mode="after")
    def _source_given(self) -> "CostModelConfig":
        if self.kind == "profile" and not self.profile:
            raise ValueError("kind='profile' needs 'profile': the path of a profile JSON (see `dynplugin profile`)")
        return self


class MicrobatchingConfig(_Section):
    # the names of plan/methods/registry.py's METHODS (tests/test_config.py checks: this layer imports no planner)
    method: Literal["dynapipe", "fixed_padding", "token_budget", "packing_full", "packing_varlen"] = Field(
        default="dynapipe",
        description="the plugin's plan, or a baseline's batching (for side-by-side comparisons)",
    )
    layout: Literal["padded", "packed", "auto"] = Field(
        default="auto", description="micro-batch layout; 'auto' lets the planner pick the faster one"
    )
    global_tokens: int = Field(
        default=65536, gt=0, le=MAX_TOKENS, description="tokens in one global batch, over all data-parallel ranks"
    )
    max_seq_len: int = Field(default=8192, gt=0, description="longest sequence accepted")
    lookahead: int = Field(
        default=64,
        ge=0,
        le=1_000_000,
        description="a global batch goes on past sequences that do not fit what is left of global_tokens, taking "
        "later ones that do, until this many have not (those passed over go to the next batches: every sample "
        "still once an epoch); 0: a batch ends at the first that does not fit (about 85% of the budget filled "
        "with code documents)",
    )
    truncate: bool = Field(
        default=False, description="truncate sequences longer than max_seq_len instead of refusing them"
    )
    pad_multiple: int = Field(default=8, gt=0, description="padded micro-batches round their length up to this")
    recompute: Literal["auto", "none", "selective", "full"] = Field(
        default="auto", description="activation recompute; 'auto' uses the cheapest one that fits in memory"
    )

    @property
    def may_pack(self) -> bool:
        """Whether the plans may hold packed rows: the packing baselines always, the plugin's planner
        unless its layout is pinned to padded."""
        return self.method.startswith("packing") or (self.method == "dynapipe" and self.layout != "padded")


class PipelineConfig(_Section):
    stages: int = Field(default=1, gt=0, description="pipeline-parallel stages")
    # the names of plan/steps/schedule.py's SCHEDULES (tests/test_config.py checks)
    schedule: Literal["1f1b", "adaptive", "auto", "zero_bubble"] = Field(
        default="auto",
        description="'auto' picks the schedule with the shortest simulated step; 'zero_bubble' also tries each "
        "with its backwards split into input and weight gradients (DeepSpeed's pipeline in fp32; Megatron on the "
        "plugin's executor)",
    )
    cap_in_flight: bool = Field(
        default=True,
        description="fit memory by holding fewer micro-batches in flight on a stage; false: every stage warms up "
        "its natural stages - s - 1 forwards, as Megatron's schedule does, and memory is fit by recompute "
        "(set for you under Megatron, unless pipeline.schedule is 'zero_bubble')",
    )
    layers_per_stage: list[int] | None = Field(default=None, description="layers on each stage; default an even split")

    @model_validator(mode="after")
    def _one_entry_per_stage(self) -> "PipelineConfig":
        if self.layers_per_stage is not None:
            if len(self.layers_per_stage) != self.stages:
                raise ValueError(
                    f"layers_per_stage has {len(self.layers_per_stage)} entries but stages = {self.stages}; give one per stage"
                )
            if min(self.layers_per_stage) < 1:
                raise ValueError("every entry of layers_per_stage must be >= 1")
        return self


class SequenceParallelConfig(_Section):
    """DCP: a sequence-parallel size per micro-batch, and pyramid checkpointing."""

    enabled: bool = Field(default=False, description="split long sequences over groups of data-parallel ranks")
    sizes: list[int] = Field(
        default=[1, 2, 4, 8],
        description="group sizes the planner may use: powers of two; without 1 every sequence is split (a fixed size)",
    )
    attention: Literal["ulysses", "ring", "auto"] = Field(
        default="auto",
        description="'ulysses' shards heads (the group size must divide the query and key/value heads), "
        "'ring' passes key/value blocks around; 'auto': Ulysses where the heads divide, else ring",
    )
    pyramid: bool = Field(
        default=True, description="checkpoint only as many layers per stage as memory needs (per micro-batch)"
    )
    balance: Literal["auto", "intra", "inter"] = Field(
        default="auto",
        description="'intra': every group runs the same number of micro-batches; 'inter': groups run "
        "different numbers (variable accumulation); 'auto': inter unless ZeRO-2/3 needs equal counts",
    )

    @model_validator(mode="after")
    def _powers_of_two(self) -> "SequenceParallelConfig":
        bad = [k for k in self.sizes if k < 1 or k & (k - 1)]
        if bad or not self.sizes:
            raise ValueError(
                f"sizes = {self.sizes}: every size must be a power of two (1, 2, 4, ...), e.g. [1, 2, 4, 8]"
            )
        return self


class ShardingConfig(_Section):
    """OSDP: a sharding choice per module, searched under a memory budget (dyn_plugin/plan/sharding/search.py)."""

    enabled: bool = Field(
        default=False,
        description="shard each module as the searched plan says (FSDP entry, or ZeRO-3 "
        "settings merged by deepspeed_ext.initialize)",
    )
    host: Literal["auto", "fsdp2", "fsdp1", "zero3"] = Field(
        default="auto",
        description="whose semantics price the choices: 'auto' = zero3 under DeepSpeed, fsdp2 in the FSDP entry",
    )
    memory_budget_mb: float | None = Field(
        default=None,
        gt=0,
        description="per-rank memory the plan (model states + activations) may use, as priced; "
        "default cluster.device.memory_mb * memory_fraction less the allocator's margin",
    )
    plan: str | None = Field(
        default=None, description="a plan JSON written by `dynplugin shard`; unset: searched at start-up"
    )
    shard_size: int | None = Field(
        default=None,
        gt=0,
        description="ranks a parameter is sharded over (< world: hybrid sharding, replicated across "
        "groups); unset: the search tries the world and the node",
    )
    choices: list[Literal["replicate", "keep", "grad_op", "full", "reshard", "split"]] = Field(
        default=["replicate", "keep", "grad_op", "full", "reshard", "split"],
        description="choices the search may make per module (the host may allow fewer)",
    )
    max_slices: int = Field(default=4, ge=2, description="'split': most slices a linear layer is cut into")
    overlap: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of the neighbouring module's compute that hides a collective: "
        "1 on GPUs (separate streams); lower on CPUs, where gloo and the kernels share the cores",
    )


class StrategyConfig(_Section):
    """Hydraulis: heterogeneous strategies (pipelines of different sequence-parallel sizes), one
    chosen per step (dyn_plugin/plan/strategies/strategy.py); its pipelines are sequence_parallel's groups."""

    enabled: bool = Field(
        default=False,
        description="plan every step under the proposal's strategies instead of the "
        "per-step groupings of sequence_parallel",
    )
    proposal: str | None = Field(
        default=None,
        description="a proposal JSON written by `dynplugin strategy`; unset: proposed at start-up "
        "from the run's dataset lengths (deterministic: every rank proposes the same)",
    )
    max_strategies: int = Field(
        default=3, ge=1, description="most strategies proposed at start-up (without 'proposal')"
    )
    stage2: Literal["dp", "ilp"] = Field(
        default="dp",
        description="how each pipeline's sequences are cut into micro-batches: 'dp' (DynaPipe's "
        "dynamic program) or 'ilp' (an integer program solved by HiGHS, kept where it simulates faster)",
    )
    ilp_node_limit: int | None = Field(
        default=None,
        gt=0,
        description="stage2='ilp': branch-and-bound nodes per solve, a limit that ends every "
        "solve alike in every process; unset: the ILP's own default",
    )
    ilp_time_budget_ms: float | None = Field(
        default=None,
        gt=0,
        description="stage2='ilp': a wall-clock limit per solve as well; solves may then differ "
        "between processes, so it needs a store (each step solved once by the planner processes, shared)",
    )

    @model_validator(mode="after")
    def _ilp_fields_need_ilp(self) -> "StrategyConfig":
        for name in sorted(self.model_fields_set & {"ilp_node_limit", "ilp_time_budget_ms"}):
            if self.stage2 != "ilp":
                raise ValueError(
                    f"'{name}' is only used by stage2 'ilp' but stage2 is '{self.stage2}'; set "
                    f"stage2='ilp' or drop '{name}'"
                )
        return self


class LoaderConfig(_Section):
    planners: int = Field(default=1, ge=1, description="background planner processes (with a store)")
    prefetch: int = Field(default=4, ge=1, description="global batches planned ahead of training (with a store)")
    plan_timeout_s: float = Field(
        default=120,
        gt=0,
        description="how long a rank waits for its plan, or for a plan store that stopped answering, before "
        "failing (every rank fails at the same step, naming the store)",
    )
    local_plan_after_s: float | None = Field(
        default=None,
        gt=0,
        description="how late a plan from the planner processes may be (the store answers, the plan is not "
        "there) before the rank plans that step itself, which gives the same plan (plans are deterministic); "
        "it then stops waiting on that planner until it publishes again. Counted once the rank has had a plan "
        "from the store (before, the planners may still be starting). Unset: plan_timeout_s / 4. Must be "
        "below plan_timeout_s. Under strategy.ilp_time_budget_ms plans cannot be remade identically, so "
        "ranks wait plan_timeout_s and fail instead",
    )

    @model_validator(mode="after")
    def _fallback_before_timeout(self) -> "LoaderConfig":
        if self.local_plan_after_s is not None and self.local_plan_after_s >= self.plan_timeout_s:
            raise ValueError(
                f"local_plan_after_s = {self.local_plan_after_s:g} would never come before plan_timeout_s = "
                f"{self.plan_timeout_s:g}: set it below, or leave it unset (plan_timeout_s / 4)"
            )
        return self

    @property
    def plan_late_s(self) -> float:
        """``local_plan_after_s``, or its default when unset."""
        return self.local_plan_after_s if self.local_plan_after_s is not None else self.plan_timeout_s / 4


class CalibrationConfig(_Section):
    """Online calibration of the cost model's time terms from the run's measured micro-batches
    (dyn_plugin/cost/online.py; runtime/calibration.py publishes each version to every rank and planner)."""

    enabled: bool = Field(
        default=True,
        description="refit the time terms during training and plan later steps with them; false: plan every step "
        "with the profile as measured (plans then depend on nothing measured: a run and its resumes split every "
        "global batch alike, bit for bit)",
    )
    warmup_steps: int = Field(default=3, ge=0, description="steps whose timings are ignored (compilation, allocation)")
    every: int = Field(default=2, ge=1, description="refit every this many steps")
    window: int = Field(default=256, ge=2, description="the most recent micro-batches per direction that are fitted")
    min_observations: int = Field(default=16, ge=2, description="micro-batches a direction needs before it is fitted")
    max_change: float = Field(default=1.25, gt=1.0, description="one refit moves a factor by at most this ratio")


class CheckpointConfig(_Section):
    """What a resume checks of a checkpoint (whose marker lists every file with its size and sha256)."""

    verify: Literal["hashes", "sizes"] = Field(
        default="hashes",
        description="'hashes': every file's size and contents (reads the checkpoint once, split over the ranks "
        "that share a disk); 'sizes': sizes only, for checkpoints too large to read at resume (a file damaged "
        "without changing its size then goes unnoticed). The sizes are always checked",
    )


class StartCheckConfig(_Section):
    """The start-up check of what a host built against the user's model (dyn_plugin.host.exactness)."""

    enabled: bool = Field(
        default=True,
        description="before the first step, run the model on a few tokens as the run will (packed or padded "
        "rows, sequence shards, pipeline stages) and against the model run on each document alone, and refuse "
        "(or plan padded rows, under layout 'auto') what differs, naming the piece; false skips it (a few "
        "forwards of a few tokens, logged with their time)",
    )


def with_password(url: str, password: str | None) -> str:
    """``url`` with its password replaced (None: removed), user, host and port kept."""
    parts = urlsplit(url)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname or ""
    auth = (parts.username or "") + (f":{password}" if password is not None else "")
    netloc = (f"{auth}@" if auth else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***``, fit for messages and logs."""
    return url if urlsplit(url).password is None else with_password(url, "***")


class StoreConfig(BaseModel):
    """Where plans are shared between planner processes and training ranks."""

    # hide_input_in_errors: a rejected url may carry a password; keep it out of error text.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, hide_input_in_errors=True)

    # the names of store/factory.py's BACKENDS (tests/test_config.py checks)
    backend: Literal["none", "tcp", "redis"] = Field(
        default="none",
        description="'none' (plan on every rank, share nothing), 'tcp' (torch TCPStore hosted by rank 0) or 'redis' (a Redis server at url)",
    )
    namespace: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$",
        description="prefix of every key (dynplugin/{namespace}-{run id}/...): the loader appends a run id rank 0 draws and broadcasts, so runs never share keys; without a process group, several ranks use it as it is (then it must be unique per run)",
    )
    host: str = Field(
        default="127.0.0.1", min_length=1, description="tcp: address rank 0 binds and other ranks connect to"
    )
    port: int | None = Field(
        default=None,
        ge=0,
        le=65535,
        description="tcp: port; unset = MASTER_PORT+1 if MASTER_PORT is set, else 29511; 0 = any free port (rank 0 only, read it from the store's .port)",
    )
    url: str | None = Field(default=None, description="redis: redis://host:port/db or rediss://host:port/db for TLS")
    password_env: str = Field(
        default="DYN_PLUGIN_REDIS_PASSWORD",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="redis: name of the env var holding the password (kept out of configs and logs); required on a non-loopback host",
    )
    secret_env: str = Field(
        default="DYN_PLUGIN_STORE_SECRET",
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description=f"name of the env var holding a shared secret (>= {MIN_SECRET_BYTES} chars) that HMAC-signs every value; required for any store on a non-loopback host",
    )
    timeout_s: float = Field(
        default=30.0, gt=0, description="longest any store operation (connect included) may take before failing"
    )
    retries: int = Field(
        default=3, ge=0, le=100, description="redis: retries of an operation after a connection error, within timeout_s"
    )
    retry_backoff_s: float = Field(
        default=0.1,
        ge=0,
        description="first pause between retries, doubling each time (redis); tcp clients poll rank 0 this often while it starts",
    )
    ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="redis: seconds a plan lives, so a dead run leaves nothing behind (tcp: the store dies with rank 0)",
    )
    max_payload_mb: float = Field(default=64.0, gt=0, description="largest value put or accepted, MiB")

    @model_validator(mode="after")
    def _fields_match_backend(self) -> "StoreConfig":
        # A url with the default backend 'none' would silently share nothing: refuse it.
        owners = {"url": "redis", "host": "tcp", "port": "tcp"}
        for name in sorted(self.model_fields_set & owners.keys()):
            if owners[name] != self.backend:
                raise ValueError(
                    f"'{name}' is only used by backend '{owners[name]}' but backend is '{self.backend}'; set backend='{owners[name]}' or drop '{name}'"
                )
        if self.backend == "redis":
            if not self.url:
                raise ValueError("backend 'redis' needs 'url', e.g. redis://host:6379/0 (rediss:// for TLS)")
            if not self.url.startswith(("redis://", "rediss://")):
                raise ValueError(
                    f"url must start with redis:// or rediss:// (TLS), not with scheme '{urlsplit(self.url).scheme}'"
                )
            try:
                parts = urlsplit(self.url)
                parts.port  # noqa: B018 -- parsing the port is the check
            except ValueError as exc:
                raise ValueError(f"url is not a valid redis URL ({exc}); expected redis://host:port/db") from None
            if not parts.hostname:
                raise ValueError("url has no host; expected redis://host:port/db")
        return self

    @property
    def max_payload_bytes(self) -> int:
        return int(self.max_payload_mb * 2**20)

    def __repr_args__(self) -> Iterator[tuple[str | None, Any]]:
        # repr() lands in logs: never with the url's password.
        for name, value in super().__repr_args__():
            yield name, mask_url(value) if name == "url" and value else value


class DynPluginConfig(_Section):
    cost_model: CostModelConfig = CostModelConfig()
    microbatching: MicrobatchingConfig = MicrobatchingConfig()
    pipeline: PipelineConfig = PipelineConfig()
    sequence_parallel: SequenceParallelConfig = SequenceParallelConfig()
    sharding: ShardingConfig = ShardingConfig()
    strategy: StrategyConfig = StrategyConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    loader: LoaderConfig = LoaderConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    calibration: CalibrationConfig = CalibrationConfig()
    start_check: StartCheckConfig = StartCheckConfig()

    @model_validator(mode="after")
    def _pipeline_fits_model(self) -> "DynPluginConfig":
        shape = self.cost_model.model
        if shape is not None:
            if self.pipeline.stages > shape.num_layers:
                raise ValueError(
                    f"pipeline.stages = {self.pipeline.stages} exceeds cost_model.model.num_layers = {shape.num_layers}"
                )
            lps = self.pipeline.layers_per_stage
            if lps is not None and sum(lps) != shape.num_layers:
                raise ValueError(
                    f"pipeline.layers_per_stage sums to {sum(lps)} but the model has {shape.num_layers} layers"
                )
        return self

    @model_validator(mode="after")
    def _strategy_runs_here(self) -> "DynPluginConfig":
        st = self.strategy
        if st.enabled and not self.sequence_parallel.enabled:
            raise ValueError(
                "strategy.enabled needs sequence_parallel.enabled = true: a strategy's pipelines run as "
                "its sequence-parallel groups"
            )
        if st.enabled and self.microbatching.method != "dynapipe":
            raise ValueError(
                f"strategy.enabled with microbatching.method = {self.microbatching.method!r}: strategies "
                "are planned by the plugin's planner; set method to 'dynapipe' or disable strategy"
            )
        if st.ilp_time_budget_ms is not None and self.store.backend == "none":
            raise ValueError(
                "strategy.ilp_time_budget_ms needs a store (store.backend 'tcp' or 'redis'): time-limited "
                "solves can differ between processes, so the planner processes solve each step once and "
                "share it; set store.backend, or drop ilp_time_budget_ms and use strategy.ilp_node_limit"
            )
        return self


@dataclass(frozen=True)
class LoadedConfig:
    """The validated plugin section and DeepSpeed's own keys, untouched, to hand on."""

    plugin: DynPluginConfig
    deepspeed: dict[str, Any]

    @property
    def zero_stage(self) -> int:
        return self.deepspeed.get("zero_optimization", {}).get("stage", 0)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise ConfigError(f"duplicate key(s) {', '.join(map(repr, dup))} in config; keep one of each")
    return dict(pairs)


def load_config(source: str | os.PathLike | Mapping[str, Any]) -> LoadedConfig:
    """Read a DeepSpeed JSON config (path or dict) and validate its ``"dyn_plugin"`` section."""
    if isinstance(source, Mapping):
        raw = dict(source)
        where = "config dict"
    elif isinstance(source, (str, os.PathLike)):
        where = str(source)
        try:
            raw = read_json(source, "config file", object_pairs_hook=_no_duplicates)
        except (ValueError, FileNotFoundError) as exc:
            raise ConfigError(str(exc)) from None
    else:
        raise ConfigError(f"config {source!r}: expected a path to a JSON file or a dict")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be a JSON object")
    for key in raw:
        if key != SECTION and difflib.get_close_matches(str(key).lower(), [SECTION], n=1, cutoff=SECTION_LOOKALIKE):
            # DeepSpeed ignores unknown top-level keys, so nothing else would ever mention it
            logger.warning(
                "%s: top-level key %r is read by neither DeepSpeed nor the plugin; did you mean '%s'? "
                "The plugin reads only '%s'",
                where,
                key,
                SECTION,
                SECTION,
            )
    section = raw.get(SECTION, {})
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where}: '{SECTION}' must be an object, got {type(section).__name__}")
    deepspeed = {k: v for k, v in raw.items() if k != SECTION}
    _check_zero_stage(deepspeed, where)
    try:
        plugin = DynPluginConfig.model_validate(section)
    except ValidationError as exc:
        problems = format_errors(exc, DynPluginConfig)
        # one problem reads on one line; several get a line each
        sep = " " if "\n" not in problems else "\n"
        raise ConfigError(
            f"invalid '{SECTION}' section in {where}:{sep}{problems.lstrip() if sep == ' ' else problems}"
        ) from None
    return LoadedConfig(plugin=plugin, deepspeed=deepspeed)


def _check_zero_stage(deepspeed: dict[str, Any], where: str) -> None:
    """DeepSpeed's ``zero_optimization.stage``, the one DeepSpeed key the plugin plans with."""
    zero = deepspeed.get("zero_optimization")
    zero = {} if zero is None else zero  # DeepSpeed reads null as absent
    if not isinstance(zero, Mapping):
        raise ConfigError(f'{where}: zero_optimization = {zero!r} must be an object, e.g. {{"stage": 1}}')
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in ZERO_STAGES:
        raise ConfigError(f"{where}: zero_optimization.stage = {stage!r}: expected one of 0, 1, 2, 3 (a JSON integer)")


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation like ``Foo | None`` or ``list[Foo]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType, list):
        for arg in typing.get_args(annotation):
            found = _submodel(arg)
            if found is not None:
                return found
    return None


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = root
    for part in loc:
        if model is None:
            return None
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        model = _submodel(field.annotation) if field else None
    return model


def format_errors(exc: ValidationError, root: type[BaseModel]) -> str:
    """One line per problem: full key path, the value given, what is allowed or the likely fix."""
    lines = []
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = ".".join([SECTION, *map(str, loc)])
        if err["type"] == "extra_forbidden":
            parent = _model_at(root, loc[:-1])
            valid = list(parent.model_fields) if parent else []
            close = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            lines.append(f"  {path}: unknown key{hint} (valid keys here: {', '.join(valid)})")
            continue
        msg = err["msg"].removeprefix("Value error, ")
        parent = _model_at(root, loc[:-1]) if loc else None
        field = parent.model_fields.get(str(loc[-1])) if parent and loc else None
        about = f" [{field.description}]" if field is not None and field.description else ""
        if err["type"] == "missing":
            lines.append(f"  {path}: required key is missing{about}")
        elif loc and not isinstance(err.get("input"), Mapping):
            fix = f"; {STRICT_HINTS[err['type']]}" if err["type"] in STRICT_HINTS else ""
            lines.append(f"  {path} = {err['input']!r}: {msg}{fix}{about}")
        else:
            lines.append(f"  {path or SECTION}: {msg}")
    return "\n".join(lines)
