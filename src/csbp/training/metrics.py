"""Training metrics: per-step JSONL, TensorBoard scalars, a tqdm bar and the loss-curve PNG.

Only rank 0 creates a :class:`MetricsWriter` with ``enabled=True``; on other ranks every method is
a no-op, so no other rank writes files.

``<run_dir>/metrics.jsonl`` holds one JSON object per optimizer step: ``step``, ``loss`` (global
train loss of the step), ``lr`` (the rate the step used), ``grad_norm`` (before clipping),
``tokens_per_s`` (all ranks' tokens over the step's wall time), ``tflops_per_device`` (the step's model
FLOPs, ``csbp.training.model_flops``, or a drafter's, over its wall time per device) and, on a GPU of known
bf16 peak training in bf16, ``mfu`` (that over the peak, ``csbp.gpu.flops``), ``peak_mem_bytes``,
``elapsed_s`` (since this invocation started), and ``val_loss`` on steps that ran validation
(the training objective on validation rows, clipped noise included). The diffusion objectives
(bd3, mdlm, fast_dllm_v2) also log ``val_nelbo``, the unclipped NELBO per token in nats (a
likelihood bound comparable across recipes, csbp.evaluation.nelbo), and ``val_ppl_bound`` =
``exp(val_nelbo)``.
A run that validates (``train.eval_every > 0``) and starts from step 0 first writes a record
``{"step": 0, "val_loss": ..., "elapsed_s": ...}`` (with the objective's other ``val_`` numbers)
for the untrained model, so a validation curve drawn from the file starts where training started;
it has no ``loss`` or ``lr`` (no step ran). A step ``train.nan_policy: skip`` skipped (no update) is
recorded too, with ``"skipped": true`` and its non-finite numbers as ``null``, its validation included.
Objectives may add metrics: dflash logs ``token_accuracy`` and ``tau_mean`` (and ``val_`` versions;
with a DFlash2 selector also ``selector_loss`` and ``candidate_recall``), and its validation the
served ``val_acceptance_length`` and ``val_accept_rate_<k>``. TensorBoard gets every number of
``_SCALARS`` (``val_accept_rate_<k>`` stay in the JSONL only).
When a run resumes, records after the resumed step (written before a crash) are dropped, so the
file always describes one trajectory; a new run (step 0) in an earlier run's directory starts the
file afresh.

Usage::

    writer = MetricsWriter(run_dir, enabled=rank == 0, start_step=0, total_steps=100)
    writer.log({"step": 1, "loss": 4.2, ...})
    writer.close()                     # flushes and draws <run_dir>/loss.png
"""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from csbp.atomic import write_text_atomic
from csbp.figures import save_figure

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
TENSORBOARD_DIR = "tb"
_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "tflops_per_device": "train/tflops_per_device",
    "mfu": "train/mfu",
    "peak_mem_bytes": "system/peak_mem_bytes",
    "val_loss": "val/loss",
    "val_nelbo": "val/nelbo",
    "val_ppl_bound": "val/ppl_bound",
    "token_accuracy": "train/token_accuracy",
    "tau_mean": "train/tau_mean",
    "selector_loss": "train/selector_loss",
    "candidate_recall": "train/candidate_recall",
    "val_token_accuracy": "val/token_accuracy",
    "val_tau_mean": "val/tau_mean",
    "val_selector_loss": "val/selector_loss",
    "val_candidate_recall": "val/candidate_recall",
    "val_acceptance_length": "val/acceptance_length",
    "val_lk_acceptance": "val/lk_acceptance",
    "val_clip_t_min": "noise/clip_t_min",
    "val_clip_t_max": "noise/clip_t_max",
    "val_clip_variance": "noise/clip_variance",
}


STEP_LINE_EXTRAS = ("tau_mean", "val_loss", "val_nelbo", "val_tau_mean", "val_acceptance_length")
"""Numbers a step's console line adds after ``grad_norm`` when its record has them."""


def _finite_or_null(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with non-finite numbers (a step ``train.nan_policy: skip`` skipped) as None: JSON null,
    not the ``NaN`` that strict JSON readers refuse, and no point on a curve."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}


def step_line(record: dict[str, Any]) -> str:
    """The console line of a logged step (every ``train.log_every`` steps): ``step N: loss .. lr ..
    grad_norm ..`` and, when present, the validation and DFlash numbers of :data:`STEP_LINE_EXTRAS`."""
    extra = "".join(f" {name} {record[name]:.4f}" for name in STEP_LINE_EXTRAS if name in record)
    if record.get("mfu") is not None:
        extra += f" mfu {100 * record['mfu']:.1f}%"
    return (
        f"step {record['step']}: loss {record['loss']:.4f} lr {record['lr']:.3e} "
        f"grad_norm {record['grad_norm']:.3f}{extra}"
    )


def mfu_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The dense bf16 peak MFU is measured against: a GPU the device check knows by name
    (``csbp.gpu.flops``) training in ``bf16``; None otherwise (fp32 runs at another peak; no MFU on the CPU)."""
    if device.type != "cuda" or precision != "bf16":
        return None
    from csbp.gpu.flops import gpu_bf16_peak_tflops

    return gpu_bf16_peak_tflops(torch.cuda.get_device_name(device))


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated bytes on ``device``; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # Linux reports KiB


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` (an unfinished last line from a crash, or any line that is not
    a step record, is skipped)."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def truncate_metrics(path: Path, *, after_step: int) -> None:
    """Drop records with ``step > after_step`` (rewritten atomically)."""
    if not path.is_file():
        return
    kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= after_step]
    write_text_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


class MetricsWriter:
    """JSONL + TensorBoard + tqdm on rank 0 (see the module docstring)."""

    def __init__(self, run_dir: Path, *, enabled: bool, start_step: int, total_steps: int) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        from tqdm.auto import tqdm

        self.run_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.run_dir / METRICS_FILE
        # a new run drops an earlier run's records, its step-0 baseline included
        truncate_metrics(metrics_path, after_step=start_step if start_step > 0 else -1)
        self._jsonl = open(metrics_path, "a", encoding="utf-8")
        if start_step == 0:  # and its TensorBoard events: purge_step hides them, this removes them from disk
            for events in (self.run_dir / TENSORBOARD_DIR).glob("events.out.tfevents.*"):
                events.unlink(missing_ok=True)
        self._tensorboard = SummaryWriter(
            log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step > 0 else 0
        )
        # disable=None: no bar when stderr is not a terminal (a batch job's log would get one
        # carriage-return update per step); the step lines every train.log_every still go out.
        self._bar = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True, disable=None
        )

    def log(self, record: dict[str, Any]) -> None:
        """Append one step's record everywhere (rank 0 only)."""
        if not self.enabled:
            return
        record = _finite_or_null(record)
        self._write(record)
        postfix = {
            "loss": "skipped" if record.get("skipped") else f"{record['loss']:.4f}",
            "lr": f"{record['lr']:.2e}",
            "tok/s": f"{record['tokens_per_s']:.0f}",
        }
        if record.get("val_loss") is not None:
            postfix["val"] = f"{record['val_loss']:.4f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    def log_baseline(self, record: dict[str, Any]) -> None:
        """Append the step-0 validation record (no step ran: JSONL and TensorBoard, not the bar)."""
        if self.enabled:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        """Out to the file and TensorBoard, nothing kept: a long run's records stay on disk."""
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        step = int(record["step"])
        for key, tag in _SCALARS.items():
            if record.get(key) is not None:
                self._tensorboard.add_scalar(tag, float(record[key]), step)

    def message(self, text: str) -> None:
        """A log line that does not break the progress bar (rank 0 only)."""
        if self.enabled:
            self._bar.write(text)

    def close(self) -> None:
        """Flush everything and draw ``loss.png`` from the whole ``metrics.jsonl``."""
        if not self.enabled:
            return
        self._bar.close()
        self._jsonl.close()
        self._tensorboard.close()
        plot_loss_curve(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE)


def plot_loss_curve(metrics_path: Path, out_path: Path) -> Path:
    """Train loss (line) and validation loss (markers) against the step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if train:
        axis.plot(*zip(*train), label="train loss", linewidth=1.2)
    if val:
        axis.plot(*zip(*val), "o-", label="val loss", markersize=4)
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.grid(alpha=0.3)
    if train or val:
        axis.legend()
    figure.tight_layout()
    return save_figure(figure, out_path)
