"""torch's private APIs are reached through one module, which names the releases it is tested on (fast tier).

:mod:`autotp.adapters.torch_internals` is the only library module that may read a private torch name: a module
path with a ``_part`` (``torch._subclasses``, ``torch.utils._python_dispatch``), a ``_name`` of a torch module
(``torch.overrides._get_current_function_mode_stack``, ``torch._C``), or ``torch.fx.experimental``. Two
exceptions, which the adapter's docstring gives the reasons for: ``torch.utils._pytree`` (the de-facto public
pytree API) and the op namespaces of ``torch.ops`` (``torch.ops._c10d_functional``: ops, named by schema).
The finder parses every module of the distribution (``autotp/``, ``passes/``, ``cost_model/``), top level and
inside functions: imports, attribute reads on a torch module or a name imported from one, and ``getattr`` of a
constant name. On the installed torch every detail the adapter reads is found, and a release outside the
adapter's range is refused by its check and by compile with the supported range.
"""

from __future__ import annotations

import ast
import re
import tomllib

import pytest
import torch
from package_modules import ROOT, package_modules
from source_names import dotted_name, is_private

import autotp
from autotp.adapters import torch_internals
from autotp.base.errors import UnsupportedReleaseError

ADAPTER = "autotp.adapters.torch_internals"
PUBLIC_MODULES = ("torch.utils._pytree",)
"""Private by name, used as public (see the adapter's docstring)."""



def private_part(dotted: str) -> str | None:
    """The private prefix of a dotted torch name (``torch._dynamo`` of ``torch._dynamo.exc.Unsupported``), or
    None for a public name, a name outside torch, an op namespace or a module of :data:`PUBLIC_MODULES`."""
    parts = dotted.split(".")
    if parts[0] != "torch" or parts[:2] == ["torch", "ops"]:
        return None
    for end in range(2, len(parts) + 1):
        prefix = ".".join(parts[:end])
        if prefix in PUBLIC_MODULES:
            return None
        if is_private(parts[end - 1]) or prefix == "torch.fx.experimental":
            return prefix
    return None



def _torch_names(tree: ast.Module) -> dict[str, str]:
    """Local name -> the torch name it is bound to, for every import of torch in the module (anywhere)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    names[alias.asname or "torch"] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                names[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return names


def find_private(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, what)`` of every private torch name ``tree`` imports or reads, once per line and name."""
    names = _torch_names(tree)
    found: set[tuple[int, str]] = set()

    def resolve(dotted: str) -> str | None:
        head, _, rest = dotted.partition(".")
        return None if head not in names else names[head] + (f".{rest}" if rest else "")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update((node.lineno, f"import {alias.name}") for alias in node.names if private_part(alias.name))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.update((node.lineno, f"from {node.module} import {alias.name}") for alias in node.names
                         if private_part(f"{node.module}.{alias.name}"))
        elif isinstance(node, ast.Attribute) and (dotted := dotted_name(node)) is not None:
            full = resolve(dotted)
            head = resolve(dotted.partition(".")[0])
            # the name the chain first turns private at (an imported private name is reported at its import)
            if full and (part := private_part(full)) and not (head and private_part(head)):
                found.add((node.lineno, part))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and (owner := dotted_name(node.args[0])) is not None
              and (full := resolve(owner)) is not None and (part := private_part(f"{full}.{node.args[1].value}"))):
            found.add((node.lineno, part))
    return sorted(found)


def private_torch_uses() -> list[str]:
    """``file:line: name`` of every private torch name read by a library module other than the adapter."""
    return [f"{path.relative_to(ROOT)}:{line}: {what}"
            for module, path in package_modules().items() if module != ADAPTER
            for line, what in find_private(ast.parse(path.read_text(), filename=str(path)))]


def test_no_private_torch_api_outside_the_adapter() -> None:
    """Every library module but the adapter, top level and inside functions: no private torch module or name.
    Fix: read it in ``autotp/adapters/torch_internals.py`` (with a clear error where a release lacks it) and
    import it from there."""
    found = private_torch_uses()
    assert not found, "private torch APIs outside autotp.adapters.torch_internals:\n  " + "\n  ".join(found)


def test_the_check_sees_each_form() -> None:
    """The finder itself: a private module imported, a private name imported from a public module, a private
    name read off torch or off a module imported from it, ``torch.fx.experimental``, and ``getattr`` of a
    private name are each named with their line; pytree, ``torch.ops`` namespaces, dunders, public names and
    names outside torch are not."""
    source = (
        "import torch\n"
        "import torch.utils._pytree as pytree\n"
        "import torch.distributed._symmetric_memory as symm\n"  # line 3
        "from torch.utils._python_dispatch import is_traceable_wrapper_subclass\n"  # line 4
        "from torch.nn.utils import stateless\n"
        "from torch.fx.experimental.symbolic_shapes import ShapeEnv\n"  # line 6
        "from torch.export import export\n"
        "import other\n"
        "def f(x):\n"
        "    torch._dynamo.mark_static_address(x)\n"  # line 10
        "    stateless._reparametrize_module(x)\n"  # line 11
        "    c = torch.ops._c10d_functional.all_reduce\n"
        "    s = getattr(torch._C, '_select_conv_backend', None)\n"  # line 13
        "    return pytree.tree_map(f, x), torch.__version__, other._x, torch.nn.Linear, getattr(torch, 'add')\n"
    )
    found = find_private(ast.parse(source))
    assert found == [(3, "import torch.distributed._symmetric_memory"),
                     (4, "from torch.utils._python_dispatch import is_traceable_wrapper_subclass"),
                     (6, "from torch.fx.experimental.symbolic_shapes import ShapeEnv"),
                     (10, "torch._dynamo"),
                     (11, "torch.nn.utils.stateless._reparametrize_module"),
                     (13, "torch._C")], found


def test_every_private_detail_is_found_on_this_torch() -> None:
    """The installed torch is a release of the adapter's range, and every private detail the adapter reads (its
    slow modules imported too) is there: what makes a release tested, run on each release CI installs."""
    torch_internals.check_release()
    assert torch_internals.missing_details() == [], (
        f"torch {torch.__version__} lacks what autotp.adapters.torch_internals reads: "
        f"{torch_internals.missing_details()}")


@pytest.mark.parametrize("release", ["2.13.0", "2.13.0+cpu", "2.13.1", "2.14.0", "2.14.1+cu130"])
def test_a_release_in_the_range_is_admitted(release: str) -> None:
    """The oldest release, its patches, and any patch of the newest minor, local builds included."""
    torch_internals.check_release(release)


@pytest.mark.parametrize("release", ["2.12.1", "2.12.99+cpu", "2.15.0", "2.15.0.dev20261201+cpu", "3.0.0"])
def test_a_release_outside_the_range_is_refused(release: str) -> None:
    """Older than the oldest, or a newer minor (a nightly included): ``UnsupportedReleaseError`` naming the
    release, the supported range and the pip requirement that installs one."""
    with pytest.raises(UnsupportedReleaseError) as raised:
        torch_internals.check_release(release)
    message = str(raised.value)
    assert f"torch {release} is not a release autotp supports" in message, message
    assert "supported are 2.13.0 to 2.14" in message and "pip install 'torch>=2.13.0,<2.15'" in message, message


def test_an_unreadable_release_is_refused() -> None:
    """A version string without a major and minor number: refused, naming it."""
    with pytest.raises(UnsupportedReleaseError, match="cannot read the torch release 'main'"):
        torch_internals.check_release("main")


def test_planning_on_an_untested_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """No process group: with the range moved off the installed torch (as on a newer torch), ``autotp.plan``
    raises ``UnsupportedReleaseError`` naming the range before it traces the model."""
    monkeypatch.setattr(torch_internals, "RELEASES", torch_internals.ReleaseRange("0.1.0", "0.1", "torch"))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(UnsupportedReleaseError, match=re.escape(f"torch {torch.__version__} is not a release "
                                                               "autotp supports: supported are 0.1.0 to 0.1")):
        autotp.plan(model, (torch.randn(2, 8),), world_size=2)


def test_pyproject_declares_the_adapters_range() -> None:
    """pyproject.toml's torch requirement is the adapter's range, and CI installs both of its ends: the main
    suite the oldest (.ci/constraints.txt), the torch tier the newest minor (.ci/torch_tier)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    torch_specs = [spec for spec in project["dependencies"] if re.match(r"torch\b", spec)]
    assert torch_specs == [torch_internals.PIP_SPEC], (
        f"pyproject.toml's torch requirement {torch_specs} differs from the adapter's {torch_internals.PIP_SPEC}")
    constraints = (ROOT / ".ci" / "constraints.txt").read_text()
    assert f"torch=={torch_internals.RELEASES.oldest}\n" in constraints, (
        f".ci/constraints.txt does not pin the oldest supported torch {torch_internals.RELEASES.oldest}")
    tier = (ROOT / ".ci" / "torch_tier").read_text()
    pinned = re.search(r"^release=\"\$\{AUTOTP_TORCH_RELEASE:-([0-9.]+)\}\"", tier, re.MULTILINE)
    assert pinned, ".ci/torch_tier names no torch release"
    assert pinned[1].rsplit(".", 1)[0] == torch_internals.RELEASES.newest, (
        f".ci/torch_tier installs torch {pinned[1]}, not the newest supported minor {torch_internals.RELEASES.newest}")
