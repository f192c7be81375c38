"""The ranks of ``tests/test_agreement_exit.py``: fault cases, each run by 2 fresh processes that exit at once.

:func:`launch` runs in one process the test spawns: it imports torch and autotp once (:data:`PRELOADED`),
then starts every group's ranks by ``fork``. A spawned rank would spend ~3.5 CPU-seconds importing
them, and the test machine's two cores could not run 20 groups per case in a minute. A forked rank is
as fresh as a spawned one (the launcher has run no torch op and holds no process group), and it leaves
by ``os._exit`` right after its case, the quickest exit there is: the widest window for the race.
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

__all__ = ["CASES", "HOST_EXITS_FIRST", "PRELOADED", "launch"]

PRELOADED = ("torch", "torch.distributed", "torch.export", "torch._dynamo", "torch._export",
             "torch._functorch.aot_autograd", "torch._inductor.decomposition", "sympy", "networkx", "autotp",
             "autotp.api", "autotp.passes.solver", "autotp.capture.stamping")
"""What a first compile imports: a rank forked after them compiles a tiny MLP in ~0.4 s instead of ~2.7 s."""

_JOIN_S = 90.0  # per group: a hang fails the group instead of stalling the test
_TIMEOUT_S = 30.0  # agreement_timeout_s of every case: far above what any exchange here takes


# --------------------------------------------------------------------------- fault cases (run on every rank)

def _options_differ(rank: int) -> None:
    """Rank 1 passes another hardware option: ranks_agree raises one AgreementError on both."""
    from autotp.runtime.agreement.exchanges import options_record, ranks_agree

    with ranks_agree(None, timeout_s=_TIMEOUT_S, what="autotp.compile") as agreement:
        agreement.record = options_record({"hardware": f"profile-{rank}"}, weights=None)


def _one_rank_fails(rank: int) -> None:
    """Rank 1 fails in the body: both raise the AgreementError naming rank 1's error."""
    from autotp.runtime.agreement.exchanges import options_record, ranks_agree

    with ranks_agree(None, timeout_s=_TIMEOUT_S, what="autotp.compile") as agreement:
        if rank == 1:
            raise ValueError("world_size=3 but the process group has 2 ranks")
        agreement.record = options_record({}, weights=None)


def _different_points(rank: int) -> None:
    """The ranks reach different exchanges: both raise the AgreementError naming both points."""
    from autotp.runtime.agreement.exchanges import exchange

    exchange(rank, group=None, timeout_s=_TIMEOUT_S, what=f"point {rank}")


def _shared_then_local_error(rank: int) -> None:
    """Rank 0 shares 1 MiB (a plan, a program), then every rank raises a local error: rank 0 must not exit
    while rank 1 is still reading rank 0's value from the store rank 0 hosts."""
    from autotp.base.errors import TracedValueError
    from autotp.runtime.agreement.exchanges import share_from_first

    sent = share_from_first(b"p" * (1 << 20) if rank == 0 else None, group=None, timeout_s=_TIMEOUT_S,
                            what="the plan from rank 0")
    raise TracedValueError(f"scale was 1.0 when the model was traced; this call passes 3.0 (got {len(sent)} bytes)")


def _tiny_mlp(intermediate: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, intermediate), nn.GELU(), nn.Linear(intermediate, 8)).eval()
    return model, (torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1)),)


def _compile_models_differ(rank: int) -> None:
    """autotp.compile of a tiny MLP, rank 1's wider: both raise the AgreementError naming the parameter."""
    import autotp

    model, args = _tiny_mlp(16 if rank == 0 else 32)
    autotp.compile(model, example_inputs=args, runtime=autotp.RuntimeOptions(agreement_timeout_s=_TIMEOUT_S))


def _compile_then_new_value(rank: int) -> None:
    """autotp.compile succeeds, then every rank calls with another shape on rank 1: both raise the
    AgreementError of the call's exchange (the compile's last exchange, the plan, must not leave rank 1
    reading from a store whose host has gone)."""
    import autotp

    model, args = _tiny_mlp(16)
    tp = autotp.compile(model, example_inputs=args, runtime=autotp.RuntimeOptions(agreement_timeout_s=_TIMEOUT_S))
    x = args[0] if rank == 0 else args[0][:, :2]
    tp(x)


CASES = {
    "options_differ": (_options_differ, "AgreementError", "option hardware: rank 0 profile-0; rank 1 profile-1"),
    "one_rank_fails": (_one_rank_fails, "AgreementError", "rank 1 failed: ValueError: world_size=3"),
    "different_points": (_different_points, "AgreementError", "the ranks are at different points"),
    "shared_then_local_error": (_shared_then_local_error, "TracedValueError", "got 1048576 bytes"),
    "compile_models_differ": (_compile_models_differ, "AgreementError", "parameter 0.weight: rank 0 (16, 8)"),
    "compile_then_new_shape": (_compile_then_new_value, "AgreementError", "argument 0: rank 0 (2, 3, 8) float32"),
}
"""case -> (what every rank runs, the error class every rank must raise, words of its message)."""


def _host_exits_first(rank: int) -> None:
    """Rank 0 (the store's host) returns and exits at once; rank 1 reaches an exchange a second later: it raises
    a RankTimeoutError saying the store's host has gone, not a DistNetworkError."""
    import torch.distributed as dist

    from autotp.runtime.agreement.exchanges import exchange

    # Both ranks through init first: gloo's rendezvous reads the store after init_process_group returns on rank 0,
    # and a host that exits during it fails rank 1's init (torch's error, before autotp runs), not an exchange.
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
        exchange(rank, group=None, timeout_s=_TIMEOUT_S, what="autotp.compile")


HOST_EXITS_FIRST = "host_exits_first"
_RUNNABLE = {**{case: run for case, (run, _, _) in CASES.items()}, HOST_EXITS_FIRST: _host_exits_first}


def _rank_main(case: str, rank: int, world_size: int, port: int, out: str) -> None:
    """One rank: join the group through MASTER_ADDR/MASTER_PORT (rank 0 hosts the store), run the case,
    write ``(error class, message)`` to ``out`` and return, which ends the process."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome = ("ok", "")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=_JOIN_S))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _RUNNABLE[case](rank)
    except BaseException as exc:  # noqa: BLE001 - what this rank raised is the result
        outcome = (type(exc).__name__, str(exc))
    Path(out).write_bytes(pickle.dumps(outcome))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_group(context: mp.context.BaseContext, case: str, directory: Path, run: int,
               world_size: int) -> list[tuple[str, str]]:
    """Start ``world_size`` fresh processes on ``case``; what each rank raised, by rank."""
    outs = [directory / f"{case}-{run}-{rank}.pickle" for rank in range(world_size)]
    port = _free_port()
    processes = [context.Process(target=_rank_main, args=(case, rank, world_size, port, str(out)), daemon=True)
                 for rank, out in enumerate(outs)]
    for process in processes:
        process.start()
    deadline = time.monotonic() + _JOIN_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join()
    return [pickle.loads(out.read_bytes()) if out.exists() else ("no result", f"exit code {process.exitcode}")
            for out, process in zip(outs, processes)]


def launch(runs: dict[str, int], directory: str, world_size: int = 2) -> None:
    """Run ``runs[case]`` groups of ``world_size`` forked ranks per case; write ``{case: [outcomes by rank, per
    run]}`` to ``directory/outcomes.pickle``."""
    for name in PRELOADED:
        importlib.import_module(name)
    context = mp.get_context("fork")
    outcomes = {case: [_run_group(context, case, Path(directory), run, world_size) for run in range(runs[case])]
                for case in runs}
    (Path(directory) / "outcomes.pickle").write_bytes(pickle.dumps(outcomes))
