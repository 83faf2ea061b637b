"""The admin page of celery_idempotent.contrib.django in a real browser: headless Chromium
(Debian's ``chromium`` and ``chromium-driver`` packages) driven by Selenium.

A staff user logs in, filters the keys by task and by state, forgets one key through the
confirmation page and sees it gone (from the page and from the table); a staff user with only
the ``view`` permission sees the keys but has no "forget" action, and a forged POST of the
action deletes nothing. Each step prints what it did and what it checked (``pytest -s``).
Skipped with the reason when no Chromium or chromedriver is installed (``.ci/run`` installs
them).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from tests.support.ports import free_port

PROJECT = Path(__file__).resolve().parent / "django_app_project"
TABLE = "celery_idempotency"
CHANGELIST = "/admin/celery_idempotent/idempotencykey/"

pytestmark = [pytest.mark.postgres, pytest.mark.browser, pytest.mark.slow]


def _browser() -> tuple[str, str]:
    binary = next(
        filter(None, (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome"))),
        None,
    )
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip(
            "no headless Chromium here (apt-get install chromium chromium-driver): the admin's "
            "browser test needs chromium and chromedriver on PATH"
        )
    return binary, driver


def step(text: str) -> None:
    print(f"[browser] {text}", flush=True)


def _env(db_url: str) -> dict[str, str]:
    return {**os.environ, "DJ_DATABASE_URL": db_url, "DJANGO_SETTINGS_MODULE": "appproj.settings"}


def _python(db_url: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args],
        cwd=PROJECT,
        env=_env(db_url),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


SETUP = """
from django.contrib.auth.models import Permission, User
from appproj.celery import charge, send_invoice

User.objects.create_superuser("admin", "a@example.com", "admin-pw")
viewer = User.objects.create_user("viewer", "v@example.com", "viewer-pw", is_staff=True)
viewer.user_permissions.add(Permission.objects.get(codename="view_idempotencykey"))
for order in ("o-1", "o-2"):
    charge.apply(args=(order,)).get()
send_invoice.apply(args=("i-1",)).get()
"""


@pytest.fixture
def site(postgres_url: str) -> Iterator[dict[str, Any]]:
    """A migrated database with three keys and two users, and the project's server on it."""
    name = f"djadmin_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    db_url = urlunsplit(urlsplit(postgres_url)._replace(path="/" + name))
    server = None
    try:
        _python(db_url, "manage.py", "migrate", "--noinput")
        _python(db_url, "-c", "import django; django.setup()\n" + SETUP)
        with psycopg.connect(db_url, autocommit=True) as conn:  # an expired key, for the filter
            conn.execute(
                f"INSERT INTO {TABLE} (key, state, fencing_token, expires_at) VALUES "
                "('idempotency:{appproj.celery.charge:key:order:old}', 'completed', 1, "
                "now() - interval '1 hour')"
            )
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"],
            cwd=PROJECT,
            env=_env(db_url),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(base + "/admin/login/", timeout=2).close()  # noqa: S310
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(0.2)
        yield {"base": base, "db": db_url}
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=30)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = _browser()
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.implicitly_wait(5)
    try:
        yield driver
    finally:
        driver.quit()


def keys_in_table(db_url: str) -> set[str]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return {row[0] for row in conn.execute(f"SELECT key FROM {TABLE}").fetchall()}


def rows(driver: Any) -> list[str]:
    from selenium.webdriver.common.by import By

    return [row.text for row in driver.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")]


def login(driver: Any, base: str, user: str, password: str) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(f"{base}/admin/login/?next={CHANGELIST}")
    driver.find_element(By.NAME, "username").send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(password)
    driver.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
    assert driver.current_url.endswith(CHANGELIST), driver.current_url
    step(f"logged in as {user!r}: landed on {CHANGELIST}")


def test_log_in_filter_forget_a_key_and_a_viewer_cannot(browser: Any, site: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    base, db = site["base"], site["db"]
    login(browser, base, "admin", "admin-pw")
    listed = rows(browser)
    assert len(listed) == 4, listed
    header = browser.find_element(By.CSS_SELECTOR, "#result_list thead").text.lower()
    for column in ("task", "state", "age", "ttl left", "holder"):
        assert column in header, header
    step(f"the list shows 4 keys with columns task, state, age, TTL left, holder: {listed}")

    browser.find_element(By.LINK_TEXT, "appproj.celery.send_invoice").click()
    listed = rows(browser)
    assert len(listed) == 1, listed
    assert "invoice:i-1" in listed[0]
    assert "completed" in listed[0]
    step(f"clicked task filter 'appproj.celery.send_invoice': 1 row: {listed[0]!r}")

    browser.get(base + CHANGELIST)
    browser.find_element(By.LINK_TEXT, "expired").click()
    listed = rows(browser)
    assert len(listed) == 1, listed
    assert "order:old" in listed[0]
    assert "expired" in listed[0]
    step(f"clicked state filter 'expired': 1 row: {listed[0]!r}")

    browser.get(base + CHANGELIST)
    browser.find_element(By.LINK_TEXT, "appproj.celery.charge").click()
    browser.find_element(By.LINK_TEXT, "completed").click()
    listed = rows(browser)
    assert len(listed) == 2, listed
    step(f"clicked task 'appproj.celery.charge' and state 'completed': 2 rows: {listed}")

    target = next(
        r
        for r in browser.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
        if "order:o-1" in r.text
    )
    target.find_element(By.CSS_SELECTOR, "input.action-select").click()
    Select(browser.find_element(By.NAME, "action")).select_by_value("forget")
    browser.find_element(By.NAME, "index").click()
    shown = browser.find_element(By.ID, "forget-keys").text
    assert "order:o-1" in shown
    assert "order:o-2" not in shown
    assert any("order:o-1" in k for k in keys_in_table(db))  # nothing deleted before "yes"
    step(f"ticked order:o-1, chose 'Forget selected keys', Go: confirmation lists {shown!r}")

    browser.find_element(By.ID, "confirm-forget").click()
    message = browser.find_element(By.CSS_SELECTOR, "ul.messagelist").text
    assert "Forgot 1 key(s)." in message
    browser.get(base + CHANGELIST)
    listed = rows(browser)
    assert not any("order:o-1" in r for r in listed), listed
    assert len(listed) == 3, listed
    left = keys_in_table(db)
    assert not any("order:o-1" in k for k in left)
    assert any("order:o-2" in k for k in left)
    step(f"confirmed: message {message!r}; o-1 gone from the page and the table, 3 rows left")

    login(browser, base, "viewer", "viewer-pw")
    listed = rows(browser)
    assert len(listed) == 3, listed
    assert not browser.find_elements(By.NAME, "action")  # no action offered at all
    step("as viewer (view permission only): 3 rows listed, no action select on the page")
    csrf = browser.get_cookie("csrftoken")["value"]
    key = next(k for k in keys_in_table(db) if "order:o-2" in k)
    status = browser.execute_async_script(
        """
        const [url, csrf, key, done] = arguments;
        const body = new URLSearchParams({action: "forget", post: "yes",
            _selected_action: key, csrfmiddlewaretoken: csrf});
        fetch(url, {method: "POST", body, credentials: "same-origin"})
            .then(r => done(r.status)).catch(e => done(String(e)));
        """,
        base + CHANGELIST,
        csrf,
        key,
    )
    assert status == 200, status
    assert key in keys_in_table(db)
    step(f"as viewer, a forged POST of the forget action for {key!r}: HTTP {status}, key kept")
