"""report.html in a real headless browser (Debian's chromium): every image decodes, and the page renders.

The page itself carries no script; the test loads a copy with a small checker appended that records, on the
body element, how many images there are and which failed to decode (naturalWidth 0). `--dump-dom` prints the
document after the load event, so the attributes can be read back from it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from pilotrun.report.drawing.html import write_report
from pilotrun.report.record_check.summarize import summarize_run
from pilotrun.report.verdict.verdict import judge_summary
from tests.report.synthetic import crashed_and_resumed

CHECKER = """<script>
window.addEventListener('load', () => {
  const images = Array.from(document.images);
  const broken = images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt);
  document.body.setAttribute('data-images', String(images.length));
  document.body.setAttribute('data-broken', JSON.stringify(broken));
  document.body.setAttribute('data-links-ok', String(Array.from(document.querySelectorAll('a[href^="#"]'))
    .every(a => document.getElementById(a.getAttribute('href').slice(1)) !== null)));
});
</script>"""


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    pytest.skip(
        "no chromium on PATH (Debian: apt-get install -y chromium); the browser check needs a real one"
    )


def headless(browser: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                           "--virtual-time-budget=5000", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_every_image_of_the_report_loads_in_a_browser(tmp_path):
    browser = chromium()
    run = crashed_and_resumed(tmp_path / "r")
    run.write()
    report = write_report(judge_summary(summarize_run(tmp_path / "r")))
    page = (report / "report.html").read_text()
    checked = tmp_path / "checked.html"
    checked.write_text(page.replace("</body>", CHECKER + "</body>"))
    dom = headless(browser, "--dump-dom", checked.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body([^>]*)>", dom.stdout)
    assert body is not None, dom.stdout[:2000]
    attributes = dict(re.findall(r'(data-[a-z-]+)="([^"]*)"', body.group(1)))
    assert int(attributes["data-images"]) == page.count("<img ") >= 8
    assert json.loads(attributes["data-broken"].replace("&quot;", '"')) == []
    assert attributes["data-links-ok"] == "true"
    screenshot = tmp_path / "report.png"
    shot = headless(
        browser, f"--screenshot={screenshot}", "--window-size=1200,2400", (report / "report.html").as_uri()
    )
    assert shot.returncode == 0 and screenshot.stat().st_size > 10_000, shot.stderr[-2000:]
