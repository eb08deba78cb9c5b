"""The console in a real browser (docs/CONSOLE.md): Debian's chromium, headless, driven by selenium
through Debian's chromedriver against a real 3-node cluster. A visitor signs in through a
`qctl console` link, sees the nodes and the queues, browses a queue's messages and reads one,
hands a queue off and sees its master change, purges with the typed confirmation (a mistyped name
purges nothing), is refused as a get-only client (E_FORBIDDEN in words, the messages kept), and
sees a failover in the event feed when a queue's master node is killed.

With QCONSOLE_SCREENSHOTS=DIR set, PNGs of the main pages go into DIR (docs/console/ in this
repository holds the ones the README shows). ./scripts/test installs chromium and chromium-driver
where they are missing; there is no selenium-manager download (the tests run without internet).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from client.credentials import load_credentials
from client.http import HttpClient
from client.sync import Client
from wire.signing import Signer, private_key_from_text

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
WAIT_S = 15.0                  # a page, a notice, a change of master
FAILOVER_WAIT_S = 40.0         # a killed master's lease lapses, the replica is promoted, the event shows
SCREENSHOTS = os.environ.get("QCONSOLE_SCREENSHOTS")


def require_browser(paths: tuple[str, str]) -> None:
    missing = [path for path in paths if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: ./scripts/test installs Debian's chromium and "
                    "chromium-driver (apt-get install chromium chromium-driver)")


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    require_browser((CHROMIUM, CHROMEDRIVER))
    profile = tempfile.mkdtemp(prefix="qconsole-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # With QSERVER_TEST_TLS=1 the nodes serve HTTPS with a certificate of the test run's own CA,
    # which the browser has no reason to trust: the console is the same over it (Secure cookie).
    options.accept_insecure_certs = True
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                     "--disable-background-networking", "--disable-component-update", "--disable-sync",
                     f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


class Visitor:
    """What a person does in the console, with explicit waits (never a sleep as an assertion)."""

    def __init__(self, driver: WebDriver, url: str) -> None:
        self.driver, self.url = driver, url
        self.timings: dict[str, float] = {}        # page -> ms from request to first byte (the server's time)

    def until(self, check: Callable[[WebDriver], Any], what: str, timeout_s: float = WAIT_S) -> Any:
        try:
            return WebDriverWait(self.driver, timeout_s, poll_frequency=0.2,
                                 ignored_exceptions=(StaleElementReferenceException,)).until(check)
        except TimeoutException:
            raise AssertionError(f"{what} not seen within {timeout_s} s at {self.driver.current_url}:\n"
                                 f"{self.text('main')[:1500]}") from None

    def css(self, selector: str) -> Any:
        return self.driver.find_element(By.CSS_SELECTOR, selector)

    def all(self, selector: str) -> list[Any]:
        return self.driver.find_elements(By.CSS_SELECTOR, selector)

    def text(self, selector: str) -> str:
        found = self.all(selector)
        return str(found[0].text) if found else ""

    def visible(self, selector: str, timeout_s: float = WAIT_S) -> Any:
        return self.until(lambda driver: next((element for element in self.all(selector) if element.is_displayed()),
                                              False), f"{selector}", timeout_s)

    def open(self, path: str, selector: str) -> Any:
        self.driver.get(self.url + path)
        found = self.visible(selector)
        self.timings[path] = float(self.driver.execute_script(
            "const t = performance.getEntriesByType('navigation')[0]; return t.responseStart - t.requestStart;"))
        return found

    def sign_in(self, signer: Signer) -> None:
        self.driver.delete_all_cookies()
        self.driver.get(HttpClient(self.url, signer).console_link())
        self.visible("#signed-in-as")
        assert signer.client_id in self.text("#signed-in-as")

    def act(self, form: str, typed: str | None = None, fill: dict[str, str] | None = None) -> tuple[str, str]:
        """Submit a form of an action, confirm it (typing `typed` where asked), and read the notice."""
        for name, value in (fill or {}).items():
            field = self.css(f"form#{form} [name={name}]")
            field.clear()
            field.send_keys(value)
        self.css(f"form#{form} button[type=submit]").click()
        self.visible("form#confirm-form")
        if typed is not None:
            self.css("input#typed").send_keys(typed)
        self.css("button#confirm").click()
        notice = self.visible("p.notice[role=status]")
        return ("ok" if "ok" in str(notice.get_attribute("class")).split() else "error"), str(notice.text)

    def screenshot(self, name: str, whole_page: bool = False) -> None:
        """With QCONSOLE_SCREENSHOTS=DIR, DIR/name.png; `whole_page`: as tall as the page (to 2,400 px)."""
        if not SCREENSHOTS:
            return
        Path(SCREENSHOTS).mkdir(parents=True, exist_ok=True)
        self.driver.execute_script("window.scrollTo(0, 0)")
        size = self.driver.get_window_size()
        if whole_page:
            height = int(self.driver.execute_script("return document.documentElement.scrollHeight"))
            self.driver.set_window_size(size["width"], min(max(height + 150, size["height"]), 2400))
        try:
            assert self.driver.save_screenshot(str(Path(SCREENSHOTS) / f"{name}.png")), name
        finally:
            self.driver.set_window_size(size["width"], size["height"])


def master_of(client: Client, queue: str) -> tuple[str, str]:
    entry = client.cluster()["queues"][queue]
    return str(entry["master"]), str(entry["replica"])


@pytest.mark.timeout(150)
def test_the_console_in_a_real_browser(qcluster_factory: Any, browser: WebDriver) -> None:
    # orders: handed off from the console; audit: its master's node (n3) is killed for the failover.
    cluster = qcluster_factory(3, {"orders": ["n1", "n2"], "audit": ["n3", "n2"]})
    url = cluster.urls["n1"]
    visitor = Visitor(browser, url)
    with Client(url, cluster.credentials_path) as admin:
        admin.create_queue("orders", strength="full")
        admin.create_queue("audit", strength="full")
        documents: dict[int, dict[str, Any]] = {}
        for number in range(5):
            document = {"order": 1000 + number, "items": [{"sku": "A-17", "qty": number + 1}], "rush": number == 0}
            documents[admin.enqueue("orders", json.dumps(document).encode(), priority=4 + number % 3,
                                    headers={"content-type": "application/json", "source": "web-shop"})] = document
        admin.enqueue("orders", bytes(range(0, 256, 7)), priority=2)        # not text: shown as hex
        admin.enqueue("audit", b"kept through the refusal")
        for name, count in (("billing", 3), ("emails", 12), ("shipments", 1)):       # a fuller queues page
            admin.create_queue(name)
            admin.enqueue_many(name, [b"%s %d" % (name.encode(), number) for number in range(count)])
        record: dict[str, Any] = admin.register_client("viewer", [{"pattern": "*", "privileges": ["get"]}])
        viewer = Signer(record["id"], private_key_from_text(record["private_key"]))

        # Signed in through a `qctl console` link: the cluster page, its nodes and the leader.
        admin_signer = load_credentials(cluster.credentials_path).signer()
        visitor.sign_in(admin_signer)
        visitor.open("/console/cluster", "#leader")
        for node in cluster.ids:
            visitor.visible(f"table#nodes tr[data-node={node}]")
        visitor.until(lambda _: visitor.text("#leader") in cluster.ids, "a membership leader")
        visitor.screenshot("cluster")

        # The queues, each with its master; the filter keeps the queues whose name matches.
        visitor.open("/console/queues", "table#queues tr[data-queue=orders]")
        visitor.visible("table#queues tr[data-queue=audit]")
        assert visitor.text("table#queues tr[data-queue=orders] td.master") == "n1"
        visitor.screenshot("queues")
        visitor.css("#create-queue summary").click()           # the create form, folded until asked for
        kind, text = visitor.act("create", fill={"name": "invoices", "max_depth": "5000"})
        assert kind == "ok" and text.startswith("Queue invoices is there (master n"), text
        visitor.visible("table#queues tr[data-queue=invoices]")
        assert admin.queue_stats("invoices")["depth"] == 0
        field = visitor.css("form#filter input[name=q]")
        field.send_keys("ord")
        field.submit()
        visitor.until(lambda _: not visitor.all("table#queues tr[data-queue=audit]")
                      and visitor.all("table#queues tr[data-queue=orders]"), "the filtered queues")

        # A queue's messages, browsed without taking them; one read by its id.
        visitor.open("/console/queues/orders", "table#messages tr[data-message]")
        rows = visitor.all("table#messages tr[data-message]")
        assert len(rows) == 6, len(rows)
        assert "web-shop" in visitor.text("table#messages") or "1000" in visitor.text("table#messages")
        visitor.screenshot("queue", whole_page=True)
        first = rows[0].get_attribute("data-message")
        visitor.open(f"/console/queues/orders/messages/{first}", "#payload")
        assert json.loads(visitor.text("#payload")) == documents[int(str(first))]     # delivery order: priority 6 first
        if visitor.all("#view-json"):                   # the same payload laid out as JSON
            visitor.css("#view-json").click()
            visitor.until(lambda _: "\n" in visitor.text("#payload"), "the payload shown as JSON")
            assert json.loads(visitor.text("#payload")) == documents[int(str(first))]
        visitor.screenshot("message")
        assert admin.queue_stats("orders")["depth"] == 6     # browsing took nothing

        # Hand off from the console: the master changes, on the queue's page and in the table.
        visitor.open("/console/queues/orders", "form#handoff")
        kind, text = visitor.act("handoff")
        assert kind == "ok" and "master n2, replica n1" in text, text
        assert master_of(admin, "orders") == ("n2", "n1")

        def master_shown(_: WebDriver) -> bool:
            visitor.open("/console/queues", "table#queues tr[data-queue=orders]")
            return visitor.text("table#queues tr[data-queue=orders] td.master") == "n2"
        visitor.until(master_shown, "orders mastered by n2 in the queues table")

        # Purge: a mistyped name purges nothing; the name purges.
        visitor.open("/console/queues/orders", "form#purge")
        visitor.css("form#purge button[type=submit]").click()
        visitor.visible("input#typed").send_keys("order")
        visitor.css("button#confirm").click()
        visitor.visible("#mistyped")
        assert admin.queue_stats("orders")["depth"] == 6
        visitor.css("input#typed").send_keys("orders")
        visitor.css("button#confirm").click()
        notice = visitor.visible("p.notice[role=status]")
        assert "ok" in str(notice.get_attribute("class")) and "6 messages" in notice.text, notice.text
        assert admin.queue_stats("orders")["depth"] == 0

        # A get-only client sees the same forms and is refused where the call lands.
        visitor.sign_in(viewer)
        visitor.open("/console/queues/audit", "form#purge")
        kind, text = visitor.act("purge", typed="audit")
        assert kind == "error" and text.startswith("E_FORBIDDEN"), text
        assert admin.queue_stats("audit")["depth"] == 1

        # A failover: audit's master node is killed; its replica takes over; the feed says so.
        visitor.sign_in(admin_signer)
        def event_shown(kind: str, queue: str) -> Callable[[WebDriver], bool]:
            def shown(_: WebDriver) -> bool:
                visitor.open("/console/events", "table#events, #no-events")
                return any(queue in row.text for row in visitor.all(f"table#events tr.event[data-kind={kind}]"))
            return shown
        visitor.until(event_shown("handoff", "orders"), "the handoff of orders in the event feed")
        cluster.kill("n3")
        visitor.until(event_shown("failover", "audit"), "the failover of audit in the event feed", FAILOVER_WAIT_S)
        visitor.screenshot("events")
        assert master_of(admin, "audit")[0] == "n2"
    print("console pages, ms from request to first byte:",
          json.dumps({page: round(ms, 1) for page, ms in visitor.timings.items()}))


def test_a_missing_browser_is_named_with_what_installs_it(tmp_path: Path) -> None:
    with pytest.raises(pytest.fail.Exception, match=r"chromedriver missing: ./scripts/test installs"):
        require_browser((CHROMIUM, str(tmp_path / "chromedriver")))
