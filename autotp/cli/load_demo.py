"""``autotp demo --checkpoint DIR``: load a transformers checkpoint tensor-parallel and show peak memory per rank.

Each of N local gloo processes calls :func:`autotp.from_pretrained` on ``DIR`` (config -> meta
model -> plan -> read only its blocks) and reports how much its peak resident memory grew while
loading, next to ``1/N`` of the checkpoint. Then rank 0 alone loads the whole model with
transformers to check the tensor-parallel logits (after the figures are taken, so the check does
not inflate them). Peak memory is Linux's ``VmHWM`` (``ru_maxrss`` elsewhere).
"""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_bytes", "peak_rss_bytes", "resident_bytes", "run_checkpoint_rank"]


def _status_bytes(key: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """Peak resident set of this process so far (VmHWM; ``ru_maxrss`` where /proc is missing)."""
    peak = _status_bytes("VmHWM")
    if peak is not None:
        return peak
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def resident_bytes() -> int:
    """Resident set of this process now (VmRSS; the peak where /proc is missing)."""
    now = _status_bytes("VmRSS")
    return now if now is not None else peak_rss_bytes()


def checkpoint_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the ``*.safetensors`` files at ``path`` (a file or a directory)."""
    root = Path(path)
    files = [root] if root.is_file() else list(root.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def run_checkpoint_rank(rank: int, world_size: int, init_method: str, checkpoint: str, seq_len: int, hardware: Any,
                        tolerance: float, results: Any) -> None:
    """One rank (the target of ``torch.multiprocessing.spawn``): load, report figures, rank 0 checks."""
    import torch
    import torch.distributed as dist
    import transformers

    import autotp
    from autotp.cli.demo_ranks import joined_group

    with joined_group(rank, world_size, init_method):
        config = transformers.AutoConfig.from_pretrained(checkpoint)
        ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))  # (batch, seq)
        before = resident_bytes()
        started = time.perf_counter()
        tp = autotp.from_pretrained(checkpoint, world_size=world_size, example_inputs=(ids,), options=autotp.PlanOptions(hardware=hardware))
        seconds = time.perf_counter() - started
        growth = peak_rss_bytes() - before
        logits = tp(ids, use_cache=False).logits
        figures: list[Any] = [None] * world_size
        dist.all_gather_object(figures, (growth, tp.parameter_bytes(), seconds))
        diff = torch.zeros(1, dtype=torch.float64)
        if rank == 0:
            size = checkpoint_bytes(checkpoint)
            mib = 2**20
            print(f"\ncheckpoint {checkpoint}: {size / mib:.1f} MiB; 1/{world_size} of it: {size / world_size / mib:.1f} MiB")
            for r, (grown, held, took) in enumerate(figures):
                print(f"  rank {r}: peak RSS grew {grown / mib:.1f} MiB while loading ({grown / size * world_size:.2f}x "
                      f"its share), holds {held / mib:.1f} MiB of parameters, load {took:.2f} s", flush=True)
            reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=tp_dtype(tp)).eval()
            with torch.no_grad():
                diff[0] = (reference(ids, use_cache=False).logits - logits).abs().max().item()
            ok = diff.item() <= tolerance
            print(f"max abs diff vs transformers' single-process model: {diff.item():.3e} (tolerance "
                  f"{tolerance:.0e}): {'OK' if ok else 'FAILED'}", flush=True)
            results.put(float(diff.item()))
        dist.barrier()


def tp_dtype(tp: Any) -> Any:
    """The dtype the tensor-parallel model's parameters were loaded in."""
    return next(iter(tp.local_state().values())).dtype
