"""``csbp compare``: the same run trained once per layout (and round) for the same wall-clock budget.

* :mod:`csbp.compare.layouts`: the run config of each layout (same seed, data order, model,
  hyperparameters and global batch; only the topology differs);
* :mod:`csbp.compare.budget`: the step hook that keeps the training clock, evaluates at equal time
  points and stops at the budget, and its resumable state;
* :mod:`csbp.compare.rounds`: ``--repeats``: each round's seed, layout order and directories;
* :mod:`csbp.compare.runner`: the layouts one after the other on the same processes, round by
  round, resume;
* :mod:`csbp.compare.report`: the table, ``compare.json`` and the plot of one round;
* :mod:`csbp.compare.stats` and :mod:`csbp.compare.report_rounds`: several rounds' spread, paired
  differences and verdicts, their table and plot.
"""

from csbp.compare.layouts import LAYOUT_NAMES, layout_config
from csbp.compare.runner import CompareOptions, run_compare

__all__ = ["LAYOUT_NAMES", "CompareOptions", "layout_config", "run_compare"]
