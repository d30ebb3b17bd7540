"""The course website (`make site`, tools/website.py) in headless Chromium, served over HTTP as a static host would.

Every page loads without a console error; every internal link, its #fragment and every image resolve; each chapter
shows its Colab badge and its stored figures, with the twelve chapters in order in the sidebar; the search box finds
a term that only chapter 08 uses; screenshots go to build/screenshots/. A negative control plants a broken link, a
missing image, a missing fragment and a console error in a copy of the site, and the same checks report each one.

The site tested is the one `make site` built when ACCEL_SITE_DIR names it (`make test-site`: built once, tested
here); otherwise these tests build one into a temporary folder with .venv-site's Sphinx, and skip when that
toolchain is not installed (`make site` installs it). The Chromium is test_browser.py's, found the same way: none
skips these tests, or fails them under ACCEL_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

# make test-compat's environment has no Playwright (and leaves test_browser.py out): nothing here can run there.
sync_playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed").sync_playwright

from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, SHOTS  # noqa: E402  (skips or fails as there, without a Chromium)
from tools import website  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SITE_PYTHON = ROOT / ".venv-site" / "bin" / "python"
CHAPTERS = website.chapters(ROOT)
CH08 = "notebooks/08_quantization_onnx_fpga.html"
# An ONNX operator that chapter 08's int8 section calls by name, and no other page uses (the search test checks both).
CH08_TERM = "DequantizeLinear"
# MathJax typesets after the load event; wait for its queue so a screenshot shows formulas, not TeX.
_MATHJAX_DONE_JS = "() => new Promise(done => window.MathJax?.Hub ? MathJax.Hub.Queue(() => done(true)) : done(false))"
_PAGE_FACTS_JS = """() => ({
  links: [...document.querySelectorAll('a[href]')].map(a => a.href),
  images: [...document.images]
    .map(i => ({src: i.currentSrc || i.src, alt: i.alt, loaded: i.complete && i.naturalWidth > 0})),
  sidebar: [...document.querySelectorAll('nav.bd-docs-nav a.reference.internal')].map(a => a.href),
  badges: [...document.querySelectorAll('a[href^="https://colab.research.google.com/github/"]')]
    .map(a => ({href: a.href, loaded: [...a.querySelectorAll('img')].some(i => i.complete && i.naturalWidth > 0)})),
  figures: document.querySelectorAll('.cell_output img').length,
  formulas: [...document.querySelectorAll('.math.nohighlight')]  // Sphinx's; MathJax's own output has class math too
    .map(e => !!e.querySelector('.MathJax, .MathJax_Display')),
  next: document.querySelector('a.right-next')?.href ?? null,
  title: document.querySelector('h1')?.textContent.replace(/#$/, '').trim() ?? null,
})"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The built site: `make site`'s (ACCEL_SITE_DIR), or one built here into a temporary folder."""
    named = os.environ.get("ACCEL_SITE_DIR")
    if named:
        path = (ROOT / named).resolve()
        if not (path / "index.html").is_file():
            pytest.fail(f"ACCEL_SITE_DIR={named!r} holds no built site (no index.html): run `make site` first")
        return path
    if not SITE_PYTHON.exists():
        if os.environ.get("ACCEL_REQUIRE_BROWSER") == "1":  # CI: make test installs .venv-site first
            pytest.fail("ACCEL_REQUIRE_BROWSER=1 but .venv-site is missing: `make test` installs it")
        pytest.skip("the website's toolchain (.venv-site) is not installed: `make site` installs it and builds the "
                    "site, `make test-site` then runs these tests on it")
    out = tmp_path_factory.mktemp("site") / "site"
    t0 = time.monotonic()
    r = subprocess.run([str(SITE_PYTHON), str(ROOT / "tools" / "website.py"), str(out)], capture_output=True, text=True,
                       cwd=ROOT, timeout=900)
    assert r.returncode == 0, f"tools/website.py failed:\n{r.stdout}\n{r.stderr}"
    print(f"site built in {time.monotonic() - t0:.0f} s")
    return out


class _Handler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no access log in the test output
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a browser leaving a page mid-transfer is no error
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(directory: Path):
    """Python's http.server on 127.0.0.1 (a free port) serving `directory`; yields its base URL."""
    server = _Server(("127.0.0.1", 0), functools.partial(_Handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


@pytest.fixture(scope="module")
def base(site):
    with serve(site) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)  # a fresh temporary profile
        try:
            yield b
        finally:
            b.close()


def _new_page(browser):
    context = browser.new_context(viewport={"width": 1440, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(60_000)
    pg.console_errors = []
    pg.on("pageerror", lambda e: pg.console_errors.append(f"page error: {e}"))
    pg.on("console", lambda m: pg.console_errors.append(f"{m.text} ({m.location.get('url')})")
          if m.type == "error" else None)
    return context, pg


@pytest.fixture()
def page(browser):
    context, pg = _new_page(browser)
    yield pg
    context.close()


class Resolver:
    """HTTP status and HTML ids of the site's URLs, each fetched once."""

    def __init__(self):
        self._cache: dict[str, tuple[int, set[str]]] = {}

    def __len__(self) -> int:
        return len(self._cache)

    def get(self, url: str) -> tuple[int, set[str]]:
        if url not in self._cache:
            try:
                with urllib.request.urlopen(url, timeout=30) as r:
                    status, body = r.status, r.read()
                    html = r.headers.get_content_type() == "text/html"
            except urllib.error.HTTPError as e:
                status, body, html = e.code, b"", False
            ids = set(re.findall(r"""\b(?:id|name)=["']([^"']+)["']""", body.decode("utf-8", "replace"))) if html \
                else set()
            self._cache[url] = (status, ids)
        return self._cache[url]

    def problems(self, base: str, page_url: str, facts: dict) -> list[str]:
        """Internal links that do not answer 200 or name a missing #fragment; images that are not the site's own,
        do not answer 200 or did not load."""
        found = []
        for link in dict.fromkeys(facts["links"]):
            if not link.startswith(base):
                continue
            target, _, fragment = link.partition("#")
            status, ids = self.get(target)
            if status != 200:
                found.append(f"{page_url}: link {link} -> HTTP {status}")
            elif fragment and urllib.parse.unquote(fragment) not in ids and target.endswith(".html"):
                found.append(f"{page_url}: link {link} -> no id {fragment!r} in {target}")
        for img in facts["images"]:
            if not img["src"].startswith(base):
                found.append(f"{page_url}: image {img['src']} is loaded from another site")
                continue
            status, _ = self.get(img["src"])
            if status != 200 or not img["loaded"]:
                found.append(f"{page_url}: image {img['src']} -> HTTP {status}, loaded: {img['loaded']}")
        return found


def visit(pg, base: str, rel: str, resolver: Resolver) -> tuple[dict, list[str]]:
    """Open one page, let it settle (network idle, MathJax typeset); its facts, and its problems: console errors,
    unresolved links and images."""
    pg.console_errors.clear()
    pg.goto(base + rel, wait_until="networkidle")
    pg.evaluate(_MATHJAX_DONE_JS)
    pg.wait_for_load_state("networkidle")
    facts = pg.evaluate(_PAGE_FACTS_JS)
    problems = [f"{rel}: console: {e}" for e in pg.console_errors] + resolver.problems(base, rel, facts)
    if not all(facts["formulas"]):
        problems.append(f"{rel}: {facts['formulas'].count(False)} of {len(facts['formulas'])} formulas not typeset")
    return facts, problems


def _pages(site: Path) -> list[str]:
    return sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html") if "_static" not in p.parts)


@pytest.fixture(scope="module")
def visited(site, base, browser):
    """Every HTML page of the site opened once in Chromium: {page: facts}, and every problem found."""
    context, pg = _new_page(browser)
    resolver, facts, problems = Resolver(), {}, []
    t0 = time.monotonic()
    try:
        for rel in _pages(site):
            facts[rel], found = visit(pg, base, rel, resolver)
            problems += found
    finally:
        context.close()
    print(f"{len(facts)} pages opened, {len(resolver)} distinct URLs checked in {time.monotonic() - t0:.0f} s")
    return facts, problems


def test_the_site_has_every_page(site):
    pages = set(_pages(site))
    latest = website.latest_course_run(ROOT / "results")
    expected = {"index.html", "search.html", "docs/guides.html", "docs/site.html", "results/index.html",
                *(f"notebooks/{nb.stem}.html" for nb in CHAPTERS), "solutions/index.html",
                *(f"solutions/{nb.stem}.html" for nb in CHAPTERS)}
    if latest is not None:
        expected.add(f"results/{latest.name}/report.html")
    assert expected <= pages, f"pages missing from the site: {sorted(expected - pages)}"
    assert (site / "searchindex.js").is_file(), "no search index"


def test_every_page_loads_without_console_errors_and_every_link_and_image_resolves(visited):
    facts, problems = visited
    assert not problems, f"{len(problems)} problem(s):\n" + "\n".join(problems[:60])


def test_each_chapter_shows_its_badge_and_figures_in_chapter_order(visited, base):
    facts, _ = visited
    order = [f"{base}notebooks/{nb.stem}.html" for nb in CHAPTERS]
    for i, nb in enumerate(CHAPTERS):
        page = facts[f"notebooks/{nb.stem}.html"]
        cells = json.loads(nb.read_text())["cells"]
        outputs = [o for c in cells for o in c.get("outputs", [])]
        figures = sum(any(k.startswith("image/") for k in o.get("data", {})) for o in outputs)
        title = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"]).splitlines()[0]
        title = title.removeprefix("# ").strip()
        assert page["title"].replace("\u2019", "'") == title, (nb.name, page["title"])  # docutils' curly apostrophe
        assert [b["href"] for b in page["badges"]][:1] == [
            f"https://colab.research.google.com/github/{_slug()}/blob/{_release()}/notebooks/{nb.name}"], page["badges"]
        assert page["badges"][0]["loaded"], f"{nb.name}: the Colab badge's image did not load"
        assert page["figures"] == figures, f"{nb.name}: {page['figures']} figures shown, {figures} stored"
        chapters_in_sidebar = [h.partition("#")[0] for h in page["sidebar"] if "/notebooks/" in h]
        assert chapters_in_sidebar == order, f"{nb.name}: the sidebar's chapters: {chapters_in_sidebar}"
        if i + 1 < len(CHAPTERS):
            assert page["next"] == order[i + 1], f"{nb.name}: 'next' goes to {page['next']}"
    assert facts[CH08]["formulas"] and all(facts[CH08]["formulas"]), "chapter 08's formulas are not typeset"


def test_the_results_pages_show_the_latest_course_report(visited, base):
    facts, _ = visited
    latest = website.latest_course_run(ROOT / "results")
    if latest is None:
        pytest.skip("no course run recorded under results/")
    report = f"results/{latest.name}/report.html"
    assert f"{base}{report}" in facts["results/index.html"]["links"], "the results page does not link the report"
    assert f"{base}{report}" in facts["index.html"]["sidebar"], "the sidebar does not link the latest report"
    figures = sorted(p.stem for p in (latest / "results" / "figures").glob("*.png"))
    shown = sorted(i["alt"] for i in facts[report]["images"] if i["loaded"] and i["alt"] in figures)
    assert shown == figures, f"{report}: {len(shown)} of its {len(figures)} figures shown"


def test_search_finds_a_term_only_chapter_08_uses(page, base, site):
    sources = {p: p.read_text(errors="replace") for p in (site / "_sources").rglob("*") if p.is_file()}
    holders = sorted(p.relative_to(site / "_sources").as_posix() for p, text in sources.items() if CH08_TERM in text)
    assert holders == ["notebooks/08_quantization_onnx_fpga.ipynb"], \
        f"{CH08_TERM!r} is no longer chapter 08's alone ({holders}): pick another term for this test"
    page.goto(base + "index.html", wait_until="networkidle")
    page.keyboard.press("Control+k")  # the theme's shortcut, as its search button says
    box = page.locator("input[name=q]:visible").first
    box.fill(CH08_TERM)
    box.press("Enter")
    page.wait_for_url(re.compile(r"/search\.html\?q="))
    hits = page.locator("#search-results ul.search li a")
    hits.first.wait_for()
    found = sorted({urllib.parse.urlsplit(h).path.lstrip("/") for h in hits.evaluate_all("as => as.map(a => a.href)")})
    assert found == [CH08], f"searching {CH08_TERM!r} found {found}"
    assert not page.console_errors, page.console_errors


def test_screenshots_of_the_home_page_and_chapter_08(page, base):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.goto(base + "index.html", wait_until="networkidle")
    page.screenshot(path=SHOTS / "site_home.png", full_page=True)
    page.goto(base + CH08, wait_until="networkidle")
    page.evaluate(_MATHJAX_DONE_JS)
    page.screenshot(path=SHOTS / "site_ch08.png")
    assert not page.console_errors, page.console_errors


def test_the_checks_report_a_broken_link_image_fragment_and_console_error(site, browser, tmp_path):
    """Negative control: the home page of a copy of the site, with one of each fault planted, is reported for each
    of them and for nothing else."""
    copy = tmp_path / "site"
    shutil.copytree(site, copy)
    home = copy / "index.html"
    planted = ('<a href="notebooks/no_such_chapter.html">gone</a><img src="_images/no_such_figure.png" alt="gone">'
               f'<a href="{CH08}#no-such-cell">gone</a><script>console.error("planted error")</script>')
    home.write_text(home.read_text().replace("</body>", planted + "</body>", 1))
    context, pg = _new_page(browser)
    try:
        with serve(copy) as url:
            _, problems = visit(pg, url, "index.html", Resolver())
    finally:
        context.close()
    expected = {"no_such_chapter.html -> HTTP 404": 1, "no_such_figure.png -> HTTP 404": 1,
                "no id 'no-such-cell'": 1, "console: planted error": 1, "console: Failed to load resource": 1}
    for needle, count in expected.items():
        assert sum(needle in p for p in problems) == count, f"{needle!r} not reported once:\n" + "\n".join(problems)
    assert len(problems) == sum(expected.values()), "\n".join(problems)


def _slug() -> str:
    from accelhelpers.commands.links import repository

    return repository(ROOT).removeprefix("https://github.com/")


def _release() -> str:
    from accelhelpers.commands.links import release

    return release()
