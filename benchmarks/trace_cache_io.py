"""What a trace cache entry costs to write and to read back: autotp's form against torch's public one.

    python benchmarks/trace_cache_io.py [--layers 16] [--repeats 5] [--baseline CHECKOUT]

Traces the random Llama of ``benchmarks/load.py`` on the meta device once (dynamic batch and
sequence, as ``from_pretrained`` does; a decoder of 4 or more layers is stamped, as capture does),
then, ``--repeats`` times and alternating between the forms, writes that program and reads it back:

- ``this``: this checkout's ``autotp.capture.trace_cache`` (the ``torch._export.serde`` schema without
  weights, pickled; rebuilt with the model's weights bound), step by step: serialize, write
  (pickle, checksum, atomic file), read (file, checksum, unpickle) and rebuild;
- ``public file`` and ``public BytesIO``: ``torch.export.save`` / ``torch.export.load`` of the same
  program, to a file and to an in-memory buffer (what a cache entry and a shared trace would use);
- ``baseline`` (with ``--baseline``): ``CHECKOUT/autotp/capture/trace_cache.py``, loaded under another name.

Besides the times it prints each form's size and the bytes of real weight storage its read
allocated (``torch.export.load`` turns a meta model's fake weights into real tensors). One process,
the same program: the medians' ratios are meaningful on a busy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load import CONFIG, SEQ_LEN  # noqa: E402

STEPS = ("serialize", "write", "read", "rebuild")


def _real_bytes(exported: Any) -> int:
    """Bytes of real (not fake, not meta) storage held by a program's weights and constants."""
    from torch._subclasses.fake_tensor import FakeTensor

    storages = {}
    for tensor in [*exported.state_dict.values(), *exported.constants.values()]:
        if hasattr(tensor, "untyped_storage") and not isinstance(tensor, FakeTensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()  # weights may be views of one storage
    return sum(storages.values())


def _private_round_trip(module: ModuleType, exported: Any, model: Any, path: Path) -> tuple[dict[str, float], int, int]:
    import torch

    started = time.perf_counter()
    entry = module._entry("key", exported)
    serialized = time.perf_counter()
    module._write_entry(path, entry)
    written = time.perf_counter()
    read = module._read_entry(path, "key")
    loaded = time.perf_counter()
    rebuilt = module._rebuild(read, model, torch.device("cpu"))
    done = time.perf_counter()
    steps = {"serialize": serialized - started, "write": written - serialized, "read": loaded - written,
             "rebuild": done - loaded}
    return steps, path.stat().st_size, _real_bytes(rebuilt)


def _public_round_trip(exported: Any, path: Path | None) -> tuple[dict[str, float], int, int]:
    """``torch.export.save`` then ``torch.export.load``; to ``path``, or to a BytesIO when it is None."""
    import torch

    target: Any = path if path is not None else io.BytesIO()
    started = time.perf_counter()
    torch.export.save(exported, target)
    written = time.perf_counter()
    if isinstance(target, io.BytesIO):
        size = len(target.getvalue())
        target.seek(0)
    else:
        size = path.stat().st_size if path is not None else 0
    loaded = torch.export.load(target)
    done = time.perf_counter()
    return {"write": written - started, "read": done - written}, size, _real_bytes(loaded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", metavar="CHECKOUT", help="another autotp checkout (e.g. main's) to time too")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import logging
    import warnings

    import torch
    import transformers

    from autotp.capture import trace_cache as this
    from autotp.capture.tracing import _export, default_dynamic_shapes

    warnings.simplefilter("ignore")
    logging.getLogger("torch._export.serde.serialize").setLevel(logging.ERROR)  # load's weights_only fallback notice
    forms: dict[str, Callable[[Path], tuple[dict[str, float], int, int]]] = {}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_trace_cache", Path(args.baseline) / "autotp" / "capture" / "trace_cache.py")
        assert spec is not None and spec.loader is not None, f"no autotp/capture/trace_cache.py in {args.baseline}"
        base = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = base  # pickle finds its _Entry class by this name
        spec.loader.exec_module(base)
        forms["baseline"] = lambda path: _private_round_trip(base, exported, model, path)
    forms["this"] = lambda path: _private_round_trip(this, exported, model, path)
    forms["public file"] = lambda path: _public_round_trip(exported, path)
    forms["public BytesIO"] = lambda path: _public_round_trip(exported, None)

    torch.set_num_threads(1)
    config = transformers.LlamaConfig(num_hidden_layers=args.layers, **CONFIG)
    config.use_cache = False
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.zeros(1, SEQ_LEN, dtype=torch.long)  # (batch, seq)
    kwargs = {"use_cache": False}
    exported = _export(model, (ids,), kwargs, default_dynamic_shapes(model, (ids,), kwargs))
    directory = Path(tempfile.mkdtemp(prefix="autotp-cache-io-"))
    seconds: dict[tuple[str, str], list[float]] = {}
    sizes: dict[str, tuple[int, int]] = {}
    for _ in range(args.repeats):
        for name, round_trip in forms.items():
            steps, size, allocated = round_trip(directory / f"{name.replace(' ', '-')}.pt2")
            for step, value in steps.items():
                seconds.setdefault((name, step), []).append(value)
            sizes[name] = (size, allocated)
    load = os.getloadavg()[0]
    print(f"trace cache round trip, {args.layers}-layer Llama on meta, medians of {args.repeats} s "
          f"(load average {load:.1f})")
    print("  " + f"{'step':<10}" + "".join(f"{name:>16}" for name in forms))
    totals = dict.fromkeys(forms, 0.0)
    for step in STEPS:
        cells = []
        for name in forms:
            values = seconds.get((name, step))
            if values is None:
                cells.append(f"{'':>16}")
                continue
            median = statistics.median(values)
            totals[name] += median
            cells.append(f"{median:>16.3f}")
        print(f"  {step:<10}" + "".join(cells))
    print(f"  {'total':<10}" + "".join(f"{totals[name]:>16.3f}" for name in forms))
    print(f"  {'/ this':<10}" + "".join(f"{totals[name] / totals['this']:>16.2f}" for name in forms))
    print(f"  {'MiB':<10}" + "".join(f"{sizes[name][0] / 2**20:>16.2f}" for name in forms))
    print(f"  {'real MiB':<10}" + "".join(f"{sizes[name][1] / 2**20:>16.1f}" for name in forms)
          + "   (weight storage the read allocated)")


if __name__ == "__main__":
    main()
