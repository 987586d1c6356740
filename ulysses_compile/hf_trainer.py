"""Hugging Face ``Trainer`` with the model sequence-parallel (and ZeRO-partitioned) over the ranks.

Under ``torchrun``, ``Trainer`` (through accelerate) treats every rank as a data-parallel replica: it
wraps the model in DDP and gives each rank its own batches. :class:`SequenceParallelTrainer` keeps the
rest of ``Trainer`` and changes three things:

- the model is ``parallelize``-d (this package's ZeRO stage ``zero_stage``, default 0) and compiled
  with the ulysses backend, and ``Trainer`` calls that compiled model, prepared by accelerate as for
  evaluation (mixed-precision autocast, no DDP), instead of wrapping it in DDP, which would neither hold
  a large model's AdamW state nor accept its DTensor parameters;
- each rank's batches (as accelerate shards them) go through :class:`SequenceParallelLoader`, so the
  whole sequence group trains on each rank's batch in turn, and ``gradient_accumulation_steps`` is
  multiplied by the group's size: an optimizer step covers the same batches as under DDP, and P ranks
  train as one process with ``gradient_accumulation_steps`` x P on the same data (its batches in the
  same order);
- ``save_model`` gathers the parameters and the main process writes a ``from_pretrained`` checkpoint.

Evaluation and prediction run sequence-parallel through the same loader: every rank of a group
computes every micro-batch of the group, so what ``Trainer`` gathers across ranks holds each one once
per sequence rank (a mean, such as the evaluation loss, is unchanged). Trainer's truncation of the last
uneven batch would cut the wrong copies, so the evaluation set must split into whole batches on every
rank. Resuming a Trainer checkpoint would skip micro-batches as if they were the loader's batches and
restore a ZeRO optimizer from the main process's shard alone, so checkpoints are models only
(``save_only_model=True``, or ``save_strategy="no"``); ``torch.distributed.checkpoint`` saves and
reshards the whole state (see ``examples/train.py``).
"""

from __future__ import annotations

import dataclasses
import inspect

from transformers import Trainer, TrainingArguments

from ulysses_compile.core.errors import OptionsError
from ulysses_compile.data import SequenceParallelLoader
from ulysses_compile.zero import parallelize, save_pretrained

_TRAINER_PARAMETERS = frozenset(inspect.signature(Trainer.__init__).parameters)


class SequenceParallelTrainer(Trainer):
    """``Trainer(model, args, ...)`` plus ``zero_stage`` and the ulysses options (``mesh=``, ``group=``,
    ``compiler=``, ...), passed to :func:`parallelize`."""

    def __init__(self, model, args: TrainingArguments, *, zero_stage: int = 0, param_dtype=None, reduce_dtype=None,
                 **kwargs):
        options = {key: kwargs.pop(key) for key in list(kwargs) if key not in _TRAINER_PARAMETERS}
        if args.save_strategy != "no" and not args.save_only_model:
            raise OptionsError(
                "SequenceParallelTrainer saves models, not checkpoints that resume (resuming would skip "
                "micro-batches as the loader's batches, and a ZeRO optimizer state is sharded while Trainer "
                "saves the main process's part); pass TrainingArguments(save_only_model=True) or "
                "save_strategy='no', and torch.distributed.checkpoint for resumable state (examples/train.py)"
            )
        self.compiled_model = parallelize(model, zero_stage=zero_stage, param_dtype=param_dtype,
                                          reduce_dtype=reduce_dtype, **options)
        self._sequence_options = {key: options[key] for key in ("group", "mesh") if key in options}
        group_size = SequenceParallelLoader([], **self._sequence_options).accumulation_steps
        args = dataclasses.replace(args, gradient_accumulation_steps=args.gradient_accumulation_steps * group_size)
        super().__init__(model=model, args=args, **kwargs)

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if not getattr(self.compiled_model, "_is_accelerate_prepared", False):
            self.accelerator.prepare_model(self.compiled_model, device_placement=False, evaluation_mode=True)
        return self.compiled_model

    def get_train_dataloader(self):
        return SequenceParallelLoader(super().get_train_dataloader(), **self._sequence_options)

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        self._check_whole_batches(loader.dataset, "evaluation")
        return SequenceParallelLoader(loader, **self._sequence_options)

    def get_test_dataloader(self, test_dataset):
        self._check_whole_batches(test_dataset, "test")
        return SequenceParallelLoader(super().get_test_dataloader(test_dataset), **self._sequence_options)

    def _check_whole_batches(self, dataset, kind: str) -> None:
        per_draw = self.args.eval_batch_size * self.args.world_size
        if hasattr(dataset, "__len__") and len(dataset) % per_draw:
            raise OptionsError(
                f"SequenceParallelTrainer: the {kind} set has {len(dataset)} samples, not a multiple of "
                f"{per_draw} (eval batch size {self.args.eval_batch_size} x {self.args.world_size} ranks); Trainer "
                f"would truncate the last uneven batch on the wrong copies. Trim or pad it to a multiple"
            )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        output_dir = output_dir or self.args.output_dir
        save_pretrained(self.model, output_dir)
        if self.processing_class is not None and self.args.should_save:
            self.processing_class.save_pretrained(output_dir)
