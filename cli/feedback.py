"""What the terminal commands say while the user waits, on stderr: notes, and the prompt-processing spinner.

Colours follow rich's rules, so NO_COLOR (and output that is no terminal) turns them off.
"""

from __future__ import annotations

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner


def stderr_console() -> Console:
    """A console on stderr, where notes go so that stdout carries only the answer."""
    return Console(stderr=True, highlight=False, soft_wrap=True)


def prompt_note(prompt_tokens: int | None) -> str:
    size = f" ({prompt_tokens} tokens)" if prompt_tokens is not None else ""
    return f"processing prompt{size}…"


def stop_note(finish_reason: str | None, output_tokens: int, max_tokens: int) -> str | None:
    """Why an answer ended early, when it did: at max_tokens or at the context limit; None when it ended itself."""
    if finish_reason != "length":
        return None
    return "stopped at max_tokens" if output_tokens >= max_tokens else "stopped at the context limit"


class PromptSpinner:
    """A spinner from sending a prompt until its first token (on a terminal only); stop() is idempotent."""

    def __init__(self, console: Console, prompt_tokens: int | None, show: bool = True):
        self.live: Live | None = None
        if show and console.is_terminal:
            # transient: the line goes when the answer starts; the answer is written to stdout directly
            self.live = Live(Spinner("dots", prompt_note(prompt_tokens)), console=console, transient=True,
                             redirect_stdout=False, redirect_stderr=False, refresh_per_second=12.5)
            self.live.start()

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def __enter__(self) -> PromptSpinner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
