"""The built site looks right in a real browser: headless Chromium renders its pages.

The site is built once (`mkdocs build --strict`, with `tests/test_docs.py`'s helper: a warning
such as a page left out of the nav, a broken link or a missing anchor fails the test), served
from 127.0.0.1 and opened in Debian's `chromium`, driven by selenium through the system
`chromedriver`; the test installs both packages with apt-get when they are missing, and fails
(never skips) with the command to run when it cannot. The home page, the other top-level
pages and the tutorials are loaded at a laptop's viewport and laid out again at a phone's
(the API pages are left out: their links are checked by the build), and the test fails on:

- a missing image: an `<img>` that did not load (`naturalWidth` 0), or any file of the site
  (stylesheet, script, image) that the server answered with an error;
- a broken link: an `href` into the site whose page the server does not have, or whose
  `#anchor` names no `id` on that page;
- a page wider than the viewport (`scrollWidth > innerWidth`), naming the elements that stick
  out, at either viewport;
- on the pages of `WHOLE_TABLES` (the performance page's wide figures among them), a table
  wider than the content at the laptop viewport: the theme lets it scroll sideways inside its
  box, so its right-hand columns are cut off until the reader scrolls;
- a navigation entry listed twice, or a nav title that is not the page's own title (or its
  first words, before a colon).

Set `EQPAR_SITE_SCREENSHOTS=<folder>` to keep a full-page screenshot of every page at each
viewport (`<page>-<viewport>.png`); by default none is written.
"""

import base64
import collections
import contextlib
import dataclasses
import fcntl
import functools
import html.parser
import http.server
import os
import shutil
import subprocess
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from test_docs import DOCS, PAGES, mkdocs_build

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
APT_PACKAGES = ("chromium", "chromium-driver")
INSTALL_COMMAND = f"apt-get install -y {' '.join(APT_PACKAGES)}"
INSTALL_TIMEOUT_SECONDS = 900
INSTALL_LOCK = Path("/tmp/eqpar-chromium-install.lock")  # the xdist workers install once
SCREENSHOTS_VARIABLE = "EQPAR_SITE_SCREENSHOTS"
LAPTOP = "laptop"
VIEWPORTS = {LAPTOP: (1280, 800), "phone": (390, 844)}  # CSS pixels: width, height
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",  # root in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",  # screenshots show the page, not the machine's scrollbars
    # No calls home: on a machine without network they fail, and Chromium then refuses to run.
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# Pages whose tables must show whole at the laptop viewport, without scrolling inside their box.
WHOLE_TABLES = frozenset({"docs/index.md", "docs/faq.md", "docs/performance.md"})
FIX_CLIPPED_TABLE = (
    "split the table into narrower ones (the key columns repeated), drop columns, or put the "
    "figures in a chart"
)
FIX_OVERFLOW = (
    "let it wrap or scroll inside the content (e.g. `overflow-x: auto`, or "
    "`overflow-wrap: anywhere`) in docs/stylesheets/extra.css"
)


# ---------------------------------------------------------------------------------------------
# Chromium, the site and its server.


def ensure_chromium() -> None:
    """Install Debian's chromium and chromium-driver with apt-get, unless they are there."""
    if CHROMIUM.is_file() and CHROMEDRIVER.is_file():
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.fail(
            f"the site check needs {CHROMIUM} and {CHROMEDRIVER} (Debian's "
            f"{' and '.join(APT_PACKAGES)} packages) and cannot install them here (apt-get "
            f"needs root on Debian); install them, then run the tests again:\n"
            f"    sudo apt-get update && sudo {INSTALL_COMMAND}"
        )
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    with open(INSTALL_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be installing them right now
        if CHROMIUM.is_file() and CHROMEDRIVER.is_file():
            return
        for command in (
            ["apt-get", "update", "-qq"],
            ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES],
        ):
            result = subprocess.run(
                command,
                env=environment,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=INSTALL_TIMEOUT_SECONDS,
                check=False,
            )
            if result.returncode != 0:
                pytest.fail(
                    f"`{' '.join(command)}` failed (exit {result.returncode}), so the site "
                    f"cannot be checked in Chromium; run `apt-get update && "
                    f"{INSTALL_COMMAND}` by hand and see why:\n"
                    f"{(result.stdout + result.stderr)[-3000:]}"
                )
    assert CHROMIUM.is_file() and CHROMEDRIVER.is_file(), f"apt-get did not install {CHROMIUM}"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # the server would print every request
        pass


@contextlib.contextmanager
def serve(root: Path) -> Iterator[str]:
    """Serve the folder `root` on a free port of 127.0.0.1; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


_STILL_JS = """
document.addEventListener("DOMContentLoaded", () => {
  const style = document.createElement("style");
  style.textContent = "*, *::before, *::after { transition: none !important; "
    + "animation: none !important; }";
  document.head.append(style);
});
"""


def start_chromium(profile: Path) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # The driver's path is given, so selenium does not try to download one.
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))
    # A page measured right after a change of viewport must show its final layout, not one
    # halfway through the theme's transitions (the search field's width animates).
    driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": _STILL_JS})
    return driver


def set_viewport(driver: webdriver.Chrome, width: int, height: int) -> None:
    driver.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
    )


def save_screenshot(driver: webdriver.Chrome, path: Path) -> None:
    """The whole page, not only the part in the viewport."""
    shot = driver.execute_cdp_cmd(
        "Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}
    )
    path.write_bytes(base64.b64decode(shot["data"]))


# ---------------------------------------------------------------------------------------------
# What a page shows, read in the browser.

# `describe(element)`: the element as a reader finds it: tag, id and classes, its first words,
# and the heading it sits under (or the part of the page, outside the content).
_DESCRIBE_JS = r"""
const describe = (el) => {
  const words = (el.textContent || el.getAttribute("alt") || el.getAttribute("src") || "")
    .replace(/\s+/g, " ").replace("\u00b6", "").trim();
  const tag = el.tagName.toLowerCase() + (el.id ? "#" + el.id : "")
    + [...el.classList].map((c) => "." + c).join("");
  const article = el.closest("article");
  let where = "outside the content";
  if (article) {
    where = "at the top of the content";
    for (const h of article.querySelectorAll("h1, h2, h3, h4, h5, h6")) {
      if (!(h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING)) break;
      where = `under the heading "${h.textContent.replace("\u00b6", "").trim()}"`;
    }
  } else {
    const part = el.closest("header, nav, footer, .md-sidebar, .md-header, .md-footer");
    const name = part && part.classList.length ? "." + part.classList[0] : "";
    if (part) where = `in <${part.tagName.toLowerCase()}${name}>`;
  }
  const shown = words.length > 60 ? words.slice(0, 57) + "..." : words;
  return `<${tag}>${shown ? ` "${shown}"` : ""} ${where}`;
};
"""

# Waits for every image (lazy ones too) to load or fail, then reads the page.
_INSPECT_JS = (
    "const done = arguments[arguments.length - 1];\n"
    + _DESCRIBE_JS
    + r"""
const text = (el) => el ? el.textContent.replace("\u00b6", "").replace(/\s+/g, " ").trim() : null;
const shown = (el) =>
  el.getClientRects().length > 0 && getComputedStyle(el).visibility !== "hidden";
(async () => {
  const images = [...document.images];
  images.forEach((img) => { img.loading = "eager"; });
  const loaded = Promise.all(images.map((img) => img.decode().catch(() => null)));
  await Promise.race([loaded, new Promise((resolve) => setTimeout(resolve, 10000))]);
  const primary = document.querySelector(".md-nav--primary");
  done({
    missing_images: images.filter((img) => img.naturalWidth === 0)
      .map((img) => [img.src, img.getAttribute("src"), describe(img)]),
    failed_files: performance.getEntriesByType("resource")
      .filter((e) => e.name.startsWith(location.origin) && e.responseStatus >= 400)
      .map((e) => [e.name, e.responseStatus]),
    links: [...document.querySelectorAll("a[href]")]
      .map((a) => [a.href, a.getAttribute("href"), describe(a)]),
    heading: text(document.querySelector("article h1")),
    nav_title: primary ? text(primary.querySelector("a.md-nav__link--active")) : null,
    nav_links: primary ? [...primary.querySelectorAll("a.md-nav__link")].filter(shown)
      .map((a) => [a.href, text(a)]) : [],
  });
})();
"""
)

# Whether the page is wider than the viewport, and which outermost elements stick out of it
# (not those inside something that scrolls or clips them sideways).
_OVERFLOW_JS = (
    _DESCRIBE_JS
    + r"""
const root = document.documentElement;
const width = window.innerWidth;
if (root.scrollWidth <= width) return null;
const held = (el) => {
  for (let p = el.parentElement; p && p !== document.body && p !== root; p = p.parentElement) {
    if (getComputedStyle(p).overflowX !== "visible") return true;
  }
  return false;
};
const outside = [];
for (const el of document.body.querySelectorAll("*")) {
  const box = el.getBoundingClientRect();
  if (box.width === 0 || box.right <= width + 0.5) continue;
  if (outside.some((o) => o.contains(el)) || held(el)) continue;
  outside.push(el);
}
return [root.scrollWidth, width, outside.slice(0, 5)
  .map((el) => `${describe(el)}, ${Math.round(el.getBoundingClientRect().width)} px wide`
    + ` with its right edge at ${Math.round(el.getBoundingClientRect().right)} px`)];
"""
)


# The tables of the content wider than the box that holds them (the theme's scrolling wrapper,
# or the article), with their width and the room they had.
_CLIPPED_TABLES_JS = (
    _DESCRIBE_JS
    + r"""
const clipped = [];
for (const table of document.querySelectorAll("article table")) {
  let box = table.closest("article");
  for (let p = table.parentElement; p && p !== box; p = p.parentElement) {
    if (getComputedStyle(p).overflowX !== "visible") { box = p; break; }
  }
  const room = Math.min(box.clientWidth, table.closest("article").clientWidth);
  const width = Math.max(table.scrollWidth, Math.ceil(table.getBoundingClientRect().width));
  if (width > room + 0.5) clipped.push(`${describe(table)}: ${width} px wide in ${room} px`);
}
return clipped;
"""
)


@dataclasses.dataclass(frozen=True)
class PageReport:
    url: str
    source: str  # the Markdown file it is built from, for the messages
    missing_images: list[tuple[str, str, str]]  # (URL, src as written, where)
    failed_files: list[tuple[str, int]]  # (url, HTTP status)
    links: list[tuple[str, str, str]]  # (resolved URL, href as written, where)
    heading: str | None  # the page's <h1>
    nav_title: str | None  # the active entry of the navigation
    nav_links: list[tuple[str, str]]  # (URL, title) of every visible entry of the navigation
    overflow: dict[str, tuple[int, int, list[str]]]  # viewport -> (scrollWidth, width, culprits)
    clipped_tables: list[str] = dataclasses.field(default_factory=list)  # at the laptop viewport


class Browser:
    """Chromium, and the viewport it lays pages out at now."""

    def __init__(self, driver: webdriver.Chrome):
        self.driver = driver
        self.viewport: str | None = None

    def resize(self, viewport: str) -> None:
        if viewport != self.viewport:
            width, height = VIEWPORTS[viewport]
            set_viewport(self.driver, width, height)
            self.viewport = viewport


def inspect_page(browser: Browser, url: str, source: str, screenshots: Path | None) -> PageReport:
    """Load `url` once and lay it out at each viewport of VIEWPORTS in turn.

    The viewport it is at stays first (a new layout costs more than the checks): the next page
    then starts where this one ends. Images, links and the navigation are read at the laptop
    viewport, where the navigation is a sidebar.
    """
    order = sorted(VIEWPORTS, key=lambda viewport: viewport != browser.viewport)
    browser.resize(order[0])
    browser.driver.get(url)
    found, overflow, clipped = None, {}, []
    for viewport in order:
        browser.resize(viewport)
        if viewport == LAPTOP:
            found = browser.driver.execute_async_script(_INSPECT_JS)
            clipped = browser.driver.execute_script(_CLIPPED_TABLES_JS)
        wide = browser.driver.execute_script(_OVERFLOW_JS)
        if wide is not None:
            overflow[viewport] = (wide[0], wide[1], wide[2])
        if screenshots is not None:
            slug = urllib.parse.urlsplit(url).path.strip("/").replace("/", "_") or "index"
            save_screenshot(browser.driver, screenshots / f"{slug}-{viewport}.png")
    assert found is not None
    return PageReport(
        url=url,
        source=source,
        missing_images=[tuple(item) for item in found["missing_images"]],
        failed_files=[tuple(item) for item in found["failed_files"]],
        links=[tuple(item) for item in found["links"]],
        heading=found["heading"],
        nav_title=found["nav_title"],
        nav_links=[tuple(item) for item in found["nav_links"]],
        overflow={viewport: overflow[viewport] for viewport in VIEWPORTS if viewport in overflow},
        clipped_tables=list(clipped),
    )


# ---------------------------------------------------------------------------------------------
# The checks.


class _Anchors(html.parser.HTMLParser):
    """The anchors of an HTML page: every id, and the names of <a name=...>."""

    def __init__(self):
        super().__init__()
        self.anchors: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if value and (name == "id" or (tag == "a" and name == "name")):
                self.anchors.add(value)


def fetch(url: str) -> tuple[int, set[str] | None]:
    """The HTTP status of `url` and, for an HTML page, its anchors."""
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            status, kind, body = (
                response.status,
                response.headers.get_content_type(),
                response.read(),
            )
    except urllib.error.HTTPError as error:
        return error.code, None
    if kind != "text/html":
        return status, None
    parser = _Anchors()
    parser.feed(body.decode("utf-8", "replace"))
    return status, parser.anchors


def link_problems(reports: list[PageReport], base: str) -> list[str]:
    """A message for every link into the site whose page or #anchor does not exist."""
    targets: dict[str, tuple[int, set[str] | None]] = {}
    problems = []
    for report in reports:
        seen = set()
        for url, written, where in report.links:
            if not url.startswith(base) or url in seen:
                continue  # another site's page (not reachable from here), or checked already
            seen.add(url)
            page, fragment = urllib.parse.urldefrag(url)
            if page not in targets:
                targets[page] = fetch(page)
            status, anchors = targets[page]
            if status != 200:
                problems.append(
                    f"{report.source}: the link {where} (href={written!r}) leads to "
                    f"/{page.removeprefix(base)}, which the site does not have (HTTP {status}); "
                    "point it at an existing page (a link to another page of docs/ is written "
                    "as the relative path of its .md file)"
                )
            elif fragment and anchors is not None and urllib.parse.unquote(fragment) not in anchors:
                problems.append(
                    f"{report.source}: the link {where} (href={written!r}) names the anchor "
                    f"#{fragment}, which /{page.removeprefix(base)} does not have; use the "
                    "anchor of an existing heading (shown by its permalink) or object"
                )
    return problems


def title_agrees(nav_title: str, heading: str, *, home: bool) -> bool:
    """A nav title is the page's own title, or its first words (before a colon)."""
    if home and nav_title == "Home":  # the home page's entry reads "Home", whatever its title
        return True
    return heading == nav_title or heading.startswith(f"{nav_title}:")


def page_problems(report: PageReport, base: str) -> list[str]:
    """A message for each missing image or file, viewport overflow and nav disagreement."""
    problems = []
    for _, src, where in report.missing_images:
        problems.append(
            f"{report.source}: the image {where} (src={src!r}) did not load; put the file "
            "where the src points (docs/images/) or fix the src"
        )
    images = {url for url, _, _ in report.missing_images}
    for url, status in report.failed_files:
        if url in images:
            continue  # reported above
        problems.append(
            f"{report.source}: the site's file /{url.removeprefix(base)} is missing "
            f"(HTTP {status}); fix the reference to it (mkdocs.yml extra_css, an image's src)"
        )
    for viewport, (scroll_width, width, culprits) in report.overflow.items():
        problems.append(
            f"{report.source}: at the {viewport} viewport ({width} px) the page is "
            f"{scroll_width} px wide and scrolls sideways; what sticks out:\n    "
            + "\n    ".join(culprits or ["(no single element: look for negative margins)"])
            + f"\n  fix: {FIX_OVERFLOW}"
        )
    if report.source in WHOLE_TABLES:
        width = VIEWPORTS[LAPTOP][0]
        for table in report.clipped_tables:
            problems.append(
                f"{report.source}: at the {LAPTOP} viewport ({width} px) the table {table} "
                f"and scrolls sideways inside its box, its last columns cut off; fix: "
                f"{FIX_CLIPPED_TABLE}"
            )
    if report.nav_title is not None and report.heading is not None:
        home = urllib.parse.urlsplit(report.url).path == urllib.parse.urlsplit(base).path
        if not title_agrees(report.nav_title, report.heading, home=home):
            problems.append(
                f"{report.source}: the navigation calls the page {report.nav_title!r} but its "
                f"title is {report.heading!r}; make the nav title in mkdocs.yml the page's "
                "title or its first words before a colon"
            )
    urls = collections.Counter(url for url, _ in report.nav_links if "#" not in url)
    for url, count in sorted(urls.items()):
        if count > 1:
            titles = [title for link, title in report.nav_links if link == url]
            problems.append(
                f"{report.source}: the navigation lists /{url.removeprefix(base)} {count} "
                f"times ({titles}); list each page once in mkdocs.yml's nav (a section's "
                "index.md is the section's own page with navigation.indexes)"
            )
    return problems


# ---------------------------------------------------------------------------------------------
# The tests.


def page_path(page: Path) -> str:
    """Where mkdocs puts `page` (a file of docs/), relative to the site's root: "a/b/"."""
    parts = page.relative_to(DOCS).with_suffix("").parts
    if parts[-1] == "index":
        parts = parts[:-1]
    return "".join(f"{part}/" for part in parts)


# The home page, the other top-level pages and the tutorials; the API pages are left out to keep
# the test quick (mkdocs --strict and mkdocstrings check their links already).
RENDERED_PAGES = sorted(
    (page for page in PAGES if page.parent in (DOCS, DOCS / "tutorials")),
    key=lambda page: page != DOCS / "index.md",  # the home page first
)


@pytest.fixture(scope="module")
def browser(tmp_path_factory) -> Iterator[Browser]:
    ensure_chromium()
    driver = start_chromium(tmp_path_factory.mktemp("chromium-profile"))
    try:
        yield Browser(driver)
    finally:
        driver.quit()


def screenshot_folder() -> Path | None:
    folder = os.environ.get(SCREENSHOTS_VARIABLE)
    if not folder:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    return Path(folder)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built strictly (the suite's only build: tests/test_docs.py has none)."""
    site = tmp_path_factory.mktemp("site") / "site"
    result = mkdocs_build(site)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{log}"
    assert "WARNING" not in log and "ERROR" not in log, log
    assert (site / "index.html").is_file()
    return site


def test_site_builds_strictly_and_renders_in_chromium(site, browser):
    # `site` comes first: a build that fails is reported even where Chromium is missing.
    screenshots = screenshot_folder()
    with serve(site) as base:
        reports = [
            inspect_page(
                browser, base + page_path(page), f"docs/{page.relative_to(DOCS)}", screenshots
            )
            for page in RENDERED_PAGES
        ]
        problems = [p for report in reports for p in page_problems(report, base)]
        problems += link_problems(reports, base)
    unread = [report.source for report in reports if not report.nav_links or not report.nav_title]
    assert not unread, f"the check found no navigation (or no current entry in it) on {unread}"
    assert not problems, (
        f"{len(problems)} problems in the site as Chromium shows it:\n" + "\n".join(problems)
    )


WRONG_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Wrong</title>
<link rel="icon" href="data:,"><link rel="stylesheet" href="lost.css"></head>
<body><article>
<h1>Wrong</h1>
<p><a href="other.html#there">a good link</a> <a href="#pictures">a link on the page</a>
<a href="other.html#nowhere">a lost anchor</a> <a href="gone/">a lost page</a>
<a href="https://example.com/">another site</a></p>
<h2 id="pictures">Pictures</h2>
<img src="images/lost.png" alt="a lost picture"> <img src="images/found.svg" alt="a picture">
<div style="overflow-x: auto"><pre style="width: 3000px">scrolls inside its box</pre></div>
<pre class="wide" style="width: 2000px">sticks out</pre>
<div class="narrow-only" style="width: 600px">sticks out of a phone</div>
</article></body></html>
"""
OTHER_PAGE = '<!doctype html><html><body><h2 id="there">There</h2></body></html>'
PICTURE = '<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"></svg>'


def test_site_check_finds_missing_images_broken_links_and_wide_pages(browser, tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "found.svg").write_text(PICTURE)
    (tmp_path / "wrong.html").write_text(WRONG_PAGE)
    (tmp_path / "other.html").write_text(OTHER_PAGE)
    with serve(tmp_path) as base:
        report = inspect_page(browser, base + "wrong.html", "wrong.md", None)
        problems = page_problems(report, base) + link_problems([report], base)
    assert len(problems) == 6, "\n".join(problems)
    image, stylesheet, laptop, phone, anchor, page = problems
    assert 'wrong.md: the image <img> "a lost picture" under the heading "Pictures"' in image
    assert "src='images/lost.png'" in image
    assert "/lost.css is missing (HTTP 404)" in stylesheet
    assert "laptop viewport (1280 px) the page is 2" in laptop
    assert '<pre.wide> "sticks out" under the heading "Pictures", 2000 px wide' in laptop
    assert "narrow-only" not in laptop and "scrolls inside" not in laptop
    assert "phone viewport (390 px)" in phone and "narrow-only" in phone
    assert "href='other.html#nowhere'" in anchor and "#nowhere, which /other.html" in anchor
    assert "href='gone/'" in page and "/gone/, which the site does not have (HTTP 404)" in page


CLIPPED_TABLES_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>Tables</title><link rel="icon" href="data:,"></head>
<body><article style="max-width: 600px">
<h1>Tables</h1>
<h2 id="narrow">Narrow</h2>
<div style="overflow-x: auto"><table><tr><th>fits</th><td>1</td></tr></table></div>
<h2 id="wide">Wide</h2>
<div style="overflow-x: auto"><table><tr><th>too wide</th><td style="min-width: 900px">x</td>
</tr></table></div>
</article></body></html>
"""


def test_site_check_finds_tables_cut_off_by_their_box(browser, tmp_path):
    # The page itself does not overflow: the wide table scrolls inside its box, which hides its
    # right-hand side at the laptop viewport. Only pages of WHOLE_TABLES are held to it.
    (tmp_path / "tables.html").write_text(CLIPPED_TABLES_PAGE)
    with serve(tmp_path) as base:
        report = inspect_page(browser, base + "tables.html", "docs/performance.md", None)
        problems = page_problems(report, base)
        other = dataclasses.replace(report, source="docs/other.md")
        assert page_problems(other, base) == []
    assert len(problems) == 1, "\n".join(problems)
    assert '<table> "too widex" under the heading "Wide": 9' in problems[0]
    assert "px wide in 600 px and scrolls sideways inside its box" in problems[0]
    assert "split the table" in problems[0]
