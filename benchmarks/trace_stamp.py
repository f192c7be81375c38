"""Tracing a decoder whole vs three layers traced and the rest stamped (autotp/capture/stamping.py), one process.

    python benchmarks/trace_stamp.py [--layers 16] [--repeats 3] [--generation] [--int8]

The random Llama of ``benchmarks/load.py`` (hidden 1024, 8 heads / 4 kv heads, vocab 32000), built on
the meta device as ``autotp.from_pretrained`` builds it, traced with one sequence of 16 token ids and
dynamic batch and sequence dims; with ``--generation``, its decode graph as a generation compile traces
it (the KV-cache wrapper, one row of 64 slots, one token; static sizes), functionalized (its cache writes
made state updates). ``--int8``: the model built with real random weights and its Linears quantized with torchao's
int8 weight-only config (export reads each weight's data and scales before the layers). Interleaved,
``--repeats`` times each, medians:

- export: ``torch.export`` of the whole model (and its functionalization) vs the 3-layer twin's export
  (and functionalization) + stamping;
- cache entry: the bytes rank 0 sends to the other ranks and writes to the trace cache
  (``program_bytes``), and their rebuild with the model's weights bound (``program_from_bytes``):
  whole program vs the twin's, stamped out again on rebuild.

Each pair runs back to back, so a shared machine's load affects both alike: compare the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from load import CONFIG, SEQ_LEN  # noqa: E402


def _seconds(work: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def main() -> None:
    import transformers

    from autotp.capture.kv_cache import CachedCausalLM
    from autotp.capture.stamping import stamped_from
    from autotp.capture.trace_cache import program_bytes, program_from_bytes
    from autotp.capture.tracing import _export, _export_functional, default_dynamic_shapes, trace_device

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--generation", action="store_true", help="the decode graph of a generation compile")
    parser.add_argument("--int8", action="store_true", help="torchao int8 weight-only Linears (real weights)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.device("cpu" if args.int8 else "meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(num_hidden_layers=args.layers, **CONFIG)).eval()
    if args.int8:
        import torchao.quantization as tq

        tq.quantize_(model, tq.Int8WeightOnlyConfig())
    if args.generation:
        model = CachedCausalLM(model, batch_size=1, max_cache_len=64, last_logits_only=True,
                               inputs_device=torch.device("cpu"))
        inputs, kwargs, dynamic = model.example_inputs(1), {}, None  # one new token per row
    else:
        inputs, kwargs = (torch.zeros(1, SEQ_LEN, dtype=torch.long),), {"use_cache": False}  # (batch, seq) token ids
        dynamic = default_dynamic_shapes(model, inputs, kwargs)
    device = trace_device(inputs, kwargs)
    _export_functional(model, inputs, kwargs, dynamic)  # warm-up: torch's lazy imports and caches
    times: dict[str, list[float]] = {k: [] for k in ("whole", "stamped", "bytes whole", "bytes stamped",
                                                      "rebuild whole", "rebuild stamped")}
    sizes = {}
    for _ in range(args.repeats):
        seconds, whole = _seconds(lambda: _export_functional(model, inputs, kwargs, dynamic))
        times["whole"].append(seconds)
        seconds, stamped = _seconds(lambda: _export(model, inputs, kwargs, dynamic))
        times["stamped"].append(seconds)
        if stamped_from(stamped) is None:
            raise SystemExit("the model was not stamped: see the autotp.capture.stamping debug log")
        for name, program in (("whole", whole), ("stamped", stamped)):
            seconds, data = _seconds(lambda program=program: program_bytes("key", program))
            times[f"bytes {name}"].append(seconds)
            sizes[name] = len(data)
            seconds, rebuilt = _seconds(lambda data=data: program_from_bytes(data, "key", model, device))
            if rebuilt is None:
                raise SystemExit(f"the {name} program did not rebuild")
            times[f"rebuild {name}"].append(seconds)
    median = {k: statistics.median(v) for k, v in times.items()}
    what = "decode graph (KV cache, 1 token), static sizes" if args.generation else "dynamic dims"
    weights = "int8 weight-only (torchao)" if args.int8 else "meta"
    print(f"Llama, {args.layers} layers, {weights}, {what}; medians of {args.repeats}, seconds")
    for what, whole_key, stamped_key in (("export", "whole", "stamped"), ("program bytes", "bytes whole", "bytes stamped"),
                                        ("rebuild", "rebuild whole", "rebuild stamped")):
        print(f"  {what:<14} whole {median[whole_key]:6.2f}  stamped {median[stamped_key]:6.2f}  "
              f"ratio {median[stamped_key] / median[whole_key]:.2f}")
    print(f"  entry size     whole {sizes['whole'] / 2**20:6.2f} MiB  stamped {sizes['stamped'] / 2**20:6.2f} MiB")


if __name__ == "__main__":
    main()
