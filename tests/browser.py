"""Headless Chromium (Debian's chromium and chromium-driver, driven by selenium; nothing downloaded at run time)
for the tests that open the HTML reports: the page's console messages, every request it made, its numbers and a
screenshot."""

from __future__ import annotations

import json
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def missing() -> str | None:
    """Why the browser cannot run here (`make install-test` installs both packages), or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).exists() and shutil.which(Path(path).name) is None:
            return f"{path} is not installed (Debian packages chromium and chromium-driver: `make install-test`)"
    return None


@contextmanager
def chromium(width: int = 1280, height: int = 900) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
              "--disable-extensions", "--disable-background-networking", "--disable-component-update",
              "--disable-sync", "--disable-default-apps", f"--window-size={width},{height}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def open_report(path: Path, screenshot: Path) -> dict[str, Any]:
    """Open ``path`` (file://), let its script run, and return what the page did: ``console`` (every console
    message: level and text), ``requests`` (every URL the page asked for other than itself and its data: URIs),
    ``tables`` (per table class, one {data-key: data-value} per row: every number the tables show), the page's text,
    the screenshot's distinct colours; the screenshot is written to ``screenshot`` (full page height)."""
    from selenium.webdriver.common.by import By

    url = path.resolve().as_uri()
    with chromium() as d:
        d.get(url)
        d.execute_script("return document.readyState")
        height = d.execute_script("return document.body.scrollHeight")
        d.set_window_size(1280, min(max(int(height) + 100, 900), 12000))
        tables: dict[str, list[dict[str, str]]] = {}
        for t in d.find_elements(By.CSS_SELECTOR, "table"):
            rows = [{td.get_attribute("data-key"): td.get_attribute("data-value")
                     for td in tr.find_elements(By.CSS_SELECTOR, "td[data-key]")}
                    for tr in t.find_elements(By.CSS_SELECTOR, "tbody tr")]
            tables.setdefault((t.get_attribute("class") or "").split(" ")[0], []).extend(rows)
        d.save_screenshot(str(screenshot))
        console = [{"level": e["level"], "text": e["message"]} for e in d.get_log("browser")]
        requests = []
        for e in d.get_log("performance"):
            msg = json.loads(e["message"])["message"]
            if msg.get("method") == "Network.requestWillBeSent":
                u = msg["params"]["request"]["url"]
                if u != url and not u.startswith("data:"):
                    requests.append(u)
        text = d.find_element(By.TAG_NAME, "body").text
        sort = sort_check(d)
    return {"console": console, "requests": requests, "tables": tables, "text": text, "sort": sort,
            "colours": colours(screenshot)}


def sort_check(d: Any) -> list[list[str]] | None:
    """The first column of the first sortable table before and after a click on its last numeric header, and
    after a second click: the page's own script sorts (ascending, then descending)."""
    from selenium.webdriver.common.by import By

    tables = d.find_elements(By.CSS_SELECTOR, "table.sortable")
    if not tables:
        return None
    t = tables[0]
    heads = t.find_elements(By.CSS_SELECTOR, "thead th")

    def values() -> list[str]:
        return [r.find_elements(By.CSS_SELECTOR, "td")[-1].get_attribute("data-value") or ""
                for r in t.find_elements(By.CSS_SELECTOR, "tbody tr")]

    out = [values()]
    heads[-1].click()
    out.append(values())
    heads[-1].click()
    out.append(values())
    return out


def colours(png: Path) -> int:
    """How many distinct colours the screenshot has (a blank page: 1)."""
    from PIL import Image

    with Image.open(png) as im:
        return len(im.convert("RGB").getcolors(maxcolors=1 << 24) or [])
