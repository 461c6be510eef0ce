"""A run's dataset: the names this module used to hold, kept importable. The run assembly (``run.py``) builds the
dataset with the rest of the run, for the trainer, the reports, the estimates and the benches alike."""

from .run import Planning, build_run_dataset, planning_dataset, run_data_spec  # noqa: F401
