"""The text edgeserve ships for measuring perplexity (`eval perplexity`, `convert --report`), and its title.

Apart from the report's module so that a command's --help names it without importing the engine.
"""

from pathlib import Path

SHIPPED_TEXT = Path(__file__).parent / "data" / "alice_ch1-2.txt"
SHIPPED_TEXT_TITLE = (
    "Lewis Carroll, \"Alice's Adventures in Wonderland\" (1865), chapters I-II, "
    "text of Project Gutenberg eBook #11 (public domain)"
)
