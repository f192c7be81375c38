"""``autotp plan SPEC``: presets, config.json paths, package.module:factory, outputs and errors.

Runs the command in-process (``cli.main``) on the meta device; no process group.
"""

from __future__ import annotations

import json
import re

import pytest

from autotp.cli import main as cli
from autotp.cli.plan import PRESETS, SpecError, load_spec
from autotp.planning.plan import Plan


def test_help_names_every_spec_form(capsys) -> None:
    """`autotp --help` lists plan; `autotp plan --help` explains SPEC and the outputs."""
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "plan" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    text = capsys.readouterr().out
    for expected in ("SPEC", "config.json", "package.module:factory", "--world-size", "--hardware", "--html",
                     "--json", "--plot", *PRESETS):
        assert expected in text, f"{expected!r} missing from `autotp plan --help`:\n{text}"


def test_config_json_writes_html_json_dot(tmp_path, capsys) -> None:
    """tp=2, a Llama config.json on disk (2 layers, hidden 256): summary on stdout, three files written,
    the JSON loads as a Plan, --explain explains a weight."""
    config = dict(PRESETS["tiny-llama"], torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = {k: tmp_path / f"plan.{k}" for k in ("html", "json", "dot")}
    code = cli.main(["plan", str(tmp_path), "--world-size", "2", "--seq-len", "16", "--html", str(out["html"]),
                     "--json", str(out["json"]), "--dot", str(out["dot"]),
                     "--explain", "model.layers.0.mlp.down_proj.weight"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "autotp plan: tp=2 on h100-sxm" in captured.out and "model.layers.0-1" in captured.out, captured.out
    assert "model.layers.0.mlp.down_proj.weight (parameter) [256, 512]: chose" in captured.out
    assert "traced" in captured.err and "planned in" in captured.err, "progress goes to stderr"
    plan = Plan.load(out["json"])
    assert plan.world_size == 2 and len(plan.parameters) == 21
    assert f"chose {plan.parameters['model.layers.0.mlp.down_proj.weight']}" in captured.out
    assert "autotp-plan-data" in out["html"].read_text(encoding="utf-8")
    assert out["dot"].read_text().startswith("digraph")


def test_factory_with_plot(tmp_path, capsys) -> None:
    """package.module:factory taking batch/seq_len: planned and plotted for world sizes 1-8, both phases."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "latency.png"
    code = cli.main(["plan", "cli_factories:tiny_mlp", "--world-size", "2", "--seq-len", "32", "--plot", str(png),
                     "--constraint", "0.weight=S(0)"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert captured.err.count("plot prefill") == 7 and captured.err.count("plot decode") == 8, captured.err
    assert re.search(r"^  0:\n    weight S\(0\)", captured.out, re.MULTILINE), captured.out


def test_bad_specs_are_clear(capsys) -> None:
    """Unknown SPECs and bad factories exit 2 with what SPEC may be; bad options are argparse errors."""
    assert cli.main(["plan", "no-such-model"]) == 2
    assert "is not a preset (tiny-llama" in capsys.readouterr().err
    with pytest.raises(SpecError, match="must return a module"):
        load_spec("cli_factories:not_a_model").build(1, 4)
    with pytest.raises(SpecError, match="no callable 'missing'"):
        load_spec("cli_factories:missing")
    with pytest.raises(SystemExit):
        cli.main(["plan", "tiny-llama", "--memory-budget", "lots"])
    assert "expected 'auto', 'none' or bytes" in capsys.readouterr().err


def test_budget_and_constraint_parsing() -> None:
    """--memory-budget takes auto/none/sizes; --constraint splits at the last '='."""
    from autotp.cli.arguments import constraint, memory_budget

    assert memory_budget("auto") == "auto" and memory_budget("none") is None
    assert memory_budget("20GiB") == 20 * 2**30 and memory_budget("1.5 MB") == 1.5e6
    assert constraint("model.layers.*.mlp.down_proj.weight=R") == ("model.layers.*.mlp.down_proj.weight", "R")


@pytest.mark.parametrize("bad, reason", [
    (["--hardware", "h100"], "unknown hardware profile 'h100'; known profiles: a100-multinode, a100-sxm, cpu-gloo, "
                             "h100-multinode, h100-sxm, h200, pcie-gpu"),
    (["--hardware", "missing-profile.json"], "cannot read hardware profile 'missing-profile.json'"),
    (["--json", "/no/such/folder/plan.json"], "folder '/no/such/folder' does not exist"),
    (["--constraint", "lm_head.weight=S(x)"], "cannot parse placement 'S(x)'"),
    (["--time-limit", "0"], "must be a number > 0, got 0"),
])
def test_bad_options_are_refused_before_tracing(bad: list[str], reason: str, capsys) -> None:
    """No parallelism: a wrong --hardware, output folder, constraint or time limit is an argparse error
    (exit 2, the reason and the known values) before any model is built or traced."""
    with pytest.raises(SystemExit) as info:
        cli.main(["plan", "tiny-llama", *bad])
    err = capsys.readouterr().err
    assert info.value.code == 2, f"expected exit code 2, got {info.value.code}"
    assert reason in err and "usage: autotp plan" in err, f"expected {reason!r} in:\n{err}"
    assert "traced" not in err and "built" not in err, f"nothing should be traced:\n{err}"


def test_hardware_json_from_calibrate_is_accepted(tmp_path) -> None:
    """No parallelism: --hardware takes the path of a JSON profile (as `autotp calibrate` writes) and checks it."""
    from autotp.cost_model.hardware import KNOWN_HARDWARE

    good = tmp_path / "box.json"
    good.write_text(KNOWN_HARDWARE["cpu-gloo"].to_json())
    args = cli.build_parser().parse_args(["plan", "tiny-llama", "--hardware", str(good)])
    assert args.hardware == str(good), f"expected the path kept as given, got {args.hardware!r}"
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{}")
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(["plan", "tiny-llama", "--hardware", str(corrupt)])
    assert info.value.code == 2, f"a corrupt profile must be an argparse error, got exit {info.value.code}"
