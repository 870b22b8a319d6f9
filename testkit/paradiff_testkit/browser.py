"""Debian's chromium (never `playwright install`), headless, for the web page's tests."""

from __future__ import annotations

import shutil

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"

# A launch normally takes 1-3 s; on a loaded 2-core CI host one was seen to hang past 180 s at start-up (no window
# ever opened) while the next launch in the same run took seconds. A launch is not what the tests check: each try is
# bounded, and a later try starts a new browser process.
LAUNCH_TRIES = 3
LAUNCH_TIMEOUT_MS = 90_000


def launch_chromium(playwright):
    """The browser, launched headless; raises the last launch error after `LAUNCH_TRIES` bounded tries."""
    from playwright.sync_api import Error as PlaywrightError

    for attempt in range(LAUNCH_TRIES):
        try:
            return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, timeout=LAUNCH_TIMEOUT_MS)
        except PlaywrightError:
            if attempt == LAUNCH_TRIES - 1:
                raise
