"""Headless Chromium driven over the DevTools protocol, for the tests of
the web page in a real browser."""

import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time

import pytest


class Chromium:
    """Headless Chromium driven over the DevTools protocol on a pipe (no
    extra packages): messages are JSON separated by NUL bytes on fds 3/4."""

    def __init__(self, tmp_path):
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if not binary:
            if os.environ.get("CI"):
                pytest.fail("chromium is missing: .ci/run should have installed it")
            pytest.skip("chromium is not installed (.ci/run installs it)")
        to_browser_r, self.to_browser = os.pipe()
        self.from_browser, from_browser_w = os.pipe()
        self.process = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path}/chrome",
             "--remote-debugging-pipe", "about:blank"],
            close_fds=False, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=lambda: self._pipes_to_3_and_4(to_browser_r, from_browser_w))
        os.close(to_browser_r)
        os.close(from_browser_w)
        self.buffer, self.next_id, self.events, self.target = b"", 0, [], None
        self.new_page()

    def new_page(self):
        """A fresh tab (no emulation, no history); the previous one is closed."""
        if self.target:
            self.call("Target.closeTarget", targetId=self.target)
        self.target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=self.target,
                                 flatten=True)["sessionId"]
        self.events.clear()
        self.call("Page.enable", session=True)

    @staticmethod
    def _pipes_to_3_and_4(read_end, write_end):
        """In the child: the pipes on fds 3 and 4, where Chromium expects them.
        Copies go above 10 first, so neither dup2 overwrites the other end."""
        high_read = fcntl.fcntl(read_end, fcntl.F_DUPFD, 10)
        high_write = fcntl.fcntl(write_end, fcntl.F_DUPFD, 10)
        os.dup2(high_read, 3)
        os.dup2(high_write, 4)

    def send(self, method, session=False, **params):
        self.next_id += 1
        message = {"id": self.next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self.to_browser, json.dumps(message).encode() + b"\0")
        return self.next_id

    def receive(self, timeout=20):
        deadline = time.monotonic() + timeout
        while b"\0" not in self.buffer:
            if not select.select([self.from_browser], [], [], max(0, deadline - time.monotonic()))[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self.from_browser, 1 << 20)
            if not chunk:
                raise EOFError("chromium closed the pipe")
            self.buffer += chunk
        message, _, self.buffer = self.buffer.partition(b"\0")
        return json.loads(message)

    def call(self, method, session=False, **params):
        wanted = self.send(method, session, **params)
        while True:
            message = self.receive()
            if message.get("id") == wanted:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message.get("result", {})
            self.events.append(message)

    def wait_for_load(self):
        while True:
            if any(e.get("method") == "Page.loadEventFired" for e in self.events):
                self.events.clear()
                return
            self.events.append(self.receive())

    def evaluate(self, expression):
        result = self.call("Runtime.evaluate", session=True, expression=expression,
                           returnByValue=True)
        return result["result"].get("value")

    def open(self, url, headers):
        self.call("Network.enable", session=True)
        self.call("Network.setExtraHTTPHeaders", session=True, headers=headers)
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for_load()

    def close(self):
        with contextlib.suppress(Exception):
            self.send("Browser.close")
        with contextlib.suppress(Exception):
            self.process.wait(timeout=5)
        if self.process.poll() is None:
            self.process.kill()
        os.close(self.to_browser)
        os.close(self.from_browser)



def press(browser, key):
    """A real key press, as the keyboard sends it."""
    browser.call("Input.dispatchKeyEvent", session=True, type="keyDown", key=key, text=key)
    browser.call("Input.dispatchKeyEvent", session=True, type="keyUp", key=key)


def visible(browser, selector):
    """Whether the element is rendered (not hidden, nor in a closed <details>)."""
    return browser.evaluate(f"""(() => {{ const e = document.querySelector({json.dumps(selector)});
        return !!e && e.checkVisibility(); }})()""")
