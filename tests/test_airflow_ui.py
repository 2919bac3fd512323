"""The Airflow UI end to end in headless Chromium: log in, trigger a pipeline with a param, see it succeed.

Chromium is the Debian package (``apt-get install chromium``); Playwright drives it from PyPI
without ``playwright install``. A screenshot of the grid lands in ``test-artifacts/``.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import airflow_env
import pytest

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = airflow_env.ROOT / "test-artifacts"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
pytestmark = pytest.mark.slow


@pytest.fixture
def browser_page(tmp_path: Path):
    from playwright import sync_api

    if not Path(CHROMIUM).exists():
        pytest.fail("chromium missing: run `make browser` (apt-get install -y chromium)")
    profile = Path(tempfile.mkdtemp(prefix="millpond-chromium-"))
    with sync_api.sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1400, "height": 900},
        )
        try:
            yield context.new_page()
        finally:
            context.close()
            shutil.rmtree(profile, ignore_errors=True)


def wait_for_run(stack, dag_id: str, run_id: str, timeout: float = 240.0) -> dict:
    deadline = time.monotonic() + timeout
    token = stack.token()
    while True:
        stack.revive()  # as `Backfill.wait` does: a scheduler that died is restarted
        run = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}", token=token)
        if run["state"] in ("success", "failed") or time.monotonic() > deadline:
            return run
        time.sleep(2)


def test_login_trigger_with_param_and_grid(airflow_stack, browser_page) -> None:
    from urllib.parse import unquote

    from millpond.orchestration.dagfactory import TASK_ID

    stack, _ = airflow_stack
    page = browser_page
    dag_id = f"millpond_{airflow_env.PIPELINE}"

    # Log in (auth is on: SimpleAuthManager with the generated admin password).
    page.goto(f"{stack.url}/dags/{dag_id}")
    page.wait_for_selector("input[name=username]", timeout=60_000)
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", stack.admin_password())
    page.click("button:has-text('Sign in')")
    page.wait_for_url(f"**/dags/{dag_id}**", timeout=60_000)

    # Trigger with params from the form: a dry run with a watermark lag override.
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.locator("label:has(input[name=element_dry_run])").click()
    assert dialog.locator("input[name=element_dry_run]").is_checked()
    dialog.locator("#element_watermark_lag_override").fill("3m")
    dialog.get_by_role("button", name="Trigger").click()
    page.wait_for_url(f"**/dags/{dag_id}/runs/**", timeout=60_000)
    run_id = unquote(page.url.split("/runs/", 1)[1].split("?")[0].split("/")[0])

    run = wait_for_run(stack, dag_id, run_id)
    assert run["state"] == "success", run
    assert run["conf"]["dry_run"] is True and run["conf"]["watermark_lag_override"] == "3m"
    token = stack.token()
    xcom = stack.api("GET", f"/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{TASK_ID}/xcomEntries/"
                     "return_value?deserialize=true", token=token)
    assert "dry_run" in str(xcom["value"])

    # The grid shows the run's one task; wait for it before the screenshot (else it may be blank).
    page.goto(f"{stack.url}/dags/{dag_id}/runs/{run_id}")
    page.get_by_text(TASK_ID, exact=True).first.wait_for(timeout=60_000)
    page.get_by_text("Success").first.wait_for(timeout=60_000)
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "airflow-grid.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
