"""Kernel autotuning with a persistent, versioned cache (`ttftc autotune`)."""

from ttftc.autotune.cache import AutotuneCache, TuneEntry, TuneKey, default_cache_dir
from ttftc.autotune.space import Problem, SearchSpace, TensorSpec, register_space, space_for
from ttftc.autotune.tuner import TuneResult, collect_problems, summary_table, tune_instances, tune_problem

__all__ = [
    "AutotuneCache", "Problem", "SearchSpace", "TensorSpec", "TuneEntry", "TuneKey", "TuneResult",
    "collect_problems", "default_cache_dir", "register_space", "space_for", "summary_table", "tune_instances",
    "tune_problem",
]
