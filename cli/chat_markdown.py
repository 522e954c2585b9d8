"""Answers drawn as Markdown the way chat shows them: chat text, not a document, so its line breaks stay."""

from __future__ import annotations

from markdown_it import MarkdownIt
from rich.markdown import Markdown

# the parser rich's Markdown uses, so that both see the same blocks
PARSER = MarkdownIt().enable("strikethrough").enable("table")
_VERBATIM = {"fence", "code_block", "html_block"}  # blocks whose lines are drawn as written already


def keep_line_breaks(text: str) -> str:
    """The text with each single newline outside code made a Markdown hard break (two trailing spaces).

    Markdown joins the lines of a paragraph into one; a poem or an address written line by line would
    lose its shape.
    """
    lines = text.split("\n")
    verbatim = {line for token in PARSER.parse(text) if token.type in _VERBATIM and token.map
                for line in range(*token.map)}
    for i, (line, following) in enumerate(zip(lines, lines[1:])):
        if i in verbatim or not line.strip() or not following.strip() or line.endswith(("  ", "\\")):
            continue
        lines[i] = line + "  "
    return "\n".join(lines)


def chat_markdown(text: str) -> Markdown:
    """An answer as rich draws it: Markdown with its line breaks kept."""
    return Markdown(keep_line_breaks(text))
