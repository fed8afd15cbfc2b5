"""Check a report page in headless Chromium with no network: no JavaScript error, every figure drawn.

    python -m autotune.report.browser runs/search/report/report.html --screenshot /tmp/report.png

[Note: browser check]
Chromium (Debian's ``chromium``; ``chrome`` works too) loads a copy of the page from a temp dir
with every network request sent to a dead proxy and every host name unresolvable, so a page that
needs the network (a ``<script src=https://cdn...>``) fails like a JavaScript error would. A small
script put first in the copy's ``<head>`` records, on the ``<html>`` element, every uncaught
error (a syntax error in the inline plotly.js included), unhandled promise rejection,
``console.error`` call and resource that failed to load. ``--dump-dom`` prints the DOM once the
page has run (``--virtual-time-budget``: timers and animation frames run on virtual time, so a
slow machine does not cut rendering short); the check then reads, for each figure the page
says it draws (``<meta name="autotune-figures">``, written by :mod:`autotune.report.html`, plus
any the caller expects), whether its ``div.figure[data-figure=NAME]`` holds a drawn plotly plot
(a ``.js-plotly-plot`` with an ``svg.main-svg``). A screenshot, when asked for, is a second run
with the window as tall as the page measured in the first (capped at 16,384 px).
No DevTools protocol: the page itself reports, so only Chromium's command line is needed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from autotune.report.html import FIGURES_META

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
MAX_SCREENSHOT_HEIGHT = 16384
_PROBE = """<script>(function(){var errors=[],root=document.documentElement;
function add(m){errors.push(String(m).slice(0,500));root.setAttribute('data-autotune-errors',JSON.stringify(errors));}
window.addEventListener('error',function(e){var t=e.target;if(t&&t!==window&&(t.src||t.href)){add('failed to load '+(t.src||t.href));}
else{add((e.message||'error')+' at '+(e.filename||'?')+':'+(e.lineno||'?'));}},true);
window.addEventListener('unhandledrejection',function(e){var r=e.reason;add('unhandled rejection: '+(r&&(r.stack||r.message)||r));});
var original=console.error;console.error=function(){add('console.error: '+Array.prototype.map.call(arguments,String).join(' '));return original.apply(console,arguments);};
window.addEventListener('load',function(){setTimeout(function(){root.setAttribute('data-autotune-height',String(Math.max(root.scrollHeight,document.body?document.body.scrollHeight:0)));},0);});
})();</script>"""


class BrowserError(RuntimeError):
    """Chromium is missing, failed or timed out (not a verdict on the page)."""


@dataclass(kw_only=True)
class PageCheck:
    """What Chromium found on a report page."""

    figures: list[str]
    """The figures the page should draw: its ``autotune-figures`` meta, then any the caller expects."""
    rendered: list[str] = field(default_factory=list)
    """Figures whose div holds a drawn plotly plot."""
    num_plots: int = 0
    """``.js-plotly-plot`` divs in the rendered page (inside a figure div or not)."""
    absent: list[str] = field(default_factory=list)
    """Figures the page says it could not draw, with a line saying why (``p.absent[data-absent]``)."""
    errors: list[str] = field(default_factory=list)
    """JavaScript errors, ``console.error`` calls and failed loads, in order."""
    height_px: int | None = None
    screenshot: Path | None = None

    @property
    def missing(self) -> list[str]:
        return [name for name in self.figures if name not in self.rendered]

    @property
    def ok(self) -> bool:
        return not self.errors and not self.missing and self.num_plots >= len(self.figures)

    def describe(self) -> list[str]:
        lines = [
            f"{'ok' if self.ok else 'FAILED'}: {len(self.rendered)} of {len(self.figures)} figures drawn, {self.num_plots} plotly plots, {len(self.errors)} errors"
        ]
        lines += [f"  figure {name}: {'drawn' if name in self.rendered else 'MISSING'}" for name in self.figures]
        lines += [f"  absent (the page says why): {name}" for name in self.absent]
        lines += [f"  error: {e}" for e in self.errors]
        if self.screenshot:
            lines.append(f"  screenshot: {self.screenshot}")
        return lines


class _DomReader(HTMLParser):
    """Reads the dumped DOM: root attributes, figure divs and whether each holds a drawn plot."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root_attrs: dict[str, str] = {}
        self.meta_figures: list[str] | None = None
        self.wrapped: dict[str, dict[str, bool]] = {}
        self.absent: list[str] = []
        self.num_plots = 0
        self._figure: str | None = None
        self._depth = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        classes = set(a.get("class", "").split())
        if tag == "html" and not self.root_attrs:
            self.root_attrs = a
        elif tag == "meta" and a.get("name") == FIGURES_META:
            self.meta_figures = [n for n in a.get("content", "").split(",") if n]
        elif tag == "p" and "data-absent" in a:
            self.absent.append(a["data-absent"])
        if "js-plotly-plot" in classes:
            self.num_plots += 1
        if self._figure is not None:
            seen = self.wrapped[self._figure]
            seen["plot"] |= "js-plotly-plot" in classes
            seen["svg"] |= tag == "svg" and "main-svg" in classes
            self._depth += tag == "div"
        elif tag == "div" and "data-figure" in a:
            self._figure, self._depth = a["data-figure"], 1
            self.wrapped[self._figure] = {"plot": False, "svg": False}

    def handle_endtag(self, tag: str) -> None:
        if self._figure is not None and tag == "div":
            self._depth -= 1
            if self._depth == 0:
                self._figure = None


def find_chromium() -> str | None:
    """The first Chromium-like browser on PATH, or None."""
    return next((path for name in CHROMIUM_NAMES if (path := shutil.which(name))), None)


def _run_chromium(chromium: str, profile: Path, url: str, extra: list[str], timeout_s: float) -> str:
    command = [
        chromium,
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--proxy-server=http://127.0.0.1:9",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--hide-scrollbars",
        *extra,
        url,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise BrowserError(f"{chromium} did not finish {url} within {timeout_s:.0f} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BrowserError(f"{chromium} exited with {done.returncode}: {last}")
    return done.stdout


def check_page(
    page: str | Path,
    *,
    screenshot: str | Path | None = None,
    expect: list[str] | None = None,
    chromium: str | None = None,
    budget_ms: int = 30000,
    timeout_s: float = 300.0,
) -> PageCheck:
    """Load ``page`` offline in headless Chromium (see [Note: browser check]); raises
    :class:`BrowserError` when Chromium itself is missing or fails, returns the findings otherwise."""
    chromium = chromium or find_chromium()
    if chromium is None:
        raise BrowserError(
            f"no Chromium on PATH (looked for {', '.join(CHROMIUM_NAMES)}; Debian: apt-get install chromium)"
        )
    text = Path(page).read_text(encoding="utf-8")
    head = text.find("<head>")
    probed = text[: head + 6] + _PROBE + text[head + 6 :] if head >= 0 else _PROBE + text
    with tempfile.TemporaryDirectory(prefix="autotune-browser-") as tmp:
        copy = Path(tmp) / "page.html"
        copy.write_text(probed, encoding="utf-8")
        url = copy.resolve().as_uri()
        dom = _run_chromium(
            chromium, Path(tmp) / "profile", url, [f"--virtual-time-budget={budget_ms}", "--dump-dom"], timeout_s
        )
        reader = _DomReader()
        reader.feed(dom)
        if not reader.root_attrs:
            raise BrowserError(f"{chromium} printed no DOM for {page}")
        figures = list(dict.fromkeys([*(reader.meta_figures or list(reader.wrapped)), *(expect or [])]))
        check = PageCheck(
            figures=figures,
            num_plots=reader.num_plots,
            absent=reader.absent,
            rendered=[name for name, seen in reader.wrapped.items() if seen["plot"] and seen["svg"]],
            errors=json.loads(reader.root_attrs.get("data-autotune-errors", "[]")),
        )
        height = reader.root_attrs.get("data-autotune-height", "")
        check.height_px = int(height) if height.isdigit() else None
        if screenshot is not None:
            target = Path(screenshot).resolve()
            target.parent.mkdir(parents=True, exist_ok=True)
            size = f"--window-size=1400,{min(check.height_px or 2000, MAX_SCREENSHOT_HEIGHT)}"
            _run_chromium(
                chromium,
                Path(tmp) / "profile",
                url,
                [f"--virtual-time-budget={budget_ms}", size, f"--screenshot={target}"],
                timeout_s,
            )
            if not target.exists():
                raise BrowserError(f"{chromium} wrote no screenshot at {target}")
            check.screenshot = target
    return check


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m autotune.report.browser", description="Check a report page in headless Chromium, offline."
    )
    parser.add_argument("page", type=Path, help="report.html")
    parser.add_argument("--screenshot", type=Path, help="write a full-page PNG here")
    parser.add_argument(
        "--expect", default="", help="comma-separated figure names that must be drawn (besides the page's own list)"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per Chromium run")
    args = parser.parse_args(argv)
    try:
        check = check_page(
            args.page,
            screenshot=args.screenshot,
            expect=[n for n in args.expect.split(",") if n],
            timeout_s=args.timeout,
        )
    except (BrowserError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(check.describe()))
    return 0 if check.ok else 1


if __name__ == "__main__":
    sys.exit(main())
