"""Patterns over a model's blocks, as ``autotune search`` walks them and the in-job tuner too: the
units each unit prefetches, and the blocks a knob is set on (``autotune.search.patterns``
names the search's parameters after them)."""

from __future__ import annotations


def get_prefetch_lists(order: list[str], choice: str) -> dict[str, list[str]]:
    """Per unit, the units it prefetches, following ``order`` (execution order)."""
    if choice == "implicit":
        return {}
    if choice == "paired":
        return {name: (order[i + 1 : i + 3] if i % 2 == 0 else []) for i, name in enumerate(order)}
    depth = int(choice.removeprefix("depth"))
    return {name: order[i + 1 : i + 1 + depth] for i, name in enumerate(order)}


def select_blocks(blocks: list[str], pattern: str) -> set[str]:
    half = len(blocks) // 2
    match pattern:
        case "none":
            return set()
        case "all":
            return set(blocks)
        case "all_but_last":
            return set(blocks[:-1])
        case "every_2nd":
            return set(blocks[::2])
        case "first_half":
            return set(blocks[:half])
        case "second_half":
            return set(blocks[half:])
    raise ValueError(f"unknown block pattern {pattern!r}")
