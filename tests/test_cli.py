"""Tests of the ``autotp`` command line parsing and report (no gloo processes spawned)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from autotp.cli import main as cli


def test_demo_defaults() -> None:
    """No parallelism: `autotp demo` defaults to 4 ranks, 2 layers, 16 tokens, tolerance 1e-4."""
    args = cli.build_parser().parse_args(["demo"])
    assert (args.world_size, args.layers, args.seq_len, args.tolerance) == (4, 2, 16, 1e-4), vars(args)
    assert args.hardware == "h100-sxm", f"expected the plan costed for h100-sxm by default, got {args.hardware!r}"


@pytest.mark.parametrize("bad", [["demo", "--world-size", "0"], ["demo", "--layers", "x"], [],
                                 ["demo", "--hardware", "h100"], ["calibrate", "-o", "/no/such/folder/hw.json"]])
def test_bad_arguments_exit_with_usage(bad: list[str], capsys) -> None:
    """No parallelism: invalid options are argparse errors (exit 2), not tracebacks."""
    with pytest.raises(SystemExit) as info:
        cli.main(bad)
    assert info.value.code == 2, f"expected exit code 2, got {info.value.code}"
    assert "usage: autotp" in capsys.readouterr().err


def test_report_shows_figures_and_verdict() -> None:
    """tp=2 (report only): diff, verdict, per-rank bytes with share of the original, collectives."""
    config = cli.DemoConfig(world_size=2, layers=2, seq_len=16, seed=0, tolerance=1e-4, init_method="")
    report = cli.DemoReport(max_abs_diff=2e-4, plan_text="PLAN", plan_time_s=0.5, compile_time_s=0.75,
                            parameter_bytes_original=4 * 2**20, parameter_bytes_per_rank=[2**21, 2**21],
                            collective_counts={"all_reduce": 4})
    text = cli.format_report(report, config)
    for expected in ("PLAN", "2.000e-04", "FAILED", "rank 1: 2.00 MiB (50.0% of the original)",
                     "all_reduce x4", "plan time: 0.500 s", "Costed for the 'h100-sxm' hardware profile",
                     "2 gloo processes on this machine's CPU"):
        assert expected in text, f"expected {expected!r} in the report:\n{text}"


def test_command_line_imports_no_torch() -> None:
    """No parallelism: importing the CLI and printing `autotp --help` / `autotp plan --help` import no torch
    (a fresh interpreter, so nothing this test process imported counts)."""
    code = ("import sys, contextlib, io\n"
            "import autotp.cli.main as cli\n"
            "assert 'torch' not in sys.modules, 'import autotp.cli.main imported torch'\n"
            "for argv in (['--help'], ['plan', '--help'], ['demo', '--help'], ['calibrate', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
            "        cli.main(argv)\n"
            "    assert 'torch' not in sys.modules, f'autotp {argv} imported torch'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, f"expected exit 0, got {done.returncode}:\n{done.stderr[-2000:]}"
