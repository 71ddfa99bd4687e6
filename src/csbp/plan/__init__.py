"""``csbp plan``: choose a layout for a model, a context length and a cluster from a calibrated
cost model (pure Python and NumPy: importable without torch; only ``--doc-length``'s documents,
drawn by csbp's own torch helper, import it).

Modules: ``hardware`` (presets with sources), ``workload`` (model and objective shapes),
``run_config_workload`` (those of a run config), ``layout`` (a candidate), ``model`` (decoder cost
terms), ``drafter`` (DFlash terms), ``documents`` (packed documents: their per-rank counts),
``calibration`` (efficiency factors, files), ``fit`` (fitting them to published runs or to
``csbp bench`` output), ``search`` (enumerate and rank), ``auto`` (``topology: auto``),
``artifact_documents`` (real document layouts from ``--data`` or a run's data), ``target_pass``
(the online DFlash target pass's terms), ``remedy`` (what to change when nothing fits),
``planner_memory`` (what planning itself needs).
"""
