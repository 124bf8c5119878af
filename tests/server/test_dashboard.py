"""/dashboard in a real headless browser (Debian's chromium + chromium-driver, driven
by selenium) against `dpserve serve --data-parallel-size 2 --enable-admin-api` on
the tiny model: one tile per rank, numbers that move under load, a cordon click
that /engines agrees with, a scale from the page that adds a tile, and a
screenshot (kept as docs/dashboard.png when DPSERVE_DASHBOARD_SCREENSHOT names
where to write it); and on a server with --api-key, the page asks for the key and
shows the ranks once it is typed in."""

from __future__ import annotations

import asyncio
import os
import shutil
import threading

import httpx
import openai
import pytest
from helpers import output, serve, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.slow]

DP_ARGS = ("--data-parallel-size", "2", "--threads-per-engine", "1", "--max-model-len", "256")


@pytest.fixture
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and driver, "chromium and chromium-driver are needed (make setup)"
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1200,800"):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        yield browser
    finally:
        browser.quit()


def _load(url: str, model: str, stop: threading.Event) -> None:
    async def run() -> None:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="none",
                                      max_retries=0) as client:
            while not stop.is_set():
                await asyncio.gather(*(client.completions.create(
                    model=model, prompt=f"tile {i}", max_tokens=200, temperature=0,
                    extra_body={"ignore_eos": True}) for i in range(16)))

    asyncio.run(run())


def _settled(text: str) -> str:
    """The scale result once the page's call has answered ("" while it runs)."""
    return "" if not text or text.startswith("scaling to") else text


def test_dashboard_tiles_update_live_and_cordon_from_the_page(tiny_llama, browser, tmp_path):
    from selenium.webdriver.common.by import By

    model = str(tiny_llama)
    with serve(model, *DP_ARGS, "--enable-admin-api", "--allow-unauthenticated-admin",
               "--data-parallel-size-max", "3") as (proc, url):
        browser.get(url + "/dashboard")
        tiles = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, ".tile"), 30,
                           "tiles")
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".tile")) == 2, 30,
                   "one tile per rank")
        tiles = browser.find_elements(By.CSS_SELECTOR, ".tile")
        assert [t.get_attribute("data-rank") for t in tiles] == ["0", "1"]
        assert all(t.get_attribute("data-state") == "serving" for t in tiles)

        def shown(rank: int, name: str) -> str:
            return browser.find_element(
                By.CSS_SELECTOR, f'.tile[data-rank="{rank}"] [data-field="{name}"]').text

        assert shown(1, "tps") == "0.0"  # idle
        pid0 = httpx.get(url + "/engines", timeout=5).json()["engines"][0]["pid"]
        wait_until(lambda: shown(0, "workers").startswith(f"TP0 pid {pid0} cpu "), 30,
                   "rank 0's worker (its engine core: pid, device, memory)")
        stop = threading.Event()
        loader = threading.Thread(target=_load, args=(url, model, stop), daemon=True)
        loader.start()
        try:  # live numbers: tokens/s and the queue move under load
            wait_until(lambda: float(shown(0, "tps")) > 0 and float(shown(1, "tps")) > 0, 60,
                       "tokens/s on both tiles")
            wait_until(lambda: int(shown(0, "running")) + int(shown(1, "running")) > 0, 60,
                       "running requests on a tile")
            # Admin is on: buttons; cordon rank 1 from the page.
            button = browser.find_element(
                By.CSS_SELECTOR, '.tile[data-rank="1"] button[data-action="cordon"]')
            assert button.is_displayed()
            button.click()
            wait_until(lambda: browser.find_element(
                By.CSS_SELECTOR, '.tile[data-rank="1"]').get_attribute("data-cordoned")
                == "true", 30, "the tile shows the cordon")
            assert shown(1, "cordon") == "cordoned"
            assert shown(1, "answer").startswith("200")
            view = httpx.get(url + "/engines", timeout=5).json()["engines"]
            assert [e["cordoned"] for e in view] == [False, True]
            assert browser.find_element(By.ID, "scale-button").is_displayed()
            browser.execute_script("window.scrollTo(0, 0)")
            shot = tmp_path / "dashboard.png"
            assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            keep = os.environ.get("DPSERVE_DASHBOARD_SCREENSHOT")
            if keep:
                shutil.copy(shot, keep)
        finally:
            stop.set()
            loader.join(timeout=120)
        assert "cannot reach" not in browser.find_element(By.ID, "status").text

        # Scale from the page: a third tile appears once the new rank is in view.
        size = browser.find_element(By.ID, "scale-size")
        size.clear()
        size.send_keys("3")
        browser.find_element(By.ID, "scale-button").click()
        answer = wait_until(lambda: _settled(browser.find_element(By.ID, "scale-result").text),
                            180, "the page's scale call to answer")
        assert answer.startswith("200"), f"{answer}\n{output(proc)[-4000:]}"
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".tile")) == 3, 30,
                   "a tile for the new rank")
        assert httpx.get(url + "/engines", timeout=5).json()["data_parallel_size"] == 3
        wait_until(lambda: browser.find_element(
            By.CSS_SELECTOR, '.tile[data-rank="2"]').get_attribute("data-state") == "serving",
            30, "the new rank's tile to show it serving")


def test_dashboard_on_a_server_with_an_api_key(tiny_llama, browser):
    """The page is open but holds no data: /engines needs the key, so the page asks for
    it, and shows the ranks once it is typed in (its script sends it)."""
    from selenium.webdriver.common.by import By

    key = "dash-key-0123456789"
    with serve(str(tiny_llama), "--threads-per-engine", "1", "--max-model-len", "256",
               "--api-key", key) as (_, url):
        assert httpx.get(url + "/engines", timeout=5).status_code == 401
        browser.get(url + "/dashboard")
        status = wait_until(lambda: browser.find_element(By.ID, "status").text, 30, "a status")
        wait_until(lambda: "API key" in browser.find_element(By.ID, "status").text, 30,
                   f"the page to ask for the key (status {status!r})")
        assert browser.find_elements(By.CSS_SELECTOR, ".tile") == []
        browser.find_element(By.ID, "api-key").send_keys(key)
        wait_until(lambda: len(browser.find_elements(By.CSS_SELECTOR, ".tile")) == 1, 30,
                   "the tile once the key is typed")
        assert browser.find_element(By.CSS_SELECTOR, ".tile").get_attribute(
            "data-state") == "serving"
        assert browser.find_element(By.ID, "status").text.startswith("updated")


def test_dashboard_shows_each_ranks_kv_host_tier(tiny_llama, browser):
    """--kv-offload-memory: a prefix computed on rank 0 (saved to the host's tier) and
    continued on rank 1 (loaded from it); rank 1's tile shows the tier's hits and the
    bytes it loaded, as /engines does."""
    from selenium.webdriver.common.by import By

    prefix = [10 + (7 * i) % 370 for i in range(96)]  # 6 full blocks of 16 (vocab 384)
    with serve(str(tiny_llama), *DP_ARGS, "--kv-offload-memory", "64MiB") as (_, url):
        def complete(rank: int, tail: int) -> None:
            resp = httpx.post(url + "/v1/completions", headers={"X-data-parallel-rank": str(rank)},
                              json={"model": str(tiny_llama), "prompt": prefix + [tail],
                                    "max_tokens": 2}, timeout=60)
            assert resp.status_code == 200, resp.text

        def tier(rank: int) -> dict | None:
            return httpx.get(url + "/engines", timeout=5).json()["engines"][rank]["kv_tier"]

        complete(0, 5)
        wait_until(lambda: (tier(0) or {}).get("saved_bytes"), 30, "rank 0's saves")
        complete(1, 6)
        assert tier(1)["hits"] == 96, tier(1)  # the prefix, loaded instead of computed
        browser.get(url + "/dashboard")
        line = wait_until(lambda: "".join(e.text for e in browser.find_elements(
            By.CSS_SELECTOR, '.tile[data-rank="1"] [data-field="tier"]')), 30,
            "rank 1's tier line")  # the tiles come with the page's first fetch
        assert line.startswith("KV tier ") and "% hit (96 of 96 tokens)" in line, line
        assert " MiB loaded in " in line and " saved" in line, line
