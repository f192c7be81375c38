"""No mesh, no process group: the front doors stay small and every autotp exception is public."""

from __future__ import annotations

import dataclasses
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


def test_backend_takes_four_parameters_plus_options() -> None:
    """autotp.backend: world_size, group, max_shapes plus options= and runtime=, like torch.compile."""
    names = _named_parameters(autotp.backend)
    assert names[-2:] == ["options", "runtime"], f"expected options, runtime last, got {names}"
    assert len(names) <= 5, f"autotp.backend takes {len(names)} parameters, expected at most 3 plus 2 options"


def _named_parameters(door: object) -> list[str]:
    """The parameters a door documents (its ``**deprecated`` catch-all of old spellings left out)."""
    return [name for name, parameter in inspect.signature(door).parameters.items()  # type: ignore[arg-type]
            if parameter.kind is not inspect.Parameter.VAR_KEYWORD]


@pytest.mark.parametrize("name", ["compile", "plan", "compile_mesh", "plan_mesh", "from_pretrained", "load", "backend"])
def test_every_option_has_one_door(name: str) -> None:
    """No front door takes a PlanOptions or RuntimeOptions field as its own keyword (world_size, which says
    how many ranks to build for, excepted): each option is given one way, in options= or runtime=."""
    fields = ({f.name for f in dataclasses.fields(autotp.PlanOptions)}
              | {f.name for f in dataclasses.fields(autotp.RuntimeOptions)}) - {"world_size"}
    twice = sorted(fields & set(_named_parameters(getattr(autotp, name))))
    assert not twice, f"autotp.{name} takes {twice} as keywords; they belong in options= or runtime= only"


def test_every_exception_is_exported() -> None:
    """Every exception class autotp.base.errors defines is importable from autotp and listed in __all__."""
    defined = {name for name, value in vars(errors).items()
               if isinstance(value, type) and issubclass(value, Exception) and value.__module__ == errors.__name__}
    assert defined, "expected autotp.base.errors to define exception classes"
    missing = sorted(name for name in defined if getattr(autotp, name, None) is not vars(errors)[name])
    unlisted = sorted(defined - set(autotp.__all__))
    assert not missing and not unlisted, f"not exported: {missing}; not in __all__: {unlisted}"


def test_an_old_keyword_and_options_both_setting_it_fail() -> None:
    """No mesh: the deprecated hardware= and options=PlanOptions(hardware=...) together are a ValueError naming it."""
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="hardware given both as autotp.plan"):
        autotp.plan(torch.nn.Linear(4, 4), (torch.ones(1, 4),), world_size=2, hardware="a100-sxm",
                    options=autotp.PlanOptions(hardware="h200"))


def test_an_unknown_keyword_is_a_type_error() -> None:
    """No mesh: a keyword no door ever took is Python's TypeError, not swallowed by the old spellings' catch-all."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'stritc'"):
        autotp.plan(torch.nn.Linear(4, 4), (torch.ones(1, 4),), world_size=2, stritc=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'strict'"):
        autotp.compile(torch.nn.Linear(4, 4), example_inputs=(torch.ones(1, 4),), strict=True)


def test_cross_field_checks_fail_where_built() -> None:
    """The one check of the options together (plan_options): dropout='split' without training, training with
    max_cache_len."""
    from autotp.planning.options import plan_options

    with pytest.raises(ValueError, match="dropout='split' needs training=True"):
        plan_options(autotp.PlanOptions(dropout="split"))

    with pytest.raises(ValueError, match="training=True and max_cache_len= do not go together"):
        plan_options(autotp.PlanOptions(training=True), max_cache_len=16)
    with pytest.raises(ValueError, match="agreement_timeout_s must be a positive number"):
        autotp.RuntimeOptions(agreement_timeout_s=0)
