"""The Hugging Face ``Trainer`` driving the plugin's plans under DeepSpeed
(``from deepspeed_ext.hf_trainer import DynPluginTrainer``).

People who fine-tune with the ``Trainer`` pass ``TrainingArguments(deepspeed="ds_config.json")``;
with a ``dyn_plugin`` section in that config, ``DynPluginTrainer`` (or any ``Trainer`` subclass with
``DynPluginTrainerMixin`` first among its bases) trains each global batch as the plugin planned it:

- **Data.** ``get_train_dataloader`` is the plugin's loader (``DynLoader``) over the training
  dataset's token sequences (``input_ids``; their lengths read once, or given as ``lengths``).
  One loader item is one global batch: this rank's planned micro-batches, their own number,
  sizes, layouts and recompute. The ``Trainer`` runs one optimizer step per item
  (``gradient_accumulation_steps`` 1: the plan sets the micro-batches), so epochs, ``max_steps``
  and the learning-rate schedule count global batches, as they do in the stock ``Trainer``.
- **Step.** ``training_step`` runs the host core's token-mean step (``host/token_mean.py``) on
  DeepSpeed's engine (``deepspeed_ext.step.deepspeed_host``: the plan sets the accumulation
  boundary per micro-batch; each micro-batch's summed token loss scaled by dp over the global
  batch's scored tokens; ``engine.step()`` after the last), so the update is that of the whole
  global batch's token-mean loss. The ``Trainer``'s own ``optimizer.step()``, scheduler step and
  clipping then do nothing more under DeepSpeed (Accelerate's wrappers leave them to the engine,
  which clips by ``gradient_clipping``, from ``max_grad_norm``); the logged loss is the global
  batch's token mean.
- **Start.** The ``Trainer``'s DeepSpeed config, once it has filled its ``"auto"`` values from
  the arguments (precision included), is the plugin's config: the support table
  (``host/support.py``, as the DeepSpeed host) and the start-up exactness check run on it.

- **Checkpoints.** Each of the Trainer's checkpoint folders gets the loader's position
  (``dyn_plugin_loader.json``), written whole by one rank after everything else; ``resume_from_checkpoint``
  restores it, so the run continues with the global batch after the saved one (the Trainer's own
  skipping of batches is turned off: ``ignore_data_skip``). A folder without it is refused;
  ``resume_from_checkpoint=True`` takes the newest folder that has it.
- **Evaluation.** ``evaluate()`` (and ``eval_strategy``, ``eval_on_start``) runs the evaluation
  set's planned global batches forward on the training engine and reports their token-mean loss
  (``eval_loss``), exact whatever the plan; predictions (``compute_metrics``, ``predict()``) are not
  planned and are refused by name.

With ``include_num_input_tokens_seen`` the Trainer's token count (and its tokens/s) is the global
batch's; each training log also has ``padding``.

What is not built here yet is refused by name at start: training without DeepSpeed
(plain DDP or FSDP through Accelerate), pipeline stages, sequence-parallel groups, gradient accumulation, encoder-decoder
models (their (input, target) pairs) and models with frozen weights (PEFT/LoRA: the cost model
would price weight gradients they do not have).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator, Sequence

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, EvalLoopOutput

from deepspeed_ext.engine import cost_model_for
from deepspeed_ext.step import deepspeed_host
from dyn_plugin.atomic import write_json_atomic
from dyn_plugin.config import ConfigError, LoadedConfig, load_config
from dyn_plugin.device import training_dtype
from dyn_plugin.host import support
from dyn_plugin.host.exactness import checked
from dyn_plugin.host.token_mean import summed_eval_loss, token_mean_step
from dyn_plugin.jsonfile import read_json
from dyn_plugin.layout import RankLayout
from dyn_plugin.models.hf import is_encoder_decoder
from dyn_plugin.runtime.loader import DynLoader, Step

logger = logging.getLogger(__name__)

LOADER_FILE = "dyn_plugin_loader.json"  # the loader's position, in each of the Trainer's checkpoint folders


class DynPluginTrainerMixin:
    """What makes a ``Trainer`` (or a subclass: TRL's ``SFTTrainer``) train on the plugin's plans.
    Put it first among the bases; ``lengths``: the training sequences' lengths, if known (else read
    from the dataset's ``input_ids``)."""

    def __init__(self, *args: Any, lengths: Sequence[int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dyn_lengths = lengths
        self._dyn_loader: DynLoader | None = None
        self._dyn_checked: LoadedConfig | None = None  # the config once the model passed the start-up checks
        # this rank's token slots and real tokens since the last log (its padding)
        self._dyn_counts = torch.zeros(2, dtype=torch.float64)
        self._dyn_config = self._plugin_config()

    # -- start ---------------------------------------------------------------------------------
    def _plugin_config(self) -> LoadedConfig:
        args = self.args
        ds = getattr(args, "hf_deepspeed_config", None)
        if ds is None:
            raise ConfigError(
                "DynPluginTrainer trains through DeepSpeed's engine: pass TrainingArguments(deepspeed=...) naming "
                "a DeepSpeed config with a 'dyn_plugin' section (training without DeepSpeed, or with FSDP through "
                "Accelerate, is not built for the Trainer yet)"
            )
        if self.compute_metrics is not None:
            raise ConfigError(
                "compute_metrics: DynPluginTrainer evaluates through planned batches and reports their token-mean "
                "loss (eval_loss), not the model's predictions; drop compute_metrics, or compute such metrics with "
                "the stock Trainer on the saved model"
            )
        if args.gradient_accumulation_steps != 1:
            raise ConfigError(
                f"TrainingArguments.gradient_accumulation_steps = {args.gradient_accumulation_steps}: the plugin's "
                "plan sets each global batch's micro-batches (dyn_plugin.microbatching.global_tokens); set it to 1"
            )
        config = dict(ds.config)  # the Trainer's "auto" values filled in
        if "dyn_plugin" not in config:
            raise ConfigError(
                "the DeepSpeed config passed to TrainingArguments(deepspeed=...) has no 'dyn_plugin' section; add one "
                "(or train with the stock Trainer)"
            )
        cfg = load_config(config)
        if cfg.plugin.pipeline.stages > 1:
            raise ConfigError(
                f"dyn_plugin.pipeline.stages = {cfg.plugin.pipeline.stages} under the Trainer: its DeepSpeed engine "
                "trains data-parallel; train pipelines with deepspeed_ext.initialize, or set pipeline.stages to 1"
            )
        if cfg.plugin.sequence_parallel.enabled:
            raise ConfigError(
                "dyn_plugin.sequence_parallel.enabled under the Trainer: its DeepSpeed engine has no sequence-parallel "
                "groups (deepspeed_ext.initialize builds them); train with deepspeed_ext.initialize, or set it to false"
            )
        deepspeed = {k: v for k, v in cfg.deepspeed.items() if k != "dyn_plugin"}
        cfg = LoadedConfig(cfg.plugin, deepspeed)
        support.check("DeepSpeed", support.Run(cfg.plugin, cfg.zero_stage, False, training_dtype(deepspeed)))
        return cfg

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        if resume_from_checkpoint is True:
            resume_from_checkpoint = self._newest_whole_checkpoint()
        if resume_from_checkpoint:
            # the loader resumes at its saved position (_load_optimizer_and_scheduler): the Trainer must
            # not skip batches of it as it skips a sampler's
            self.args.ignore_data_skip = True
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _newest_whole_checkpoint(self) -> str:
        """``resume_from_checkpoint=True``: the newest checkpoint folder of ``output_dir`` that was
        saved whole (it holds the loader's position, written last); newer ones were interrupted."""
        root = self.args.output_dir
        steps = sorted(
            (int(name.rsplit("-", 1)[1]), name)
            for name in (os.listdir(root) if os.path.isdir(root) else [])
            if name.startswith(f"{PREFIX_CHECKPOINT_DIR}-") and name.rsplit("-", 1)[1].isdigit()
        )
        for _, name in reversed(steps):
            if os.path.exists(os.path.join(root, name, LOADER_FILE)):
                return os.path.join(root, name)
            logger.warning("%s was not saved whole (no %s): resuming from an earlier checkpoint", name, LOADER_FILE)
        raise ValueError(f"resume_from_checkpoint=True: no checkpoint saved whole in {root}")

    # -- checkpoints ---------------------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, then the loader's position beside it, written whole by one rank
        last: a checkpoint folder without it was interrupted while saving, and resuming from it is refused."""
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            folder = os.path.join(
                self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            )
            write_json_atomic(os.path.join(folder, LOADER_FILE), self.get_train_dataloader().state_dict())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The Trainer's restore (every backend runs it before the first step), then the loader's position."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, LOADER_FILE)
        if not os.path.exists(path):
            raise ConfigError(
                f"{checkpoint} has no {LOADER_FILE}: the save was interrupted before the loader's position was "
                "written (or the Trainer that saved it was not DynPluginTrainer); resume from an earlier checkpoint"
            )
        loader = self.get_train_dataloader()
        loader.load_state_dict(read_json(path, "the loader's position"))
        logger.info("dyn_plugin resumes the loader at epoch %d, step %d", loader.epoch, loader.step)

    # -- data ----------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DynLoader:
        """The plugin's loader over the training dataset, built once (its position carries over epochs)."""
        if self._dyn_loader is None:
            self._dyn_loader = self._build_loader()
        return self._dyn_loader

    def _build_loader(self) -> DynLoader:
        dataset = self.train_dataset
        if dataset is None:
            raise ValueError("DynPluginTrainer needs a train_dataset of token sequences (items with 'input_ids')")
        lengths = self._dyn_lengths
        if lengths is None:
            lengths = [len(item["input_ids"]) for item in dataset]
        return self._loader_over(dataset, lengths)

    def _loader_over(self, dataset: Sequence[Any], lengths: Sequence[int]) -> DynLoader:
        """A loader of the plugin's planned global batches over ``dataset``, for this rank."""
        import torch.distributed as dist

        model = self.accelerator.unwrap_model(self.model)
        cfg = self._checked_config(model)
        world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
        layout = RankLayout.from_config(world, cfg.plugin)
        _, column, _ = layout.coords(rank)
        return DynLoader(
            dataset,
            lengths=lengths,
            config=cfg,
            cost_model=cost_model_for(cfg, model),
            layout=layout,
            stage=0,
            column=column,
            seed=self.args.seed,
        )

    def _checked_config(self, model: torch.nn.Module) -> LoadedConfig:
        """The plugin's config once the model has passed the checks every plan relies on (once a run)."""
        if self._dyn_checked is not None:
            return self._dyn_checked
        if is_encoder_decoder(model):
            raise ConfigError(
                f"{type(model).__name__} is an encoder-decoder: it trains on (input, target) pairs, which DynPluginTrainer "
                "does not plan (it reads one sequence per item); train it with deepspeed_ext.initialize and [N, 2] lengths"
            )
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
        if frozen:
            # the cost model prices every weight's gradient and optimizer state: a model with frozen
            # weights (PEFT's LoRA) would be planned for work and memory it does not have
            raise ConfigError(
                f"{len(frozen)} frozen parameters ({frozen[0]}, ...): DynPluginTrainer plans models whose weights all "
                "train; frozen weights (PEFT/LoRA) are not priced yet (their weight gradients and optimizer states "
                "do not exist); train the full model, or use the stock Trainer for adapters"
            )
        # counted once, before DeepSpeed partitions them (ZeRO-3 leaves each rank a shard: ds_numel is the whole)
        self._dyn_parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        self._dyn_checked = checked(model, self._dyn_config)
        return self._dyn_checked

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, None]:
        """One global batch per optimizer step; its token count is the plan's (``Step.scored_tokens``).
        After an epoch's last, its iterator is run to its end: the loader's end-of-epoch checks run
        then, and its next iteration starts the next epoch (a generator left before its end would not)."""
        steps = [step for _, step in zip(range(num_batches), epoch_iterator)]
        if len(self.get_train_dataloader()) == 0:
            next(epoch_iterator, None)
        return steps, None

    # -- evaluation ----------------------------------------------------------------------------
    def get_eval_dataloader(self, eval_dataset: Any = None) -> DynLoader:
        """The plugin's loader over an evaluation set (``eval_dataset``, or the one so named, or
        the Trainer's): its global batches planned as the training's are, one epoch of them."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("evaluation needs an eval_dataset of token sequences (items with 'input_ids')")
        return self._loader_over(dataset, [len(item["input_ids"]) for item in dataset])

    def evaluation_loop(
        self,
        dataloader: DynLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """The token-mean loss of the evaluation set (``{prefix}_loss``): each planned global batch's
        micro-batches forward on DeepSpeed's engine, their summed token losses added over the steps
        and the ranks, divided by the tokens scored. The ``Trainer``'s ``evaluate()`` around it
        logs it, adds its speed figures and runs the callbacks. Predictions (``predict()``,
        ``prediction_loss_only=False``) are not planned: refused by name."""
        import torch.distributed as dist

        if not (self.args.prediction_loss_only if prediction_loss_only is None else prediction_loss_only):
            raise ConfigError(
                f"{description}: DynPluginTrainer evaluates the token-mean loss through planned batches and keeps no "
                "predictions; set prediction_loss_only=True, or predict with the stock Trainer on the saved model"
            )
        if self.deepspeed is None:
            # the stock Trainer builds an inference engine here (ZeRO-3 only), which the training
            # engine built later does not replace cleanly; the plugin evaluates on the training engine
            raise ConfigError(
                "evaluate() before train(): DynPluginTrainer evaluates on DeepSpeed's training engine, which train() "
                "builds; pass TrainingArguments(eval_on_start=True) to evaluate before the first step"
            )
        engine = self.model_wrapped
        engine.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.args.device)
        scored = 0
        for step in dataloader:  # one epoch: every sample once
            total += summed_eval_loss(step, deepspeed_host(engine, step))
            scored += step.scored_tokens
        if dist.is_initialized():
            dist.all_reduce(total)
        dataloader.close()
        metrics = {f"{metric_key_prefix}_loss": float(total) / scored}
        return EvalLoopOutput(predictions=None, label_ids=None, metrics=metrics, num_samples=len(dataloader.dataset))

    # -- step ----------------------------------------------------------------------------------
    def training_step(self, model: torch.nn.Module, inputs: Step, num_items_in_batch: Any = None) -> torch.Tensor:
        """This rank's micro-batches of one planned global batch, and DeepSpeed's optimizer step;
        returns the global batch's token-mean loss (the same on every rank)."""
        import torch.distributed as dist

        engine = self.model_wrapped
        engine.train()
        dp = dist.get_world_size() if dist.is_initialized() else 1
        loss = token_mean_step(inputs, deepspeed_host(engine, inputs), dp)
        return torch.tensor(loss, device=self.args.device)

    def _track_num_input_tokens(self, inputs: Step) -> None:
        """The Trainer's ``num_input_tokens_seen`` (and with it its tokens/s) for a planned step: the
        global batch's token slots ("all") or real tokens ("non_padding"), summed over the ranks.
        The same counts, kept until the next log, give its ``padding``."""
        slots, real = _token_counts(inputs)
        self._dyn_counts += torch.tensor([slots, real], dtype=torch.float64)
        mode = self.args.include_num_input_tokens_seen
        if mode == "no":
            return
        tokens = torch.tensor(real if mode == "non_padding" else slots, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += int(self.accelerator.gather(tokens).sum())

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """The Trainer's log; a training log (every rank writes it at the same step) also gets
        ``padding``: the share of the token slots trained since the last one that were padding."""
        import torch.distributed as dist

        if "loss" in logs and self._dyn_counts[0] > 0:
            counts = self._dyn_counts.to(self.args.device)
            if dist.is_initialized():
                dist.all_reduce(counts)
            logs["padding"] = round(1.0 - float(counts[1] / counts[0]), 4)
            self._dyn_counts.zero_()
        super().log(logs, start_time)

    def floating_point_ops(self, inputs: Step) -> int:
        """Model FLOPs of this rank's real tokens (6 per parameter and token, as the stock ``Trainer``
        counts them)."""
        tokens = sum(sum(desc.seq_lens) for desc in inputs.loaded)
        return 6 * tokens * self._dyn_parameters


def _token_counts(step: Step) -> tuple[int, int]:
    """This rank's token slots and real tokens in ``step``; summed over the ranks, the global batch's
    (each rank of a sequence-parallel group holds its own shard's slots; the real tokens of a row are
    counted by its first shard's rank)."""
    slots = sum(int(m["input_ids"].numel()) for m in step.micro_batches)
    real = sum(sum(d.seq_lens) for d, (_, _, index) in zip(step.loaded, step.shards) if index == 0)
    return slots, real


class DynPluginTrainer(DynPluginTrainerMixin, Trainer):
    """``transformers.Trainer`` on the plugin's plans (``DynPluginTrainerMixin``)."""
