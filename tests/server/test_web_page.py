"""The chat page in a real headless Chromium (Debian's, the `browser` fixture), driven by
Playwright.

Type a message, see the streamed reply appear, and see the metrics panel fill in from /metrics.
Reference: the same chat through the API (the page must show exactly that text).
"""
from __future__ import annotations

import httpx


def test_chat_streams_and_metrics_appear(browser, server):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    page.wait_for_function("document.getElementById('model').textContent !== '…'")
    assert page.text_content("#model") == server.state.model_name
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "12")
    page.fill("#prompt", "Hello there")
    page.click("#send")
    page.wait_for_function("document.getElementById('r-tokens').textContent === '12'",
                           timeout=30000)
    shown = page.text_content(".msg.assistant")
    want = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0,
        "max_tokens": 12, "top_p": 0.95}).json()["choices"][0]["message"]["content"]
    assert shown == want and shown
    assert page.text_content(".msg.user") == "Hello there"
    assert page.text_content("#r-ttft").endswith("ms")
    page.wait_for_function("document.getElementById('m-ttft').textContent.endsWith('ms')")
    page.wait_for_function("document.getElementById('m-kv').textContent.endsWith('%')")
    # the panel polls /metrics: a poll may fall between the first token and the request's end
    page.wait_for_function("Number(document.getElementById('m-done').textContent) >= 1")
    page.wait_for_function("document.getElementById('m-running').textContent === '0'")
    page.close()


def test_errors_show_in_the_page(browser, server):
    page = browser.new_page()
    page.goto(server.url + "/")
    page.wait_for_function("document.getElementById('status').textContent === 'ready'")
    page.fill("#prompt", "hello " * 600)  # a prompt the 512-token context cannot hold
    page.click("#send")
    page.wait_for_selector(".msg.assistant.error")
    assert "context holds 512" in page.text_content(".msg.assistant.error")
    page.close()
