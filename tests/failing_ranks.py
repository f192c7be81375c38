"""The ranks of ``tests/test_peer_failure.py``: one rank raises inside its rank-local graph mid-forward.

Each case runs in fresh processes (never the shared pool: the failure leaves the group's collectives out of
step), forked from a launcher that imported torch and autotp once, as ``tests/exit_ranks.py`` does. The model
checks its input with a custom op (``autotp_test::check_finite``, registered here) that raises on a rank whose
input holds a NaN: only the failing rank is handed one, so its graph raises before its first collective while
the other ranks wait there for it.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import socket
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
from torch import nn

__all__ = ["CASES", "launch"]

PRELOADED = ("torch", "torch.distributed", "torch.export", "torch._dynamo", "torch._export", "torch._inductor",
             "torch._functorch.aot_autograd", "torch._inductor.decomposition", "sympy", "networkx", "autotp",
             "autotp.api", "autotp.passes.solver", "autotp.capture.stamping")

AGREEMENT_TIMEOUT_S = 120.0
"""Far above the test's bound: a rank that only stopped at this timeout fails the test."""

_JOIN_S = 240.0  # per group: a hang fails the group instead of stalling the test

_LIBRARY = torch.library.Library("autotp_test", "DEF")
_LIBRARY.define("check_finite(Tensor x) -> Tensor")


def _check_finite(x: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(x).all():
        raise ValueError("input holds non-finite values")
    return x.clone()


_LIBRARY.impl("check_finite", _check_finite, "CPU")
torch.library.register_fake("autotp_test::check_finite", lambda x: torch.empty_like(x), lib=_LIBRARY)


class CheckedMLP(nn.Module):
    """An MLP whose input is checked first (``check_finite``); ``* 2.0`` after it, a node to pin a placement on."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, 16)
        x = torch.ops.autotp_test.check_finite(x)
        return self.down(torch.relu(self.up(x))) * 2.0


CASES = {  # case -> (runtime mode, constraints, the rank that fails, world size)
    # the down projection's Partial output summed by the shared-memory all-reduce
    "shared_memory_eager": ("eager", {"up.weight": "S(0)", "down.weight": "S(1)"}, 1, 2),
    "shared_memory_store_host_fails": ("eager", {"up.weight": "S(0)", "down.weight": "S(1)"}, 0, 2),
    "shared_memory_compiled": ("compiled", {"up.weight": "S(0)", "down.weight": "S(1)"}, 1, 2),
    # the Partial output reduce-scattered by gloo (the product pinned to S(2)), then all-gathered
    "gloo_eager": ("eager", {"up.weight": "S(0)", "down.weight": "S(1)", "mul": "S(2)"}, 1, 3),
    "gloo_compiled": ("compiled", {"up.weight": "S(0)", "down.weight": "S(1)", "mul": "S(2)"}, 1, 2),
}


def _case(name: str, rank: int) -> dict:
    """Compile, call once on every rank, then once more with a NaN on the failing rank: what each rank raised,
    after how many seconds, and the collectives of its graph."""
    import autotp

    mode, constraints, failing, _ = CASES[name]
    torch.manual_seed(0)
    model = CheckedMLP().eval()
    x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(1))
    tp = autotp.compile(model, example_inputs=(x,), options=autotp.PlanOptions(constraints=constraints),
                        runtime=autotp.RuntimeOptions(agreement_timeout_s=AGREEMENT_TIMEOUT_S, runtime_mode=mode))
    first_diff = (tp(x) - model(x)).abs().max().item()
    bad = x.clone()
    if rank == failing:
        bad[0, 0, 0] = float("nan")
    start = time.monotonic()
    try:
        tp(bad)
        raised = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - what this rank raised is the result
        raised = (type(exc).__name__, str(exc))
    targets = [str(n.target) for n in tp.graph_module.graph.nodes if n.op == "call_function"]
    return {"raised": raised, "seconds": time.monotonic() - start, "first_diff": first_diff,
            "counts": tp.collective_counts(), "targets": targets}


def _rank_main(name: str, rank: int, world_size: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=_JOIN_S))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = _case(name, rank)
    except BaseException as exc:  # noqa: BLE001 - a failure outside the call is a result too
        result = {"raised": ("outside the call: " + type(exc).__name__, str(exc))}
    result["done_at"] = time.monotonic()  # the system's monotonic clock: the launcher reads the same one
    Path(out).write_bytes(pickle.dumps(result))
    # the process ends here, right after its error: nothing may hang at exit


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(names: list[str], directory: str) -> None:
    """Run each case in fresh forked ranks; write ``{case: [(result, exit code, when it was seen to exit) by rank]}``
    (times of ``time.monotonic()``, as the result's ``done_at``)."""
    for module in PRELOADED:
        importlib.import_module(module)
    context = mp.get_context("fork")
    outcomes = {}
    for name in names:
        world_size = CASES[name][3]
        outs = [Path(directory) / f"{name}-{rank}.pickle" for rank in range(world_size)]
        port = _free_port()
        processes = [context.Process(target=_rank_main, args=(name, rank, world_size, port, str(out)), daemon=True)
                     for rank, out in enumerate(outs)]
        start = time.monotonic()
        for process in processes:
            process.start()
        exits = []
        for process in processes:
            process.join(max(0.0, start + _JOIN_S - time.monotonic()))
            exits.append(time.monotonic())
        for process in processes:
            if process.is_alive():
                process.kill()
                process.join()
        outcomes[name] = [(pickle.loads(out.read_bytes()) if out.exists() else None, process.exitcode, exited)
                          for out, process, exited in zip(outs, processes, exits)]
    (Path(directory) / "outcomes.pickle").write_bytes(pickle.dumps(outcomes))
