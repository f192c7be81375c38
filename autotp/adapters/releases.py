"""A dependency's range of releases, as the adapters declare the releases they are tested on.

One type for every adapter (torch, transformers): a range from an exact oldest release to any patch of the
newest minor, the two ends CI tests, and the pip requirement that says the same."""

from __future__ import annotations

import dataclasses
import itertools

from autotp.base.errors import UnsupportedReleaseError


@dataclasses.dataclass(frozen=True)
class ReleaseRange:
    """Releases of ``package`` from ``oldest`` (an exact release) to any patch of the ``newest`` minor."""

    oldest: str
    newest: str
    package: str

    def admits(self, release: str) -> bool:
        numbers = release_numbers(release, self.package)
        return (release_numbers(self.oldest, self.package) <= numbers
                and numbers[:2] <= release_numbers(self.newest, self.package)[:2])

    def __str__(self) -> str:
        return f"{self.oldest} to {self.newest}"

    def pip_spec(self) -> str:
        major, minor = release_numbers(self.newest, self.package)[:2]
        return f"{self.package}>={self.oldest},<{major}.{minor + 1}"


def release_numbers(release: str, package: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a release string (``"2.13.0+cpu"``, ``"5.10"``, ``"2.15.0.dev20261201"``);
    an UnsupportedReleaseError naming ``package`` when it has no major and minor number."""
    numbers = []
    for part in release.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        numbers.append(int(digits))
    if len(numbers) < 2:
        raise UnsupportedReleaseError(f"cannot read the {package} release {release!r}")
    return (*numbers, 0, 0)[:3]  # type: ignore[return-value]
