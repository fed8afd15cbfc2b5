"""Every point of the search space and its knobs for the simulator: the walk lives with the search
stage (:mod:`autotune.search.presearch`, [Note: enumerating the search space]), which ``--presearch
sim`` uses too; ``autotune plan`` takes it from there."""

from autotune.search.presearch import KnobFactory, get_forward_key, iter_space_params

__all__ = ["KnobFactory", "get_forward_key", "iter_space_params"]
