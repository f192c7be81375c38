"""What every ``autotp demo`` variant shares: the demo model, rank-0 messages, and spawning the ranks.

``autotp demo`` (plain, ``--generate``, ``--checkpoint``, ``--mesh``) each start N local gloo
processes, run one function per rank and read one small result from rank 0. :func:`spawn_ranks`
does the starting, the waiting and the error report once, so every variant fails the same way: exit
code 2 and the failing rank's traceback. Importing this module imports no torch.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["DEMO_BATCH", "DEMO_VOCAB", "build_demo_llama", "free_port", "joined_group", "say", "spawn_ranks"]

DEMO_HIDDEN = 256
DEMO_HEADS = 8
DEMO_KV_HEADS = 4
DEMO_INTERMEDIATE = 512
DEMO_VOCAB = 1000
DEMO_BATCH = 2

FAILED = 2  # exit code when a rank raised, died, or rank 0 sent no result


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now, for the ranks' ``tcp://`` rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def joined_group(rank: int, world_size: int, init_method: str) -> Iterator[None]:
    """Run the block as ``rank`` of the demo's gloo group, and leave the group after it, raised or not.

    Every rank is on this machine (loopback), the cores are shared out among the ranks, and only
    rank 0 shows warnings, so each shows once rather than ``world_size`` times.
    """
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    if rank != 0:
        warnings.simplefilter("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def say(rank: int, message: str) -> None:
    """Print ``message`` once (on rank 0), flushed so that progress shows while the ranks work."""
    if rank == 0:
        print(message, flush=True)


def build_demo_llama(layers: int, seq_len: int, seed: int) -> Any:
    """The demo's small LlamaForCausalLM (GQA 8/4 heads), random weights from ``seed``: identical on every rank."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=DEMO_VOCAB, hidden_size=DEMO_HIDDEN, intermediate_size=DEMO_INTERMEDIATE,
        num_hidden_layers=layers, num_attention_heads=DEMO_HEADS, num_key_value_heads=DEMO_KV_HEADS,
        max_position_embeddings=max(1024, seq_len), attn_implementation="sdpa", use_cache=False,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def spawn_ranks(target: Callable[..., None], args: tuple[Any, ...], world_size: int, what: str) -> tuple[int, Any]:
    """Run ``target(rank, *args, results)`` in ``world_size`` spawned processes and wait for all of them.

    Rank 0 puts one small value on ``results`` (a large one would block its pipe until the join).
    Returns ``(0, value)``; or ``(2, None)`` after printing which rank failed and why (``what`` names
    the command in that message, e.g. ``"autotp demo --mesh"``).
    """
    import torch.multiprocessing as mp

    results = mp.get_context("spawn").SimpleQueue()
    try:
        mp.start_processes(target, args=(*args, results), nprocs=world_size, join=True, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        print(f"{what} failed on rank {exc.error_index}:\n{exc}", file=sys.stderr, flush=True)
        return FAILED, None
    except mp.ProcessExitedException as exc:
        print(f"{what}: rank {exc.error_index} exited with code {exc.exit_code}", file=sys.stderr, flush=True)
        return FAILED, None
    if results.empty():
        print(f"{what}: rank 0 finished without a result", file=sys.stderr, flush=True)
        return FAILED, None
    return 0, results.get()
