"""`edgeserve chat`: the conversation logic on its own, then the real REPL driven through a pseudo-terminal."""

import io
import json
import os
import re
import subprocess
import sys

import pexpect
import pytest
from rich.console import Console

from edgeserve.cli.conversation import CommandError, Conversation, ConversationFileError
from edgeserve.cli.markdown_stream import MarkdownStream
from edgeserve.errors import PromptTooLongError
from edgeserve.sampling_params import InvalidParamsError

# conversation logic -------------------------------------------------------------


def words(messages: list[dict]) -> int:
    """A stand-in tokenizer: one token per word."""
    return sum(len(m["content"].split()) for m in messages)


def test_trim_drops_whole_oldest_exchanges_and_keeps_the_system_prompt():
    conv = Conversation(system="be brief")
    for i in range(3):
        conv.add("user", f"question {i} " + "x " * 8)
        conv.add("assistant", f"answer {i} " + "y " * 8)
    conv.add("user", "last question")

    dropped = conv.trim(words, budget=30)

    assert dropped == 4  # two exchanges of two messages
    assert conv.messages()[0] == {"role": "system", "content": "be brief"}
    assert [m["content"].split()[:2] for m in conv.turns] == [["question", "2"], ["answer", "2"], ["last", "question"]]
    assert words(conv.messages()) <= 30
    assert conv.trim(words, budget=30) == 0


def test_trim_refuses_a_message_that_cannot_fit_alone():
    conv = Conversation()
    conv.add("user", "a " * 50)
    with pytest.raises(PromptTooLongError, match="50 tokens"):
        conv.trim(words, budget=20)
    assert conv.pop_user().split() == ["a"] * 50


def test_commands_change_the_conversation(tmp_path):
    conv = Conversation(settings={"temperature": 0.5})
    conv.add("user", "hi")
    conv.add("assistant", "hello")

    assert conv.command("/system Be brief.").message == "system prompt set"
    assert conv.command("/set top_k 40").message == "top_k = 40"
    assert conv.sampling_params().top_k == 40
    assert [conv.command(c).action for c in ("/help", "/stats", "/exit")] == ["help", "stats", "exit"]
    path = tmp_path / "conv.json"
    conv.command(f"/save {path}")
    assert conv.command("/reset").message == "conversation cleared"
    assert conv.turns == [] and conv.system == "Be brief."

    conv.command(f"/load {path}")

    assert conv.messages() == [{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert conv.settings == {"temperature": 0.5, "top_k": 40}


def test_history_stays_put_while_an_answer_streams():
    conv = Conversation()
    conv.add("user", "hi")
    for line in ("/reset", "/load conversation.json"):
        with pytest.raises(CommandError, match="must wait until the answer ends"):
            conv.command(line, answering=True)
    assert conv.turns == [{"role": "user", "content": "hi"}]
    assert conv.command("/set temperature 0.1", answering=True).message == "temperature = 0.1"


@pytest.mark.parametrize("line, error, match", [
    ("/frobnicate", CommandError, "unknown command /frobnicate"),
    ("/set temperature hot", CommandError, "temperature must be a number"),
    ("/set temperature 5", InvalidParamsError, "temperature must be between 0 and 2"),
    ("/set warmth 1", CommandError, "unknown setting 'warmth'"),
    ("/save", CommandError, "usage: /save FILE"),
])
def test_bad_commands_say_what_is_wrong_and_change_nothing(line, error, match):
    conv = Conversation(settings={"temperature": 0.5})
    with pytest.raises(error, match=match):
        conv.command(line)
    assert conv.settings == {"temperature": 0.5}


@pytest.mark.parametrize("content, match", [
    ("{not json", "is not JSON"),
    ('{"messages": 3}', "holds no list of messages"),
    ('[{"role": "wizard", "content": "hi"}]', "message 0 must be an object with a role"),
    ('{"messages": [], "settings": {"temperature": 9}}', "temperature must be between 0 and 2"),
])
def test_loading_a_bad_file_says_why(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConversationFileError, match=match):
        Conversation.load(path)
    with pytest.raises(ConversationFileError, match="cannot read"):
        Conversation.load(tmp_path / "missing.json")


# the REPL in a pseudo-terminal -----------------------------------------------------

PROMPT = ">>>"
TIMEOUT = 180  # seconds for one answer on a slow, shared CPU
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# prompt_toolkit switches bracketed paste off as it hands the accepted line over: the answer follows
LINE_ACCEPTED = "\x1b[?2004l"
STATS_LINE = r"(\d+) tokens · TTFT \d+ ms · [\d.]+ tokens/s · prompt (\d+) \((\d+) cached\)"
CONTEXT = 320
SPINNER = r"processing prompt \((\d+) tokens\)…"
ANSWER_WORD = r"\b(?!(?:processing|prompt|tokens)\b)[A-Za-z]{4,}\b"  # a word of the answer, not of the spinner


CHAT = ["-c", "from edgeserve.cli.main import cli; cli()", "chat", "--backend", "numpy", "--kv-memory", "64MiB"]


def chat_env(home) -> dict:
    return {**os.environ, "EDGESERVE_HOME": str(home), "PROMPT_TOOLKIT_NO_CPR": "1", "TERM": "xterm"}


@pytest.fixture(scope="module")
def chat(model_path, tmp_path_factory):
    env = chat_env(tmp_path_factory.mktemp("home"))
    child = pexpect.spawn(
        sys.executable,
        ["-c", "from edgeserve.cli.main import cli; cli()", "chat", "--model", str(model_path),
         "--backend", "numpy", "--kv-memory", "64MiB", "--temperature", "0", "--max-tokens", "16",
         "--ctx-size", str(CONTEXT)],
        env=env, encoding="utf-8", timeout=TIMEOUT, dimensions=(50, 250))
    child.expect_exact(PROMPT)
    yield child
    child.sendeof()  # Ctrl-D leaves
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def command(chat, line: str, reply: str) -> str:
    """Send a line, wait for reply and then the prompt; return all it printed."""
    chat.sendline(line)
    chat.expect_exact(reply)
    output = chat.before + reply
    chat.expect_exact(PROMPT)
    return ANSI.sub("", output + chat.before)


def ask(chat, text: str) -> tuple[str, dict]:
    """Send a message; return the answer and the figures of its stats line."""
    chat.sendline(text)
    chat.expect(STATS_LINE)
    answer = ANSI.sub("", chat.before.split(LINE_ACCEPTED)[-1]).strip()
    figures = dict(zip(("tokens", "prompt", "cached"), map(int, chat.match.groups())))
    chat.expect_exact(PROMPT)
    return answer, figures


def start_afresh(chat) -> None:
    command(chat, "/reset", "conversation cleared")
    command(chat, "/set max_tokens 16", "max_tokens = 16")


def test_second_turn_sees_the_first_and_reset_forgets(chat):
    start_afresh(chat)
    ask(chat, "The secret word is banana.")

    answer, figures = ask(chat, "What is the secret word?")

    assert "banana" in answer.lower()
    assert figures["cached"] >= 16  # the first turn's blocks came from the prefix cache
    command(chat, "/reset", "conversation cleared")
    answer, figures = ask(chat, "What is the secret word?")
    assert "banana" not in answer.lower()


def test_save_then_load_restores_the_conversation(chat, tmp_path):
    start_afresh(chat)
    chat.sendline("The secret word is banana.\\")  # a trailing backslash continues the message
    chat.expect_exact("...")
    ask(chat, "Remember it.")
    path = tmp_path / "conversation.json"

    command(chat, f"/save {path}", "saved 2 messages")
    command(chat, "/reset", "conversation cleared")
    command(chat, f"/load {path}", "loaded 2 messages")
    answer, _ = ask(chat, "What is the secret word?")

    saved = json.loads(path.read_text())["messages"]
    assert [m["role"] for m in saved] == ["user", "assistant"]
    assert saved[0]["content"] == "The secret word is banana.\nRemember it."
    assert "banana" in answer.lower()
    output = command(chat, f"/load {tmp_path / 'missing.json'}", "error: cannot read")
    assert "Traceback" not in output


def test_ctrl_c_stops_the_answer_and_frees_its_blocks(chat):
    start_afresh(chat)
    command(chat, "/set max_tokens 250", "max_tokens = 250")
    chat.sendline("Write a long story about a dragon.")
    chat.expect_exact(LINE_ACCEPTED)
    chat.expect(ANSWER_WORD)  # the answer has begun

    chat.sendcontrol("c")
    chat.expect_exact("[interrupted]")
    chat.expect_exact(PROMPT)

    assert not re.search(STATS_LINE, chat.before)
    stats = command(chat, "/stats", "memory:")
    assert re.search(r"conversation: 2 messages", stats)  # the answer stays as far as it got
    assert re.search(r"KV pool: \d+ blocks of 16 tokens: 0 used, 0 shared", stats)


def test_a_conversation_that_outgrows_the_context_loses_its_oldest_turns(chat):
    start_afresh(chat)
    command(chat, "/set max_tokens 4", "max_tokens = 4")
    filler = "Here are some words to remember: " + " ".join(["apple", "river", "stone", "cloud"] * 24)
    ask(chat, filler)
    ask(chat, filler)

    chat.sendline(filler)
    chat.expect(r"dropped the (\d+) oldest messages")
    dropped = int(chat.match.group(1))
    chat.expect(STATS_LINE)
    prompt_tokens = int(chat.match.group(2))
    chat.expect_exact(PROMPT)

    assert dropped >= 2
    assert prompt_tokens <= CONTEXT
    output = command(chat, " ".join(["word"] * 400), "error: the message takes")
    assert "Traceback" not in output



def test_a_spinner_tells_the_prompt_is_processing_before_the_first_token(chat):
    start_afresh(chat)
    chat.sendline("Tell me about the moon.")
    chat.expect_exact(LINE_ACCEPTED)
    chat.expect(SPINNER)
    spinner_tokens = int(chat.match.group(1))
    assert not re.search(ANSWER_WORD, ANSI.sub("", chat.before))  # nothing of the answer came before it
    chat.expect(ANSWER_WORD)
    chat.expect(STATS_LINE)
    prompt_tokens = int(chat.match.group(2))
    chat.expect_exact(PROMPT)

    assert spinner_tokens == prompt_tokens


def test_bye_and_quit_leave(model_path, tmp_path):
    for word in ("/bye", "/quit"):
        child = pexpect.spawn(sys.executable, [*CHAT, "--model", str(model_path)],
                              env=chat_env(tmp_path), encoding="utf-8", timeout=TIMEOUT, dimensions=(24, 80))
        child.expect_exact(PROMPT)
        child.sendline(word)
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0


def test_piped_chat_keeps_notes_and_stats_off_stdout(model_path, tmp_path):
    result = subprocess.run(
        [sys.executable, *CHAT, "--model", str(model_path), "--temp", "0", "-n", "12", "-c", "256"],
        input="The secret word is banana. Say it.\n/stats\n/bye\n", capture_output=True, text=True,
        env=chat_env(tmp_path), timeout=TIMEOUT)

    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() and "banana" in result.stdout.lower()
    for note in ("/help lists the commands", "conversation: 2 messages", "of 256 context tokens", "tokens/s"):
        assert note in result.stderr and note not in result.stdout
    assert "\x1b" not in result.stdout + result.stderr  # no terminal: no colours, no spinner


@pytest.mark.parametrize("no_color", [False, True], ids=["colour", "NO_COLOR"])
def test_errors_are_red_unless_no_color(model_path, tmp_path, no_color):
    env = {**chat_env(tmp_path), **({"NO_COLOR": "1"} if no_color else {})}
    child = pexpect.spawn(sys.executable, [*CHAT, "--model", str(model_path)],
                          env=env, encoding="utf-8", timeout=TIMEOUT, dimensions=(24, 80))
    child.expect_exact(PROMPT)
    child.sendline("/frobnicate")
    child.expect_exact("unknown command /frobnicate")
    line = child.before
    child.sendline("/quit")
    child.expect(pexpect.EOF)

    assert bool(re.search(r"\x1b\[[0-9;]*31m", line)) != no_color


def test_answers_stream_as_markdown_and_end_rendered_whole():
    answer = "Steps:\n\n1. **Boil** the water\n2. Add `tea`\n\n```python\nprint('brewed')\n```\n" + "\n".join(
        f"- line {i}" for i in range(30))
    screen = io.StringIO()
    view = MarkdownStream(Console(file=screen, force_terminal=True, width=60, height=12, color_system=None))
    for i in range(0, len(answer), 7):  # pieces as a stream brings them
        view.add(answer[i:i + 7])
    view.end()

    final = ANSI.sub("", screen.getvalue()).split("Steps:")[-1]  # the last, whole rendering
    assert "**" not in final and "```" not in final and "`tea`" not in final
    assert "Boil" in final and "print('brewed')" in final
    assert [f"line {i}" in final for i in range(30)] == [True] * 30
    assert re.search(r"•\s+line 29", final)
