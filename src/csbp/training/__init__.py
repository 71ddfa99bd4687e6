"""Training: the trainer loop, AdamW and its schedule, exact-resume checkpoints, metrics, launching.

Modules: ``preflight`` (every check before work starts), ``model_factory`` (the decoder of a run),
``optim`` / ``lr_schedule`` (AdamW groups, clipping, warm-up + cosine), ``step`` (one step and one
validation pass through the engine), ``parallelize`` (FSDP2 and gradient averaging),
``checkpoint`` (atomic DCP checkpoints), ``metrics`` (JSONL, TensorBoard, tqdm, loss plot),
``trainer`` (set-up and teardown of a run), ``step_loop`` (the steps), ``nan_policy`` (non-finite
steps), ``finish`` (``final/`` and the sample at the end), ``train_lock`` (the run
directory's lock of a direct ``train`` call), ``launcher`` (single process, torchrun, or local
workers). DFlash drafter
runs (``objective.name: dflash``): ``dflash_inputs`` (checks against the target and data),
``drafter`` (the drafter on its frozen target, the public-format export), ``dflash_step`` (steps
and validation through ``csbp.dflash.DFlashStep``).

Usage::

    from csbp.training import launch_training
    summary = launch_training(cfg, run_dir="runs/demo", max_steps=20)   # what `csbp train` does
    print(summary.format())
"""

from csbp.training.launcher import LaunchOptions, TrainingFailed, launch_training
from csbp.training.trainer import TrainSummary, default_run_dir, train

__all__ = ["LaunchOptions", "TrainSummary", "TrainingFailed", "default_run_dir", "launch_training", "train"]
