"""The search page in a real browser: Debian's chromium, headless, driven by playwright (nothing is
downloaded). Any failed image, failed request or console error fails the journey test.

Set PARASEEK_SCREENSHOTS=docs/screenshots to refresh the README's screenshots."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from paraseek.core.demo import GALLERY_DIR

PHOTO_ID = 790
PHOTO = GALLERY_DIR / "000000000790.jpg"
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser():
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("chromium is not installed (README install step)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        # --no-sandbox: CI runs as root, where chromium's sandbox refuses to start
        b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture()
def shots(tmp_path) -> Path:
    out = Path(os.environ.get("PARASEEK_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _watch(page) -> list[str]:
    """Everything that went wrong on the page, as it happens."""
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}: {r.failure}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}") if r.status >= 400 else None)
    return problems


def _images_loaded(page, selector: str) -> int:
    """Waits until every image under ``selector`` has loaded and decoded; returns how many."""
    page.evaluate("window.scrollTo(0, document.body.scrollHeight)")  # lazy images below the fold load too
    page.wait_for_function(
        """(sel) => { const imgs = [...document.querySelectorAll(sel)];
                      return imgs.length > 0 && imgs.every((i) => i.complete && i.naturalWidth > 0); }""",
        arg=selector, timeout=TIMEOUT_MS)
    page.evaluate("window.scrollTo(0, 0)")
    return page.locator(selector).count()


def _card_ids(page) -> list[int]:
    return [int(x) for x in page.locator("#grid figure.card").evaluate_all("(cs) => cs.map((c) => c.dataset.id)")]


def test_search_page_journey(browser, uvicorn_server, demo_snapshot, shots):
    from playwright.sync_api import expect

    url = uvicorn_server(demo_snapshot)
    api = httpx.Client(base_url=url, timeout=60)
    page = browser.new_page(viewport={"width": 1280, "height": 1000})
    problems = _watch(page)
    page.goto(url + "/")

    # what is serving
    info = api.get("/v1/info").json()
    expect(page.locator("#serving")).to_contain_text(f"snapshot {info['snapshot']['version']}", timeout=TIMEOUT_MS)
    expect(page.locator("#serving")).to_contain_text(f"{info['snapshot']['count']} images")
    expect(page.locator("#serving")).to_contain_text(info["bundle"]["name"])

    # a text query: the grid shows the API's ranking, with scores, captions and licences
    query = "a dog lying on a couch"
    page.fill("#query", query)
    page.press("#query", "Enter")
    expect(page.locator("#grid figure.card")).to_have_count(24, timeout=TIMEOUT_MS)
    assert _images_loaded(page, "#grid img") == 24
    expected = api.post("/v1/search", json={"query": query, "k": 24}).json()["results"]
    assert _card_ids(page) == [r["id"] for r in expected]
    first = page.locator("#grid figure.card").first
    expect(first.locator(".score")).to_contain_text(f"score {expected[0]['score']:.3f}")
    expect(first.locator(".caption")).to_have_text(expected[0]["captions"][0])
    expect(first.locator(".licence a").first).to_have_text(expected[0]["licence"]["name"])
    page.screenshot(path=str(shots / "search.png"), full_page=False)

    # paging continues the ranking
    page.click("#next")
    expect(page.locator("#summary")).to_contain_text("Results 25–", timeout=TIMEOUT_MS)
    second = api.post("/v1/search", json={"query": query, "k": 24, "offset": 24}).json()["results"]
    assert _card_ids(page) == [r["id"] for r in second]
    _images_loaded(page, "#grid img")
    page.click("#prev")
    expect(page.locator("#summary")).to_contain_text("Results 1–24", timeout=TIMEOUT_MS)

    # a caption filter: the top k among matching images, as the API ranks them with the same filter
    filtered = api.post("/v1/search", json={"query": query, "k": 24, "filter": {"caption_contains": "dog"}}).json()["results"]
    assert 0 < len(filtered) < 24 and all(any("dog" in c.lower() for c in r["captions"]) for r in filtered)
    page.fill("#caption-filter", "dog")
    page.press("#query", "Enter")
    expect(page.locator("#grid figure.card")).to_have_count(len(filtered), timeout=TIMEOUT_MS)
    assert _card_ids(page) == [r["id"] for r in filtered]
    page.fill("#caption-filter", "")
    page.press("#query", "Enter")
    expect(page.locator("#grid figure.card")).to_have_count(24, timeout=TIMEOUT_MS)

    # the consistency view: the query's list beside each typed paraphrase's, shared images marked
    typed = ["a puppy sleeping on a sofa", "a dog resting on the couch"]
    page.fill("#paraphrases", "\n".join(typed))
    page.click("#consistency-form button[type=submit]")
    expect(page.locator("#consistency .list")).to_have_count(3, timeout=TIMEOUT_MS)
    report = api.post("/v1/search", json={"query": query, "k": 10,
                                          "consistency": {"paraphrases": typed, "k": 10}}).json()["consistency"]
    for column, p in zip(page.locator("#consistency .list.paraphrase").all(), report["paraphrases"]):
        expect(column.locator("h3")).to_have_text(p["text"])
        expect(column.locator(".metrics")).to_have_text(f"AO@10 {p['ao']:.3f} · JS@10 {p['js']:.3f}")
        shared = sum(1 for i in p["ids"] if i in report["ids"])
        expect(column.locator("img.shared")).to_have_count(shared)
    expect(page.locator("#consistency-summary")).to_contain_text(f"mean AO@10 {report['mean_ao']:.3f}")
    _images_loaded(page, "#consistency img")
    page.locator("#consistency-section").scroll_into_view_if_needed()
    page.locator("#consistency-section").screenshot(path=str(shots / "consistency.png"))

    # generated paraphrases when none are typed
    page.fill("#paraphrases", "")
    page.click("#consistency-form button[type=submit]")
    expect(page.locator("#consistency-summary")).to_contain_text("paraphrase(s)", timeout=TIMEOUT_MS)
    assert page.locator("#consistency .list.paraphrase").count() >= 1
    _images_loaded(page, "#consistency img")

    # an uploaded image finds itself first; the consistency view is for text queries only
    page.set_input_files("#image-file", str(PHOTO))
    expect(page.locator("#summary")).to_contain_text("the image 000000000790.jpg", timeout=TIMEOUT_MS)
    assert _card_ids(page)[0] == PHOTO_ID
    expect(page.locator("#consistency-section")).to_be_hidden()
    _images_loaded(page, "#grid img")
    page.screenshot(path=str(shots / "image-query.png"), full_page=False)

    # more like this, from the first result
    page.locator("#grid figure.card").first.locator("button.similar").click()
    expect(page.locator("#summary")).to_contain_text(f"more like image {PHOTO_ID}", timeout=TIMEOUT_MS)
    similar = api.post("/v1/search/similar", json={"id": PHOTO_ID, "k": 24}).json()["results"]
    assert _card_ids(page) == [r["id"] for r in similar] and PHOTO_ID not in _card_ids(page)
    _images_loaded(page, "#grid img")

    assert problems == []


def test_page_says_when_the_service_is_not_ready_or_a_request_fails(browser, uvicorn_server, demo_snapshot, shots):
    from playwright.sync_api import expect

    url = uvicorn_server(demo_snapshot)
    page = browser.new_page(viewport={"width": 1280, "height": 600})
    ready = {"ok": False}

    def readyz(route):
        if ready["ok"]:
            return route.continue_()
        route.fulfill(status=503, content_type="application/json", body='{"status": "warming up", "error": null}')

    page.route("**/readyz", readyz)
    page.goto(url + "/")
    expect(page.locator("#status")).to_contain_text("not ready: warming up", timeout=TIMEOUT_MS)
    ready["ok"] = True  # the page keeps asking, and clears the banner once the service is ready
    expect(page.locator("#status")).to_be_hidden(timeout=TIMEOUT_MS)
    expect(page.locator("#serving")).to_contain_text("images")

    # a failing request is shown with its status and the field the service named
    page.route("**/v1/search", lambda route: route.fulfill(
        status=502, content_type="application/json",
        body='{"detail": [{"loc": ["body", "expansion", "method"], "msg": "llm failed: timeout", "type": "request_error"}]}'))
    page.fill("#query", "a bus")
    page.press("#query", "Enter")
    expect(page.locator("#error")).to_have_text("Request failed: 502: body.expansion.method: llm failed: timeout",
                                                timeout=TIMEOUT_MS)
    page.unroute("**/v1/search")
    # and a real 4xx from the service: an upload that is not an image
    page.set_input_files("#image-file", files=[{"name": "notes.txt", "mimeType": "text/plain", "buffer": b"hello"}])
    expect(page.locator("#error")).to_contain_text("422: body.image: the upload is not an image", timeout=TIMEOUT_MS)
    page.screenshot(path=str(shots / "error.png"))

    # indexed urls are data: only http(s) ones become links
    def hostile_urls(route):
        body = route.fetch().json()
        body["results"][0].update(url="javascript:alert(1)", licence={"name": "CC", "url": "javascript:alert(2)"})
        body["results"][1].update(url="https://example.org/photo")
        route.fulfill(status=200, content_type="application/json", json=body)

    page.route("**/v1/search", hostile_urls)
    page.fill("#query", "a bus")
    page.press("#query", "Enter")
    expect(page.locator("#grid figure.card").nth(1).locator("a", has_text="source")).to_have_attribute(
        "href", "https://example.org/photo", timeout=TIMEOUT_MS)
    assert page.locator("#grid a[href^='javascript']").count() == 0
    expect(page.locator("#grid figure.card").first.locator(".licence")).to_contain_text("licence: CC")
    assert "default-src 'self'" in httpx.get(url + "/").headers["content-security-policy"]
