"""No mesh, no process group: the front doors stay small and every autotp exception is public."""

from __future__ import annotations

import inspect

import pytest
import torch

import autotp
import autotp.base.errors as errors


@pytest.mark.parametrize("name", ["compile", "plan", "compile_mesh", "plan_mesh", "from_pretrained", "load"])
def test_front_doors_take_at_most_twelve_parameters(name: str) -> None:
    """compile, plan and their siblings: at most 12 parameters; the rest in PlanOptions/RuntimeOptions."""
    count = len(inspect.signature(getattr(autotp, name)).parameters)
    assert count <= 12, f"autotp.{name} takes {count} parameters, expected at most 12"


def test_backend_takes_six_parameters_plus_options() -> None:
    """autotp.backend: six keywords plus options= and runtime=, like torch.compile."""
    names = list(inspect.signature(autotp.backend).parameters)
    assert names[-2:] == ["options", "runtime"], f"expected options, runtime last, got {names}"
    assert len(names) <= 8, f"autotp.backend takes {len(names)} parameters, expected at most 6 plus 2 options"


def test_every_exception_is_exported() -> None:
    """Every exception class autotp.base.errors defines is importable from autotp and listed in __all__."""
    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__}
    assert defined, "expected autotp.base.errors to define exception classes"
    missing = sorted(name for name in defined if getattr(autotp, name, None) is not vars(errors)[name])
    unlisted = sorted(defined - set(autotp.__all__))
    assert not missing and not unlisted, f"not exported: {missing}; not in __all__: {unlisted}"


def test_options_given_twice_differently_fail_where_merged() -> None:
    """plan_options: a keyword and options= setting one knob to two values is a ValueError naming it."""
    with pytest.raises(ValueError, match="hardware is given twice"):
        autotp.plan(torch.nn.Linear(4, 4), (torch.ones(1, 4),), world_size=2, hardware="a100-sxm",
                    options=autotp.PlanOptions(hardware="h200"))


def test_cross_field_checks_fail_where_built() -> None:
    """The one merge (plan_options): dropout='split' without training, training with max_cache_len."""
    from autotp.planning.options import plan_options

    with pytest.raises(ValueError, match="dropout='split' needs training=True"):
        plan_options(autotp.PlanOptions(dropout="split"))

    with pytest.raises(ValueError, match="training=True and max_cache_len= do not go together"):
        plan_options(autotp.PlanOptions(training=True), max_cache_len=16)
    with pytest.raises(ValueError, match="agreement_timeout_s must be a positive number"):
        autotp.RuntimeOptions(agreement_timeout_s=0)
