"""Headless Chromium's view of a report page, for the browser tests (skipped where Chromium is absent)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="no Chromium on this machine: `make chromium` installs Debian's"
)
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=5000"]


def laid_out(page: str, folder: Path, rows: str) -> tuple[int, int]:
    """(images the browser decoded, rows matching the CSS selector `rows`) once `page` has loaded: a probe
    script is appended to a copy of it (the report itself has no script) and Chromium dumps the DOM."""
    probe = (
        "<script>window.addEventListener('load', () => { const images = [...document.images];"
        "document.body.setAttribute('data-decoded', images.filter(i => i.complete && i.naturalWidth > 0).length);"
        f"document.body.setAttribute('data-rows', document.querySelectorAll('{rows}').length); }});</script>"
    )
    path = folder / "probe.html"
    path.write_text(page.replace("</body>", probe + "</body>"))
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, "--dump-dom", f"file://{path}"], capture_output=True, text=True, timeout=120
    ).stdout
    counts = [re.search(rf'data-{name}="(\d+)"', dom) for name in ("decoded", "rows")]
    assert all(counts), f"the page did not load in Chromium: {dom[-500:]!r}"
    return int(counts[0].group(1)), int(counts[1].group(1))


def screenshot(page: str, folder: Path) -> Path:
    """The page drawn to a PNG (1280 x 2000)."""
    (folder / "report.html").write_text(page)
    shot = folder / "report.png"
    subprocess.run(
        [CHROMIUM, *FLAGS, "--hide-scrollbars", "--window-size=1280,2000", f"--screenshot={shot}",
         f"file://{folder / 'report.html'}"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    return shot
