"""The web chat in a real headless browser: Debian's chromium driven through selenium by its chromedriver (nothing
is downloaded at run time), against a server of the real default model on loopback.

Every test records each request the page makes (the DevTools network log, and the page's own navigation and
resource timings) and asserts that none left the server's loopback address, and that the console logged no error.
Screenshots go under the test's tmp_path, and to $EDGESERVE_TEST_ARTIFACTS when it is set.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from loopback import ServerThread, serving

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = [
    pytest.mark.slow,
    # CI installs both (.ci/run): there a missing browser fails the tests rather than skipping them
    pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER) and os.environ.get("CI") != "true",
                       reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"),
]

KEY = "browser-key-42"
WAIT = 120  # seconds for one answer on a slow, shared CPU
http = httpx.Client(timeout=60)
PHONE = (390, 844)
DESKTOP = (1440, 900)


@pytest.fixture(scope="module")
def server(loaded_model) -> Iterator[ServerThread]:
    with serving(loaded_model, "smollm2") as served:
        yield served


class Page:
    """A browser tab on the web chat of `url`, which keeps every request URL and console entry it has seen."""

    def __init__(self, driver: Any, url: str):
        self.driver = driver
        self.url = url
        self.requests: list[str] = []
        self.console: list[dict] = []

    def open(self) -> Page:
        """The page, laid out at the desktop size."""
        self.driver.get(self.url + "/")
        self.viewport(*DESKTOP)
        return self

    def reload(self) -> None:
        self.collect()  # the page's own timings go with it
        self.driver.refresh()

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def find(self, selector: str) -> Any:
        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def all(self, selector: str) -> list:
        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def until(self, condition: Callable[[], Any], timeout: float = WAIT, message: str = "") -> Any:
        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(lambda _: condition(), message)

    def wait_ready(self) -> None:
        """Until the models are listed: the page reached the API."""
        self.until(lambda: self.js("return document.querySelectorAll('#model option').length"), 30, "no models")

    def type_prompt(self, text: str, send: bool = True) -> None:
        prompt = self.find("#prompt")
        prompt.send_keys(text)
        if send:
            prompt.send_keys(Keys.ENTER)

    def streaming(self) -> bool:
        return bool(self.js("return document.querySelector('[data-streaming]') !== null"))

    def wait_answer(self) -> str:
        """The last answer's text, once it has ended."""
        self.until(lambda: self.all(".msg.assistant") and not self.streaming(), message="the answer did not end")
        return self.all(".msg.assistant .content")[-1].text

    def settings(self, **values: str) -> None:
        """Set this conversation's settings through its dialog (ids without the 'set-' prefix)."""
        self.find("#open-settings").click()
        for name, value in values.items():
            field = self.find(f"#set-{name}")
            if field.get_attribute("type") == "checkbox":
                if field.is_selected() != bool(value):
                    field.click()
            else:
                field.clear()
                field.send_keys(value)
        self.find("#settings-save").click()
        self.until(lambda: not self.js("return document.querySelector('#settings-dialog').open"), 5)

    def stored(self) -> list[dict]:
        return json.loads(self.js("return localStorage.getItem('edgeserve.conversations')") or "[]")

    def collect(self) -> None:
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message["method"] == "Network.requestWillBeSent":
                self.requests.append(message["params"]["request"]["url"])
        self.requests += self.js("return performance.getEntriesByType('navigation')"
                                 ".concat(performance.getEntriesByType('resource')).map(e => e.name)")
        self.console += self.driver.get_log("browser")

    def check_requests_and_console(self, expected_errors: tuple[str, ...] = (), chatted: bool = True) -> None:
        """Every request went to the server on loopback (a download the page made is a blob of its own origin),
        and the console holds no error but those expected; `chatted`: the recorded requests hold the answers'."""
        self.collect()
        assert self.requests and any(u.endswith("/v1/chat/completions") for u in self.requests) == chatted
        outside = sorted({u for u in self.requests if not u.startswith((self.url + "/", f"blob:{self.url}/"))})
        assert not outside, f"requests left the server: {outside}"
        errors = [e["message"] for e in self.console
                  if e["level"] == "SEVERE" and not any(expected in e["message"] for expected in expected_errors)]
        assert not errors, errors

    def viewport(self, width: int, height: int) -> None:
        """Lay the page out at this size, one device pixel per CSS pixel, as a screen of that size would."""
        self.driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600})
        self.until(lambda: self.js("return [innerWidth, innerHeight]") == [width, height], 10, "no new size")

    def color_scheme(self, scheme: str) -> None:
        self.driver.execute_cdp_cmd("Emulation.setEmulatedMedia",
                                    {"features": [{"name": "prefers-color-scheme", "value": scheme}]})

    def screenshot(self, folder: Path, name: str) -> Path:
        path = folder / f"{name}.png"
        assert self.driver.save_screenshot(str(path))
        if artifacts := os.environ.get("EDGESERVE_TEST_ARTIFACTS"):
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(artifacts) / path.name)
        return path


@pytest.fixture
def browser(tmp_path) -> Iterator[Any]:
    """A fresh headless chromium (a new profile: empty localStorage), downloads going to tmp_path/downloads."""
    assert CHROMIUM and CHROMEDRIVER, "chromium and chromium-driver are not installed (.ci/run installs them)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={DESKTOP[0]},{DESKTOP[1]}", "--no-first-run", "--no-default-browser-check",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--disable-default-apps", "--lang=en-US"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    (tmp_path / "downloads").mkdir()
    driver.execute_cdp_cmd("Browser.setDownloadBehavior",
                           {"behavior": "allow", "downloadPath": str(tmp_path / "downloads")})
    try:
        yield driver
    finally:
        driver.quit()


def kv(server: ServerThread) -> dict:
    return http.get(server.url + "/v1/edgeserve/kv").json()


def metric(server: ServerThread, name: str) -> float:
    """A sample of the server's /metrics, or the sum of a metric's samples over its labels (0 where none yet)."""
    lines = http.get(server.url + "/metrics").text.splitlines()
    return sum(float(line.rpartition(" ")[2]) for line in lines
               if line.startswith(name + " ") or "{" not in name and line.startswith(name + "{"))


def test_an_answer_streams_in_growing_with_shift_enter_a_new_line(server, browser):
    page = Page(browser, server.url).open()
    page.wait_ready()
    page.settings(temperature="0", **{"max-tokens": "60"})
    page.type_prompt("Tell me a short story", send=False)
    ActionChains(browser).key_down(Keys.SHIFT).send_keys(Keys.ENTER).key_up(Keys.SHIFT).perform()
    page.type_prompt("about a cat.", send=False)
    assert page.js("return document.querySelector('#prompt').value") == "Tell me a short story\nabout a cat."
    assert not page.all(".msg")  # Shift+Enter only added a line
    page.find("#prompt").send_keys(Keys.ENTER)

    seen: list[str] = []
    deadline = time.monotonic() + WAIT
    while not seen or page.streaming():
        assert time.monotonic() < deadline, "the answer did not end"
        texts = page.js("return [...document.querySelectorAll('.msg.assistant .content')].map(e => e.textContent)")
        if texts and texts[-1] and (not seen or texts[-1] != seen[-1]):
            seen.append(texts[-1])
        time.sleep(0.02)
    final = page.wait_answer()

    longest = 0
    growing = 0
    for text in seen:
        if len(text) > longest:
            longest, growing = len(text), growing + 1
    assert growing >= 3, f"the answer was seen whole or nearly: {seen}"
    assert final and len(final) >= len(seen[0])
    assert page.find(".msg.user .content").text == "Tell me a short story\nabout a cat."
    assert "tokens/s" in page.find(".msg.assistant .stats").text
    stored = page.stored()
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    assert stored[0]["settings"] == {"temperature": 0, "max_tokens": 60}
    assert 0 < stored[0]["messages"][1]["tokens"] <= 60
    page.check_requests_and_console()


def test_json_mode_answers_follow_the_schema_given(server, browser):
    page = Page(browser, server.url).open()
    page.wait_ready()
    page.find("#open-settings").click()
    page.find("#set-json").click()
    page.find("#set-schema").send_keys("{not json")
    page.find("#settings-save").click()
    assert page.find("#settings-error").is_displayed()  # refused: the dialog stays open
    assert page.js("return document.querySelector('#settings-dialog').open")
    page.find("#settings-cancel").click()
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    page.settings(json=True, schema=json.dumps(schema), system="You answer in JSON.", temperature="0",
                  **{"max-tokens": "40"})
    page.type_prompt("What is the capital of France?")
    answer = json.loads(page.wait_answer())

    assert set(answer) == {"city"} and isinstance(answer["city"], str)
    assert page.find(".msg.assistant pre code.language-json")  # shown as JSON, not as Markdown
    (conv,) = page.stored()
    assert conv["system"] == "You answer in JSON." and conv["json"] == {"on": True, "schema": json.dumps(schema)}
    page.check_requests_and_console()


def test_the_markdown_renderer_escapes_html_and_renders_blocks(server, browser):
    page = Page(browser, server.url).open()
    page.wait_ready()
    source = ("# Title\n\nSome **bold**, *italic* and `<b>code</b>` with [a link](https://example.com/a_b_c) and "
              "[no link](javascript:alert(1)).\n\n- one\n- two\n\n1. first\n2. second\n\n"
              "```python\nprint('<script>')\n```\n\n<img src=x onerror=alert(1)>\n\n```\nstill open")
    html = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "import('/web/markdown.js').then(m => done(m.renderMarkdown(arguments[0])));", source)

    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html
    assert "<code>&lt;b&gt;code&lt;/b&gt;</code>" in html
    assert '<a href="https://example.com/a_b_c" target="_blank" rel="noopener noreferrer">a link</a>' in html
    assert "javascript:" not in html.replace("[no link](javascript:alert(1))", "")  # kept as text, not a link
    assert "<ul><li>one</li><li>two</li></ul>" in html and "<ol><li>first</li><li>second</li></ol>" in html
    assert '<code class="language-python">print(&#39;&lt;script&gt;&#39;)</code>' in html
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert html.endswith("<code>still open</code></pre>")  # a fence still streaming renders as code
    page.check_requests_and_console(chatted=False)


def test_escape_stops_an_answer_and_the_server_frees_its_blocks(server, browser):
    page = Page(browser, server.url).open()
    page.wait_ready()
    assert kv(server)["counts"]["used"] == 0
    disconnects = metric(server, 'edgeserve_generations_total{reason="disconnect"}')
    page.type_prompt("Write a very long, detailed essay on the history of the Roman Empire, century by century.")
    page.until(lambda: page.streaming() and len(page.all(".msg.assistant .content")[-1].text) > 20,
               message="no answer began")
    held = kv(server)["counts"]
    assert held["used"] + held["shared"] > 0  # the answer holds blocks while it streams

    page.find("#prompt").send_keys(Keys.ESCAPE)
    page.until(lambda: not page.streaming(), 10, "Esc did not stop the answer")
    assert "stopped" in page.find(".msg.assistant .stats").text
    page.until(lambda: http.get(server.url + "/health").json()["running"] == 0, 30, "the request still runs")
    page.until(lambda: kv(server)["counts"]["used"] + kv(server)["counts"]["shared"] == 0, 30, "blocks still held")
    assert metric(server, 'edgeserve_generations_total{reason="disconnect"}') == disconnects + 1
    assert page.find("#send").is_displayed() and not page.find("#stop").is_displayed()
    page.check_requests_and_console()


def test_the_engine_panel_shows_the_answer_live_and_the_stop_button_ends_it(server, browser, tmp_path):
    page = Page(browser, server.url).open()
    page.wait_ready()
    assert page.find("#engine").is_displayed()  # beside the chat on a desktop
    page.type_prompt("Write a very long story about a lighthouse keeper and the sea, in many chapters.")
    # the panel refreshes while the answer streams: this request running, its own blocks marked on the map
    page.until(lambda: page.find("#fig-running").text == "1" and page.all("#kv-map .mine"), 60,
               "the panel did not show the running answer")
    blocks = len(page.all("#kv-map .kv-cell"))
    assert blocks == kv(server)["num_blocks"]
    assert "blocks used" in page.find("#fig-kv").text and "KV pool:" in page.find("#kv-title").text
    page.screenshot(tmp_path, "engine-panel-streaming")
    page.find("#stop").click()
    page.until(lambda: not page.streaming(), 10, "the stop button did not stop the answer")
    page.until(lambda: http.get(server.url + "/health").json()["running"] == 0, 30, "the request still runs")
    page.until(lambda: not page.all("#kv-map .mine") and page.find("#fig-running").text == "0", 30,
               "the panel still shows the answer")
    assert re.fullmatch(r"\d+\.\d\d s \(mean \d+\.\d\d s\)", page.find("#fig-ttft").text)
    assert re.fullmatch(r"\d+ of \d+ prompt tokens \(\d+%\)", page.find("#fig-prefix").text)
    # a request of another client that guesses (prompt lookup, asked for in its body): the panel tells how they fared
    http.post(server.url + "/v1/completions", json={"prompt": "one two three one two three one two three one two",
                                                   "max_tokens": 24, "temperature": 0, "speculative": "ngram"})
    checks = metric(server, "edgeserve_speculative_checks_total")
    right = metric(server, 'edgeserve_speculative_draft_tokens_total{result="accepted"}')
    wrong = metric(server, 'edgeserve_speculative_draft_tokens_total{result="rejected"}')
    assert checks > 0
    share = math.floor(100 * right / (right + wrong) + 0.5)  # as JavaScript's Math.round rounds halves
    shown = f"{share}% right, {(right + checks) / checks:.2f} tokens a check"
    page.until(lambda: page.find("#fig-guesses").text == shown, 30, "the panel did not show the guesses")
    page.check_requests_and_console()


def test_conversations_are_kept_switched_renamed_exported_and_deleted(server, browser, tmp_path):
    page = Page(browser, server.url).open()
    page.wait_ready()
    page.settings(temperature="0", **{"max-tokens": "8"})
    page.type_prompt("Name a colour.")
    first = page.wait_answer()
    page.find("#new-chat").click()
    page.settings(**{"max-tokens": "8", "system": "Answer in one word."})
    page.type_prompt("Name a fruit.")
    page.wait_answer()
    assert [c.text for c in page.all(".conversation .title")] == ["Name a fruit.", "Name a colour."]

    page.all(".conversation .title")[1].click()  # switch back
    assert page.find(".msg.user .content").text == "Name a colour." and page.wait_answer() == first
    page.all(".conversation .rename")[1].click()
    # the name is selected as the box opens: typing replaces it (clear() would blur the box, which ends it)
    page.find(".rename-box").send_keys("Colours\n")
    page.reload()
    page.wait_ready()
    assert [c.text for c in page.all(".conversation .title")] == ["Name a fruit.", "Colours"]
    assert page.find(".conversation.current .title").text == "Colours"  # the one open before the reload
    assert page.find(".msg.user .content").text == "Name a colour."
    page.all(".conversation .title")[0].click()
    assert page.find(".msg.user .content").text == "Name a fruit."

    # regenerate the last answer, then edit the question and send it again
    answers = metric(server, "edgeserve_generations_total")
    page.find(".regenerate").click()
    page.wait_answer()
    page.find(".msg.user .edit").click()
    edit = page.find(".edit-box")
    edit.clear()
    edit.send_keys("Name a vegetable.\n")
    page.wait_answer()
    fruit = next(c for c in page.stored() if c["system"] == "Answer in one word.")
    assert [m["role"] for m in fruit["messages"]] == ["user", "assistant"]
    assert fruit["messages"][0]["content"] == "Name a vegetable." and fruit["messages"][1]["content"]
    assert page.find(".msg.user .content").text == "Name a vegetable."
    page.until(lambda: metric(server, "edgeserve_generations_total") == answers + 2, 10, "not two more answers")

    page.all(".conversation .export")[0].click()
    download = tmp_path / "downloads" / "Name-a-fruit.json"
    page.until(lambda: download.is_file() and download.stat().st_size, 10, "no export was downloaded")
    (exported,) = json.loads(download.read_text())
    assert exported["messages"] == fruit["messages"]

    remove = page.all(".conversation .delete")[1]
    remove.click()
    assert len(page.all(".conversation")) == 2  # one click only asks
    remove.click()
    page.reload()
    page.wait_ready()
    assert [c.text for c in page.all(".conversation .title")] == ["Name a fruit."]
    page.check_requests_and_console()


def test_the_page_asks_for_the_key_once_and_keeps_it(loaded_model, browser):
    with serving(loaded_model, "smollm2", api_key=KEY) as server:
        page = Page(browser, server.url).open()
        page.until(lambda: page.js("return document.querySelector('#key-dialog').open"), 30, "no key asked for")
        page.find("#key-input").send_keys("wrong\n")
        page.until(lambda: page.find("#key-error").is_displayed(), 30, "a wrong key was taken")
        page.find("#key-input").send_keys(KEY + "\n")
        page.wait_ready()
        page.settings(**{"max-tokens": "4"})
        page.type_prompt("Hi")
        assert page.wait_answer() and "error" not in page.find(".msg.assistant .stats").text
        page.reload()
        page.wait_ready()  # the key came from the browser's storage: no dialog this time
        assert not page.js("return document.querySelector('#key-dialog').open")
        assert page.find(".msg.user .content").text == "Hi"
        # the page's first /v1/models without a key, and the wrong key's, answered 401
        page.check_requests_and_console(expected_errors=("401 (Unauthorized)",))
        assert sum(u.endswith("/v1/models") for u in page.requests) >= 3


def test_screenshots_at_phone_and_desktop_sizes_in_light_and_dark(server, browser, tmp_path):
    page = Page(browser, server.url).open()
    page.wait_ready()
    page.settings(temperature="0", **{"max-tokens": "120"})
    page.type_prompt("Write a Python function that adds two numbers, with a short explanation.")
    page.wait_answer()
    page.until(lambda: page.find("#fig-running").text == "0", 10, "the panel did not settle")
    shots = {page.screenshot(tmp_path, "desktop-1440x900"): DESKTOP}
    page.color_scheme("dark")
    dark = page.js("return getComputedStyle(document.body).backgroundColor")
    shots[page.screenshot(tmp_path, "desktop-1440x900-dark")] = DESKTOP
    page.color_scheme("light")
    assert page.js("return getComputedStyle(document.body).backgroundColor") != dark

    page.viewport(*PHONE)
    assert not page.find("#sidebar").is_displayed() and not page.find("#engine").is_displayed()
    assert page.js("return document.documentElement.scrollWidth") <= PHONE[0]  # no sideways scroll
    assert page.find("#prompt").is_displayed() and page.find("#send").is_displayed()
    shots[page.screenshot(tmp_path, "phone-390x844")] = PHONE
    page.find("#toggle-sidebar").click()
    assert page.find("#sidebar").is_displayed()
    shots[page.screenshot(tmp_path, "phone-390x844-conversations")] = PHONE
    page.all(".conversation .title")[0].click()
    assert not page.find("#sidebar").is_displayed()
    page.find("#toggle-engine").click()
    assert page.find("#engine").is_displayed()
    shots[page.screenshot(tmp_path, "phone-390x844-engine")] = PHONE
    page.find("#engine .close-panel").click()  # the panel covers the chat, and the button that opened it
    assert not page.find("#engine").is_displayed()
    for shot, size in shots.items():
        assert png_size(shot) == size, shot.name
    page.check_requests_and_console()


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its header."""
    return struct.unpack(">II", path.read_bytes()[16:24])
