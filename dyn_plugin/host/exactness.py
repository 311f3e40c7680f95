"""Exact by construction, checked at start: before the first step a host runs what it built against
the user's model on a few tokens, in the model's own dtype, and refuses what differs by name: the
family, the piece and how much.

- **Packed rows**: the model on one packed row of a few documents against the same model on each
  document alone. A token mixer other than attention (linear attention, a short convolution, a
  state-space layer) that reads across a document boundary shows here, whatever its name.
- **Sequence shards**: one document cut in two, each half run alone except for attention, which
  sees the earlier half's keys and values (``varlen_attention.carrying``), as the plugin's
  Ulysses and ring attention give them; against the document whole. A mixer that needs the tokens
  of another shard shows here, even one that keeps to its document.
- **Pipeline stages** (``stages_difference``): the stages a host cut, run one after another on one
  process, against the unsplit forward: whatever a family's forward does around its layers that the
  stages do not (an embedding multiplier, a logit scale) shows at the piece it belongs to.

Where outputs differ, the piece named is the first module, in the order the forward finishes
them, whose output differs while its input does not; where its input differs too, the difference
arose in its parent's own code between its children, and the parent is named. Differences are
per token, relative to the token's largest value in the model's own run, against ``TOLERANCE`` of
the dtype (a leaking mixer measures 1e-1 on random weights; rounding 1e-7 in fp32, 0 on CPU in half).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..config import LoadedConfig
from ..models.varlen_attention import NAME as KERNEL
from ..models.varlen_attention import carrying
from ..runtime.collate import collate

logger = logging.getLogger(__name__)

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}
PROBE_LENGTHS = (5, 9, 6)  # a packed row's documents: a few tokens each
SHARDED_LENGTH = 12  # one document, in two shards


class ExactnessError(ValueError):
    """What a host built computes otherwise than the user's model: refused before training."""


@dataclass(frozen=True)
class Difference:
    check: str  # "packed rows", "sequence shards", "pipeline stages"
    piece: str  # where the outputs first differ
    relative: float  # the largest difference of a token, relative to its largest value
    tolerance: float

    def __str__(self) -> str:
        return f"{self.piece} differs by {self.relative:.2g} on {self.check}"


def family(model: nn.Module) -> str:
    """The model's family as a refusal names it: its model_type and class."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    return f"{kind} ({type(model).__name__})" if kind else type(model).__name__


def model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def tolerance_of(model: nn.Module) -> float:
    return TOLERANCE.get(model_dtype(model), 1e-4)


def probe_tokens(model: nn.Module, lengths: tuple[int, ...], seed: int = 0) -> list[torch.Tensor]:
    """Token ids of a few documents, the same on every rank and every run."""
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, max(vocab, 2), (n,), generator=g) for n in lengths]


def _tensor(x: Any) -> torch.Tensor | None:
    """The tensor a module's input or output stands for: itself, or the first of a tuple or model output."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (tuple, list)):
        return next((t for t in x if isinstance(t, torch.Tensor)), None)
    return None


class _Record:
    """Every module's input and output of the forwards run inside it (the first call per forward),
    each along the tokens of that forward; ``order``: modules as the first forward finished them."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values: dict[str, list[list[torch.Tensor | None]]] = {}
        self.order: list[str] = []
        self._seen: set[str] = set()
        self._tokens = 0

    def _hook(self, name: str):
        def hook(module, args, kwargs, output) -> None:
            if name in self._seen:
                return  # a module called twice in one forward (a shared rotary table): its first call
            self._seen.add(name)
            if name not in self.values:
                self.order.append(name)
                self.values[name] = [[], []]
            given = _tensor(args) if args else _tensor(kwargs.get("hidden_states"))
            for side, value in enumerate((given, _tensor(output))):
                keep = value is not None and value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == self._tokens
                self.values[name][side].append(value.detach().float().clone() if keep else None)

        return hook

    @contextlib.contextmanager
    def forward(self, tokens: int) -> Iterator[None]:
        self._seen, self._tokens = set(), tokens
        handles = [m.register_forward_hook(self._hook(n), with_kwargs=True) for n, m in self.model.named_modules()]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def joined(self, name: str, side: int) -> torch.Tensor | None:
        """The module's ``side`` (0 input, 1 output) over every forward, along the tokens."""
        parts = self.values.get(name, [[], []])[side]
        if not parts or any(p is None for p in parts):
            return None
        return torch.cat(parts, dim=1)


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest per-token difference of [1, tokens, ...] tensors, relative to each token's largest
    entry in ``want`` (not below a thousandth of the largest anywhere, for tokens near zero)."""
    diff = (got - want).abs().flatten(2).amax(-1) if got.dim() > 2 else (got - want).abs()
    scale = want.abs().flatten(2).amax(-1) if want.dim() > 2 else want.abs()
    floor = float(scale.max()) * 1e-3 or 1.0
    return float((diff / scale.clamp_min(floor)).max())


def _first_difference(ours: _Record, theirs: _Record, tolerance: float) -> tuple[str, float]:
    """The piece where ``ours`` (the plugin's way) first departs from ``theirs`` (the model's own)."""
    for name in ours.order:
        out_ours, out_theirs = ours.joined(name, 1), theirs.joined(name, 1)
        if out_ours is None or out_theirs is None or out_ours.shape != out_theirs.shape:
            continue
        worst = relative(out_ours, out_theirs)
        if worst <= tolerance:
            continue
        in_ours, in_theirs = ours.joined(name, 0), theirs.joined(name, 0)
        same_input = (
            in_ours is not None
            and in_theirs is not None
            and in_ours.shape == in_theirs.shape
            and relative(in_ours, in_theirs) <= tolerance
        )
        owner = name if same_input or not name else name.rpartition(".")[0]
        return _named(ours.model, owner), worst
    return "the model's own forward, between its modules", float("nan")


def _named(model: nn.Module, name: str) -> str:
    if not name:
        return f"the forward of {type(model).__name__} itself"
    return f"{name} ({type(model.get_submodule(name)).__name__})"


def model_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if k != "labels"}


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """No dropout, no gradients, and the model's training mode as it was after."""
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def logits_of(output: Any) -> torch.Tensor:
    return (output.logits if hasattr(output, "logits") else _tensor(output)).float()


class Probe:
    """The probe documents of one model and the model's own logits on each alone, computed once and
    shared by the checks (each forward reads every weight: at 1B parameters on a CPU, the cost)."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.docs = model, probe_tokens(model, PROBE_LENGTHS)
        self.device, self.tolerance = _device(model), tolerance_of(model)
        self._alone: list[torch.Tensor] | None = None

    def row(self, ids: list[torch.Tensor], layout: str, record: _Record | None = None) -> torch.Tensor:
        """The logits of ``ids`` in one micro-batch as the loader builds it: one packed row, or one
        right-padded row each (three tokens of padding after the longest)."""
        lengths = [len(d) for d in ids]
        shape = [1, sum(lengths)] if layout == "packed" else [len(ids), max(lengths) + 3]
        batch = collate(list(range(len(ids))), lengths, layout, shape, lambda i: {"input_ids": ids[i]})
        batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        with record.forward(shape[1]) if record is not None else contextlib.nullcontext():
            return logits_of(self.model(**model_inputs(batch), use_cache=False))

    def alone(self, record: _Record | None = None) -> list[torch.Tensor]:
        """[1, length, vocabulary] logits of each document alone (kept, when no record is asked for)."""
        if record is None and self._alone is not None:
            return self._alone
        out = [self.row([d], "packed", record) for d in self.docs]
        if record is None:
            self._alone = out
        return out


def packed_difference(model: nn.Module, probe: Probe | None = None) -> Difference | None:
    """The model on one packed row of ``PROBE_LENGTHS`` documents (as the loader builds it) against
    the model on each document alone; None when they agree."""
    probe = probe or Probe(model)
    with evaluating(model):
        worst = relative(probe.row(probe.docs, "packed"), torch.cat(probe.alone(), dim=1))
        if worst <= probe.tolerance:
            return None
        ours, theirs = _Record(model), _Record(model)  # again, recorded, to find the piece
        probe.row(probe.docs, "packed", ours)
        probe.alone(theirs)
    piece, _ = _first_difference(ours, theirs, probe.tolerance)
    return Difference("packed rows", piece, worst, probe.tolerance)


def padded_difference(model: nn.Module, probe: Probe | None = None) -> Difference | None:
    """The documents in right-padded rows (as the loader builds them) against each alone; None when
    they agree. A causal model agrees; one whose mixers read ahead sees the padding."""
    probe = probe or Probe(model)
    with evaluating(model):
        rows = probe.row(probe.docs, "padded")
        alone = probe.alone()
    worst = max(relative(rows[r : r + 1, : len(d)], alone[r]) for r, d in enumerate(probe.docs))
    if worst <= probe.tolerance:
        return None
    return Difference("padded rows", family(model), worst, probe.tolerance)


def sharded_difference(model: nn.Module, probe: Probe | None = None) -> Difference | None:
    """One document of ``SHARDED_LENGTH`` tokens in two shards, each run alone but for attention,
    which carries the first shard's keys and values into the second (as sequence parallelism's
    attention gives them), against the document whole; None when they agree."""
    (doc,) = probe_tokens(model, (SHARDED_LENGTH,), seed=1)
    device, tolerance, half = _device(model), tolerance_of(model), SHARDED_LENGTH // 2

    def run(lo: int, hi: int, record: _Record | None) -> torch.Tensor:
        ids = doc[lo:hi].unsqueeze(0).to(device)
        positions = torch.arange(lo, hi, device=device).unsqueeze(0)
        with record.forward(hi - lo) if record is not None else contextlib.nullcontext():
            return logits_of(model(input_ids=ids, position_ids=positions, use_cache=False))

    def both(ours: _Record | None, theirs: _Record | None) -> tuple[torch.Tensor, torch.Tensor]:
        with carrying():
            shards = torch.cat([run(0, half, ours), run(half, SHARDED_LENGTH, ours)], dim=1)
        return shards, run(0, SHARDED_LENGTH, theirs)

    with evaluating(model):
        worst = relative(*both(None, None))
        if worst <= tolerance:
            return None
        ours, theirs = _Record(model), _Record(model)
        both(ours, theirs)
    piece, _ = _first_difference(ours, theirs, tolerance)
    return Difference("sequence shards", piece, worst, tolerance)


def timed(check: Callable[..., Difference | None], *args: Any) -> tuple[Difference | None, float]:
    """The check's finding and its time in ms."""
    start = time.perf_counter()
    found = check(*args)
    return found, (time.perf_counter() - start) * 1e3


def _checkable(model: nn.Module) -> str | None:
    """Why the model cannot be probed here (None: it can)."""
    if not hasattr(model, "get_input_embeddings") or getattr(
        getattr(model, "config", None), "is_encoder_decoder", False
    ):
        return "it is not a transformers causal LM"
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        return "its parameters were partitioned as it was built (deepspeed.zero.Init), so no rank holds the model"
    return None


def _agreed(found: list[Difference]) -> list[Difference]:
    """Every rank's findings, the same on every rank (the checks are deterministic; a rank that
    found what another did not still makes every rank refuse)."""
    from .exchange import gather

    seen: dict[str, Difference] = {}
    for mine in gather(found):
        for d in mine:
            seen.setdefault(d.check, d)
    return list(seen.values())


def check_at_start(model: nn.Module, cfg: LoadedConfig) -> LoadedConfig:
    """Run the checks the config's plans need on ``model`` (every rank, before training) and return
    the config to plan with: under ``microbatching.layout`` 'auto', padded rows where packed rows
    differ; refused (``ExactnessError``, on every rank) where the config asks for what differs."""
    plugin = cfg.plugin
    if not plugin.start_check.enabled:
        logger.info("start-up check skipped (start_check.enabled is false)")
        return cfg
    why = _checkable(model)
    if why is not None:
        logger.warning("start-up check of %s skipped: %s", type(model).__name__, why)
        return cfg
    mb, sp = plugin.microbatching, plugin.sequence_parallel
    packed = mb.may_pack or sp.enabled
    checks = [packed_difference] if packed else []
    if mb.layout != "packed":
        checks.append(padded_difference)
    if sp.enabled:
        checks.append(sharded_difference)
    found, spent, probe = [], {}, Probe(model)
    for check in checks:
        difference, spent[check.__name__] = timed(check, model, probe)
        if difference is not None:
            found.append(difference)
    found = _agreed(found)
    name = family(model)
    logger.info(
        "start-up check of %s: %s (%s)",
        name,
        "; ".join(str(d) for d in found) or "exact",
        ", ".join(f"{k.removesuffix('_difference')} {v:.0f} ms" for k, v in spent.items()),
    )
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    sinks = any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())
    if sinks and attention == KERNEL and torch.cuda.is_available():
        raise ExactnessError(
            f"{name}: attention sinks (GPT-OSS's s_aux) on CUDA: the plugin's kernel would compute them only "
            "written out per document, which the plan does not price (torch's flash varlen kernel has none); train "
            "this model with its own attention implementation and padded rows (microbatching.layout 'padded')"
        )
    packed_found = next((d for d in found if d.check == "packed rows"), None)
    refusals = []
    if packed_found is not None and (mb.layout == "packed" or mb.method.startswith("packing")):
        refusals.append(
            f"{packed_found}; a packed row's documents would read each other there (the model alone on each "
            "document does not): set microbatching.layout to 'padded' or 'auto' (each document alone in its row)"
        )
    for d in found:
        if d.check == "padded rows":
            refusals.append(f"{d}; a padded row's padding would reach its document: train this model packed")
        elif sp.enabled:
            refusals.append(
                f"{d}; sequence parallelism splits documents over ranks and carries only attention across them: "
                "set sequence_parallel.enabled to false"
            )
    if refusals:
        tolerance = max(d.tolerance for d in found)
        raise ExactnessError(
            f"{name}: "
            + "; ".join(dict.fromkeys(refusals))
            + f" (the start-up check against the model's own forward, tolerance {tolerance:g} per token; "
            "start_check.enabled)"
        )
    if packed_found is not None and mb.layout == "auto":
        logger.warning("%s: %s; planning padded rows (microbatching.layout 'auto')", name, packed_found)
        return LoadedConfig(
            plugin.model_copy(update={"microbatching": mb.model_copy(update={"layout": "padded"})}), cfg.deepspeed
        )
    return cfg


def checked(model: nn.Module, cfg: LoadedConfig) -> LoadedConfig:
    """What every host does with the user's model before it plans: its attention switched to the
    plugin's kernel where the plans call for it and the family allows, the layouts its attention runs
    at the planned cost, then this check (an encoder-decoder's pairs are planned as T5 runs them)."""
    from .attention import priced_layouts, use_document_kernel

    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return priced_layouts(model, cfg)
    use_document_kernel(model, cfg)
    return check_at_start(model, priced_layouts(model, cfg))
