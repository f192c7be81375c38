"""What a trace cache entry costs to write and to read back: this checkout's ``autotp.trace_cache`` vs another's.

    python benchmarks/trace_cache_io.py --baseline CHECKOUT [--layers 16] [--repeats 5]

Traces the random Llama of ``benchmarks/load.py`` on the meta device once (dynamic batch and
sequence, as ``from_pretrained`` does), then, ``--repeats`` times and alternating between the two
versions of ``autotp/trace_cache.py`` (this one, and ``CHECKOUT/autotp/trace_cache.py`` loaded under
another module name), times each step of a cache round trip of that program: serialize (the
schema form, without weights), write (pickle, checksum, atomic file), read (file, checksum,
unpickle) and rebuild (the ExportedProgram, fake weights bound). One process, the same program:
the medians' ratios are meaningful on a busy machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load import CONFIG, SEQ_LEN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, metavar="CHECKOUT", help="another autotp checkout (e.g. main's)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    import torch
    import transformers

    from autotp import trace_cache as this
    from autotp.capture import _export, default_dynamic_shapes

    spec = importlib.util.spec_from_file_location("baseline_trace_cache", Path(args.baseline) / "autotp" / "trace_cache.py")
    assert spec is not None and spec.loader is not None, f"no autotp/trace_cache.py in {args.baseline}"
    base = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = base  # pickle finds its _Entry class by this name
    spec.loader.exec_module(base)

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
    sizes: dict[str, int] = {}
    for _ in range(args.repeats):
        for name, module in (("baseline", base), ("this", this)):
            path = directory / f"{name}.pt2c"
            started = time.perf_counter()
            entry = module._entry("key", exported)
            serialized = time.perf_counter()
            module._write_entry(path, entry)
            written = time.perf_counter()
            read = module._read_entry(path, "key")
            loaded = time.perf_counter()
            module._rebuild(read, model, torch.device("cpu"))
            rebuilt = time.perf_counter()
            for step, value in (("serialize", serialized - started), ("write", written - serialized),
                                ("read", loaded - written), ("rebuild", rebuilt - loaded)):
                seconds.setdefault((name, step), []).append(value)
            sizes[name] = path.stat().st_size
    load = os.getloadavg()[0]
    print(f"trace cache round trip, {args.layers}-layer Llama, medians of {args.repeats} (load average {load:.1f})")
    print(f"  {'step':<10} {'baseline s':>11} {'this s':>8} {'this/baseline':>14}")
    total = {"baseline": 0.0, "this": 0.0}
    for step in ("serialize", "write", "read", "rebuild"):
        old, new = statistics.median(seconds[("baseline", step)]), statistics.median(seconds[("this", step)])
        total["baseline"] += old
        total["this"] += new
        print(f"  {step:<10} {old:>11.3f} {new:>8.3f} {new / old:>14.2f}")
    print(f"  {'total':<10} {total['baseline']:>11.3f} {total['this']:>8.3f} {total['this'] / total['baseline']:>14.2f}")
    print(f"  entry size: baseline {sizes['baseline'] / 2**20:.2f} MiB, this {sizes['this'] / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
