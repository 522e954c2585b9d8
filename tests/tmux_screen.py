"""An edgeserve command in a private tmux server at a given size: the real terminal, read back as text."""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import subprocess
import sys
import time

import pytest

EXIT_MARK = "command exited with "
TIMEOUT = 180.0  # seconds for answers on a slow, shared CPU


_SCREENS = itertools.count()


class TmuxScreen:
    """`edgeserve ARGS` in a private tmux server; the pane stays after the command exits, to read."""

    def __init__(self, args: list[str], width: int, height: int, home, **env: str):
        if shutil.which("tmux") is None:
            if os.environ.get("CI"):
                pytest.fail("tmux is missing (apt-get install tmux)")
            pytest.skip("tmux is not installed")
        # apart from whatever tmux the user runs, and from the last screen: a server of the same name still shutting
        # down refused the next one's session
        self.server = f"edgeserve-test-{os.getpid()}-{next(_SCREENS)}-{width}x{height}"
        command = shlex.join([sys.executable, "-c", "from edgeserve.cli.main import cli; cli()", *args])
        # the pane's size is the terminal's: COLUMNS and LINES (pytest-xdist's workers set 80x24) would override it
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        env = {**inherited, "EDGESERVE_HOME": str(home), "TERM": "xterm-256color", **env}
        subprocess.run(["tmux", "-L", self.server, "-f", os.devnull, "new-session", "-d", "-s", "main",
                        "-x", str(width), "-y", str(height), f"{command}; echo {EXIT_MARK}$?; sleep 600"],
                       check=True, env=env)

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.server, *args], check=True, capture_output=True, text=True).stdout

    def screen(self, escapes: bool = False) -> str:
        """What the screen shows now."""
        return self.tmux("capture-pane", "-p", *(["-e"] if escapes else []), "-t", "main")

    def history(self) -> str:
        """The scrollback and the screen, lines the terminal wrapped joined again."""
        return self.tmux("capture-pane", "-p", "-J", "-S", "-", "-t", "main")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "main", *keys)

    def wait_for(self, *texts: str, count: int = 1, source=None) -> str:
        """Wait until the screen (or source()) shows each of texts, at least count times."""
        source = source or self.screen
        deadline = time.monotonic() + TIMEOUT
        while True:
            shown = source()
            if all(shown.count(t) >= count for t in texts):
                return shown
            if time.monotonic() > deadline:
                pytest.fail(f"the screen never showed {texts}:\n{shown}")
            time.sleep(0.3)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.server, "kill-server"], capture_output=True)
