"""Run a local HTML file in real headless Chromium: the DOM after scripts ran, console errors, a screenshot.

Used by the HTML report tests and by ``docs/make_screenshots.py``. Chromium is the Debian
``chromium`` package (``apt-get install chromium``; ``.ci/run`` installs it). Every run gets a
fresh profile directory and no network: ``--headless --no-sandbox`` (tests may run as root),
``--disable-gpu``, no background networking, component updates, sync or first-run UI.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["ChromiumRun", "chromium_binary", "dump_dom", "screenshot"]

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio",
    "--disable-extensions", "--enable-logging=stderr", "--v=0",
)
# Chromium logs page console messages as: [...:INFO:CONSOLE(12)] "message", source: file:///... (12)
_CONSOLE = re.compile(r":(?:INFO|WARNING|ERROR):CONSOLE[^\]]*\]\s*\"(.*)\", source:")


def chromium_binary() -> str | None:
    """Path of a Chromium/Chrome executable, or ``None``."""
    for name in _CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclasses.dataclass
class ChromiumRun:
    """What one headless run gave back."""

    returncode: int
    dom: str
    console: list[str]  # every page console message Chromium logged (errors included)
    stderr: str

    def console_errors(self) -> list[str]:
        """Console messages that report script errors."""
        return [m for m in self.console if re.search(r"Uncaught|Error|error:", m)]


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    binary = chromium_binary()
    if binary is None:
        raise FileNotFoundError("Chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory(prefix="autotp-chromium-") as profile:
        env = dict(os.environ, HOME=profile)  # Chromium writes caches under $HOME too
        return subprocess.run([binary, *_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout_s, env=env, check=False)


def dump_dom(path: str | os.PathLike, fragment: str = "", *, budget_ms: int = 5000,
             window: tuple[int, int] = (1400, 900), timeout_s: float = 90.0) -> ChromiumRun:
    """Load ``path`` (``#fragment`` appended), let scripts run for up to ``budget_ms`` of virtual time, return the DOM."""
    url = Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    proc = _run([f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
                timeout_s)
    console = [m.group(1) for m in _CONSOLE.finditer(proc.stderr)]
    return ChromiumRun(proc.returncode, proc.stdout, console, proc.stderr)


def screenshot(path: str | os.PathLike, png: str | os.PathLike, fragment: str = "", *, budget_ms: int = 5000,
               window: tuple[int, int] = (1400, 900), timeout_s: float = 90.0) -> ChromiumRun:
    """Save a PNG of the page as a ``window``-sized browser shows it."""
    url = Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")
    proc = _run([f"--window-size={window[0]},{window[1]}", f"--virtual-time-budget={budget_ms}",
                 f"--screenshot={Path(png).resolve()}", url], timeout_s)
    console = [m.group(1) for m in _CONSOLE.finditer(proc.stderr)]
    return ChromiumRun(proc.returncode, "", console, proc.stderr)
