"""Argument types shared by the ``autotp`` sub-commands: checked when the command line is parsed.

A bad value is an argparse error (usage, the reason, exit code 2) before any model is built or
traced, never a traceback minutes later. Importing this module imports no torch; checking a
hardware profile does (the profiles live in :mod:`autotp.cost_model`), which the commands that
take one import anyway.
"""

from __future__ import annotations

import argparse
import os
import re

__all__ = ["constraint", "hardware_profile", "memory_budget", "output_path", "positive_float", "positive_int"]


def hardware_profile(text: str) -> str:
    """``--hardware``: a known profile name or the path of a readable JSON profile; returned as given."""
    from autotp.cost_model.hardware import KNOWN_HARDWARE, load_hardware_json

    if text in KNOWN_HARDWARE:
        return text
    if text.endswith(".json") or os.path.isfile(text):
        try:
            load_hardware_json(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return text
    raise argparse.ArgumentTypeError(
        f"unknown hardware profile {text!r}; known profiles: {', '.join(sorted(KNOWN_HARDWARE))}; "
        f"or the path of a .json profile (written by `autotp calibrate` or Hardware.to_json())")


def positive_int(text: str) -> int:
    """An integer >= 1 (world sizes, counts)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def positive_float(text: str) -> float:
    """A number > 0 (seconds, sizes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def output_path(text: str) -> str:
    """A file to write at the end of a run: its folder must exist now, so a long run does not fail at the end."""
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: folder {folder!r} does not exist; create it first")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: it is a folder; give a file name")
    return text


def memory_budget(text: str) -> float | str | None:
    """``--memory-budget``: ``auto``, ``none`` (no limit) or bytes with an optional unit (``20GiB``, ``1.5 MB``)."""
    low = text.strip().lower()
    if low == "auto":
        return "auto"
    if low in ("none", "off", "unlimited"):
        return None
    match = re.fullmatch(r"([\d.]+)\s*(b|kib|mib|gib|tib|kb|mb|gb|tb)?", low)
    if not match:
        raise argparse.ArgumentTypeError(f"expected 'auto', 'none' or bytes such as 20GiB, got {text!r}")
    scale = {None: 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12}[match.group(2)]
    return float(match.group(1)) * scale


def constraint(text: str) -> tuple[str, str]:
    """``--constraint``: ``PATTERN=PLACEMENT`` (``model.layers.*.mlp.down_proj.weight=R``) as ``(pattern, placement)``."""
    pattern, sep, placement = text.rpartition("=")
    if not sep or not pattern or not placement:
        raise argparse.ArgumentTypeError(f"expected PATTERN=PLACEMENT such as 'model.layers.*.mlp.down_proj.weight=R', "
                                         f"got {text!r}")
    from autotp.base.placements import placement_from_str

    try:
        placement_from_str(placement)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return pattern, placement
