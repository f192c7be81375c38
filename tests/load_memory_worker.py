"""One rank of the loading-memory test (tests/test_loading_memory.py), run as a fresh process.

``python load_memory_worker.py RANK WORLD_SIZE INIT_METHOD CHECKPOINT``: joins a gloo group, warms
up (imports, one trace and plan of a one-layer model, so lazily imported code is resident), then
records the resident set (VmRSS), makes the checkpoint's Llama tensor-parallel from a meta model
reading only this rank's blocks, and prints one JSON line: the peak resident set (VmHWM) above
that baseline, and the bytes of parameters the rank holds.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
import torch.distributed as dist
from models import tiny_llama

import autotp
from autotp.cli.load_demo import peak_rss_bytes, resident_bytes

SHAPES = {"hidden": 768, "layers": 2, "intermediate": 3072, "vocab_size": 16000}



def main(rank: int, world_size: int, init_method: str, checkpoint: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    warm, args, kwargs = tiny_llama(layers=1, device="meta")
    autotp.plan(warm, args, kwargs, world_size=world_size)
    model, args, kwargs = tiny_llama(device="meta", **SHAPES)
    gc.collect()
    before = resident_bytes()
    tp = autotp.compile(model, world_size=world_size, example_inputs=args, example_kwargs=kwargs, checkpoint=checkpoint)
    peak = peak_rss_bytes()
    print(json.dumps({"rank": rank, "growth": peak - before, "held": tp.parameter_bytes()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
