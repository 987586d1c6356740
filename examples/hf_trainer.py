"""Hugging Face ``Trainer`` under torchrun, sequence-parallel: swap ``Trainer`` for
``SequenceParallelTrainer`` and keep the rest of the script.

    torchrun --nproc-per-node 2 examples/hf_trainer.py                   # ZeRO-3 + sequence parallelism
    torchrun --nproc-per-node 4 examples/hf_trainer.py --data-parallel 2 # 2 replicas x 2 sequence ranks
    python examples/hf_trainer.py --plain --gradient-accumulation-steps 2  # the same training, one process

As under DDP, accelerate gives each rank its own batches; an optimizer step covers every rank's, so P
ranks train as one process with ``gradient_accumulation_steps`` x P on the same data. The model and data
are ``examples/train.py``'s (a transformers Llama with gradient checkpointing, learning Python's
source bytes). Writes ``OUT/log.json`` (Trainer's log history) and the trained model (``save_model``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import Trainer, TrainingArguments

from train import PythonSourceBytes, build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=2, help="per rank, as Trainer's per_device_train_batch_size")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--zero-stage", type=int, default=3)
    parser.add_argument("--data-parallel", type=int, default=1, help="replicas; the rest of the ranks share sequences")
    parser.add_argument("--compiler", default="inductor", choices=("inductor", "aot_eager"))
    parser.add_argument("--train-samples", type=int, help="train on the first N windows (several epochs)")
    parser.add_argument("--bf16", action="store_true", help="mixed precision (autocast to bfloat16)")
    parser.add_argument("--dump-dir", help="write each rank's rewritten graphs and report here")
    parser.add_argument("--plain", action="store_true", help="transformers' own Trainer, without ulysses_compile")
    parser.add_argument("--out", default="hf_trainer_out")
    args = parser.parse_args()

    training = TrainingArguments(
        output_dir=args.out, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=3e-3, weight_decay=0.1, warmup_steps=2, lr_scheduler_type="cosine", max_grad_norm=0.5,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, dataloader_drop_last=True,
        bf16=args.bf16,
    )
    model = build_model(args)
    dataset = PythonSourceBytes(args.seq_len)
    evaluation = [dataset[index] for index in range(8)]
    if args.train_samples:
        dataset = torch.utils.data.Subset(dataset, range(args.train_samples))
    if args.plain:
        trainer = Trainer(model=model, args=training, train_dataset=dataset, eval_dataset=evaluation)
    else:
        from ulysses_compile.hf_trainer import SequenceParallelTrainer

        mesh = None
        if args.data_parallel > 1:
            from torch.distributed.device_mesh import init_device_mesh

            world = int(os.environ["WORLD_SIZE"])
            mesh = init_device_mesh("cpu", (args.data_parallel, world // args.data_parallel),
                                    mesh_dim_names=("dp", "sp"))
        trainer = SequenceParallelTrainer(model=model, args=training, train_dataset=dataset, eval_dataset=evaluation,
                                          zero_stage=args.zero_stage, mesh=mesh, compiler=args.compiler,
                                          dump_dir=args.dump_dir)
    trainer.train()
    metrics = trainer.evaluate()
    predicted = trainer.predict(evaluation)
    trainer.save_model()
    if trainer.args.process_index == 0:
        history = [entry for entry in trainer.state.log_history if "loss" in entry]
        log = {"train": history, "eval_loss": metrics["eval_loss"], "test_loss": predicted.metrics["test_loss"],
               "epochs": trainer.state.epoch}
        Path(args.out, "log.json").write_text(json.dumps(log, indent=1))
        print(f"losses {[round(entry['loss'], 4) for entry in history]}, eval loss {metrics['eval_loss']:.4f}")


if __name__ == "__main__":
    main()
