"""`edgeserve tui`: sessions streaming together through Textual's test pilot, against the in-process engine
and against a running server, and the real screen in tmux."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from click.testing import CliRunner
from starlette.responses import PlainTextResponse
from textual import events
from textual.keys import _character_to_key
from textual.widgets import Input

from edgeserve.engine.async_engine import AsyncEngine
from edgeserve.cli.chat_clients import EngineClient, RemoteClient, stats_report
from edgeserve.cli.main import cli
from edgeserve.cli.options import build_engine
from edgeserve.config import EngineConfig
from edgeserve.cli.tui_app import EdgeserveApp, HelpScreen, SessionPane
from edgeserve.cli.tui_panels import GLYPHS, PANEL_WIDTH, KVMap, StatusPanel
from edgeserve.server.app import create_app
from tmux_screen import EXIT_MARK, TmuxScreen

TIMEOUT = 180.0  # seconds for answers on a slow, shared CPU
GREEDY = {"temperature": 0.0}
LONG_PROMPT = "Write a long story about a dragon."


@pytest.fixture(scope="module")
def aengine(model_path) -> Iterator[AsyncEngine]:
    # these tests look at answers while they stream: with speculative decoding (on by default on the CPU) an answer to
    # a prompt asked before is guessed from the earlier one and may be done before it is looked at
    engine = build_engine(str(model_path), EngineConfig(backend="numpy", kv_memory="256MiB", speculative="off"),
                          quiet=True)
    aengine = AsyncEngine(engine)
    yield aengine
    aengine.shutdown()


def tui(client, max_tokens: int, ignore_eos: bool = False) -> EdgeserveApp:
    settings = {**GREEDY, "max_tokens": max_tokens, "ignore_eos": ignore_eos}
    return EdgeserveApp(client, settings=settings, refresh_interval=0.05)


def screen_text(app) -> str:
    """What the app's screen shows now, as text."""
    return "\n".join(strip.text for strip in app.screen._compositor.render_strips())


async def wait_until(pilot, condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting until {what}")
        await pilot.pause(0.05)


async def send(pilot, pane: SessionPane, text: str) -> None:
    box = pane.query_one(Input)
    box.focus()
    box.value = text
    await pilot.press("enter")


async def engine_state(aengine: AsyncEngine) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The live request ids and the KV map, read on the engine thread after what was queued before."""
    return await aengine.call(lambda engine: (engine.request_ids(), engine.kv_map()))


async def test_three_sessions_stream_at_once_and_hold_blocks_in_the_kv_map(aengine):
    # answers of a fixed length (no early stop), long enough to overlap on a fast machine (the first one
    # streams 480 tokens: at 320 the others, queued a moment later, did not always catch it in a full run)
    app = tui(EngineClient(aengine), max_tokens=250, ignore_eos=True)
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.press("ctrl+n", "ctrl+n")
        sessions = app.sessions
        assert len(sessions) == 3 and len({s.colour for s in sessions}) == 3
        kv_map, panel = app.query_one(KVMap), app.query_one(StatusPanel)
        colours = {s.colour for s in sessions}
        together, shared = [], []

        def watch() -> bool:
            holders = {app.colour_of(owner) for owner in kv_map.owners()}
            drawn = {str(span.style) for span in kv_map.render().spans}
            if holders == colours and colours <= drawn and panel.status.running == 3:
                together.append(panel.status.batch_size)
            shared.extend(b for b in kv_map.blocks if b.state == "shared" and len(b.owners) > 1)
            return not any(s.answering for s in sessions)

        # the first answer is the longest, and the others start while it streams: they find the
        # blocks of the prompt start they have in common with it in the prefix cache, and share them
        await send(pilot, sessions[0], "/set max_tokens 480")
        await send(pilot, sessions[0], LONG_PROMPT)
        await wait_until(pilot, lambda: sessions[0].streamed_tokens >= 1, "the first answer streams")
        await send(pilot, sessions[1], "Write a poem about the sea.")  # answers that take a while,
        await send(pilot, sessions[2], "Describe a forest in detail.")  # so the three overlap
        await wait_until(pilot, watch, "the three answers finish")

        assert together, "never saw the three sessions running together, each holding KV blocks"
        assert max(together) == 3  # one batch carried all three
        assert shared, "never saw a block shared through the prefix cache"
        for pane in sessions:
            assert pane.conversation.turns[-1]["role"] == "assistant"
            assert pane.conversation.turns[-1]["content"].strip()
            assert pane.last_stats.finish_reason in ("stop", "length")
        await wait_until(pilot, lambda: {b.state for b in kv_map.blocks} <= {"free", "cached"},
                         "the map shows every block free or cached")
        assert any(b.state == "cached" for b in kv_map.blocks)


async def test_stopping_keeps_the_session_and_closing_aborts_its_request(aengine):
    app = tui(EngineClient(aengine), max_tokens=200)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.sessions[0]
        await send(pilot, pane, LONG_PROMPT)
        await wait_until(pilot, lambda: pane.streamed_tokens >= 2, "the answer streams")

        await pilot.press("escape")
        await wait_until(pilot, lambda: not pane.answering, "the answer stops")

        assert app.sessions == [pane]
        assert pane.conversation.turns[-1]["role"] == "assistant"  # kept as far as it got
        live, _ = await engine_state(aengine)
        assert live == []

        await send(pilot, pane, LONG_PROMPT)
        await wait_until(pilot, lambda: pane.streamed_tokens >= 2, "the next answer streams")
        request_id = pane.request_id
        live, kv = await engine_state(aengine)
        assert request_id in live and any(request_id in owners for _, owners in kv)

        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: pane not in app.sessions, "the session closes")

        live, kv = await engine_state(aengine)
        assert live == []
        assert {state for state, _ in kv} <= {"free", "cached"}


async def test_each_session_keeps_its_own_settings_and_the_help_lists_the_keys(aengine):
    app = tui(EngineClient(aengine), max_tokens=8)
    async with app.run_test(size=(160, 45)) as pilot:
        await pilot.press("ctrl+n")
        first, second = app.sessions
        await send(pilot, first, "/system Answer in French.")
        await send(pilot, first, "/set temperature 0.4")
        await send(pilot, second, "/set temperature 2.5")

        assert (first.conversation.system, first.conversation.settings["temperature"]) == ("Answer in French.", 0.4)
        assert (second.conversation.system, second.conversation.settings["temperature"]) == (None, 0.0)
        assert "t=0.4" in first.border_title and "t=0" in second.border_title
        assert "temperature must be between 0 and 2" in str(second.query(".error").last().render())

        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        help_text = screen_text(app)
        assert all(key in help_text for key in ("Ctrl+N", "Ctrl+W", "Esc", "/system", "/set"))
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


# against a server --------------------------------------------------------------------


def without_edgeserve_extras(app):
    """The edgeserve server with its KV map and metrics removed: any other OpenAI-compatible server."""

    async def plain(scope, receive, send):
        if scope["type"] == "http" and scope["path"] in (RemoteClient.KV_PATH, RemoteClient.METRICS_PATH):
            return await PlainTextResponse("Not Found", status_code=404)(scope, receive, send)
        return await app(scope, receive, send)

    return plain


@contextmanager
def serving(app) -> Iterator[str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.mark.parametrize("edgeserve_server", [True, False], ids=["edgeserve", "other-server"])
async def test_a_session_streams_from_a_server(aengine, edgeserve_server):
    server_app = create_app(aengine, "smollm2-135m-instruct")
    with serving(server_app if edgeserve_server else without_edgeserve_extras(server_app)) as url:
        # streams long enough for a KV-map poll to see it, on a fast machine too
        app = tui(RemoteClient(url), max_tokens=300, ignore_eos=True)
        async with app.run_test(size=(160, 45)) as pilot:
            pane, kv_map = app.sessions[0], app.query_one(KVMap)
            assert app.client.model_name == "smollm2-135m-instruct"
            holders: set = set()

            def done() -> bool:
                holders.update(app.colour_of(owner) for owner in kv_map.owners())
                return not pane.answering

            await send(pilot, pane, LONG_PROMPT)
            await wait_until(pilot, done, "the answer finishes")

            assert pane.conversation.turns[-1]["content"].strip()
            assert pane.last_stats.prompt_tokens > 0
            if edgeserve_server:
                assert pane.colour in holders  # the server's request ids were traced back to the session
            else:
                assert kv_map.blocks is None
                assert "no KV map" in str(kv_map.render())


def test_a_server_that_is_not_there_is_one_line_of_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here once the socket closes
    result = CliRunner().invoke(cli, ["tui", "--url", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith(f"error: cannot list the models of http://127.0.0.1:{port}")
    assert "Traceback" not in result.stderr


# the real screen --------------------------------------------------------------------

def tui_args(model_path, *more: str) -> list[str]:
    return ["tui", "--model", str(model_path), "--backend", "numpy", "--kv-memory", "32MiB", "--temp", "0", *more]


def test_the_real_screen_at_160x48_shows_sessions_and_the_kv_map(model_path, tmp_path):
    tui_screen = TmuxScreen(tui_args(model_path, "-n", "8"), 160, 48, tmp_path)
    try:
        screen = tui_screen.wait_for("Session 1", "KV pool", "blocks × 16 tokens", "one cell: 1 block of 16 tokens")
        assert "model    SmolLM2-135M-Instruct.Q4_1.gguf" in screen
        assert "backend  numpy" in screen
        tui_screen.keys("Hi!", "Enter")
        tui_screen.wait_for("TTFT", "tokens/s · prompt")  # wide: the whole summary
        tui_screen.keys("C-n")
        screen = tui_screen.wait_for("Session 2")
        assert any("Session 1" in line and "Session 2" in line and "engine" in line for line in screen.splitlines())
        tui_screen.keys("C-q")
        screen = tui_screen.wait_for(EXIT_MARK)
        assert f"{EXIT_MARK}0" in screen and "Traceback" not in screen
    finally:
        tui_screen.close()


def test_the_real_screen_at_80x24(model_path, tmp_path):
    saved = tmp_path / "fruit.json"
    saved.write_text(json.dumps([
        {"role": "user", "content": "Fruit?"},
        {"role": "assistant", "content": "Three:\n\n- **apples**\n- pears\n\n```\nplums = 3\n```"}]))
    tui_screen = TmuxScreen(tui_args(model_path, "-n", "200"), 80, 24, tmp_path)
    try:
        screen = tui_screen.wait_for("Session 1", "? Help", "f2 Engine")
        assert "KV pool" not in screen  # the engine panel stays out of the way below 120 columns

        tui_screen.keys(f"/load {saved}", "Enter")
        screen = tui_screen.wait_for("• apples")
        assert "**" not in screen and "```" not in screen and "plums = 3" in screen  # Markdown, drawn

        tui_screen.keys("C-n")
        screen = tui_screen.wait_for("Session 2")
        assert any("Session 1" in line and "Session 2" in line for line in screen.splitlines())  # side by side

        tui_screen.keys("F2")
        tui_screen.wait_for("KV pool", "one cell:")
        tui_screen.keys("F2")
        tui_screen.keys("?")
        tui_screen.wait_for("Keys", "show or hide the engine panel")
        tui_screen.keys("?")  # closes it too (a lone Esc would wait to see if a sequence follows)
        tui_screen.wait_for("f2 Engine")

        tui_screen.keys(LONG_PROMPT, "Enter")
        tui_screen.wait_for("answering ·")
        tui_screen.keys("C-q")  # while the answer streams
        screen = tui_screen.wait_for(EXIT_MARK)
        assert f"{EXIT_MARK}0" in screen
        assert "Traceback" not in screen and "InvalidStateError" not in screen
    finally:
        tui_screen.close()


def _palette(screen: str) -> set[int]:
    """The 256-colour indices a screen capture uses, foreground and background."""
    return {int(n) for n in re.findall(r"\x1b\[[0-9;]*?[34]8;5;(\d+)", screen)}


@pytest.mark.parametrize("no_color", [False, True], ids=["colour", "NO_COLOR"])
def test_no_color_turns_the_screen_grey(model_path, tmp_path, no_color):
    env = {"NO_COLOR": "1"} if no_color else {}
    tui_screen = TmuxScreen(tui_args(model_path), 80, 24, tmp_path, **env)
    try:
        tui_screen.wait_for("Session 1")
        colours = {n for n in _palette(tui_screen.screen(escapes=True)) if not 232 <= n <= 255 and n not in (16, 231)}
        assert (colours == set()) == no_color
    finally:
        tui_screen.close()


# narrow screens, keys, feedback ---------------------------------------------------------------


async def test_the_engine_panel_hides_below_120_columns_and_f2_toggles_it(aengine):
    app = tui(EngineClient(aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+n", "ctrl+n")
        panel, grid = app.query_one(StatusPanel), app.query_one("#sessions")
        assert not panel.display
        assert grid.styles.grid_size_columns == 2  # two readable columns of 40; the third session wraps
        assert all(s.size.width >= 38 for s in app.sessions)

        await pilot.press("f2")
        await pilot.pause()
        assert panel.display and grid.styles.grid_size_columns == 1  # beside the panel, one column fits

        await pilot.press("f2")
        await pilot.resize_terminal(160, 48)
        await pilot.pause()
        assert not panel.display  # F2's choice holds at any width
        app.panel_wanted = None
        await pilot.resize_terminal(161, 48)
        await pilot.pause()
        assert panel.display and grid.styles.grid_size_columns == 3


async def test_question_mark_opens_help_on_an_empty_line_and_is_typed_otherwise(aengine):
    app = tui(EngineClient(aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        box = app.sessions[0].query_one(Input)
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        text = screen_text(app)
        assert "Keys" in text and "F2" in text and "/reset" in text  # the rest scrolls
        await pilot.press("question_mark")
        assert not isinstance(app.screen, HelpScreen)

        await pilot.press("W", "h", "y", "question_mark")
        assert box.value == "Why?" and not isinstance(app.screen, HelpScreen)
        assert "? Help" in screen_text(app)  # the footer says so


async def test_stats_and_the_processing_status_before_the_first_token(aengine):
    app = tui(EngineClient(aengine), max_tokens=12)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+n")  # two sessions side by side: 40 columns each
        pane = app.sessions[0]
        states: list[str] = []
        app.watch(pane, "state", lambda state: states.append(state), init=False)
        await send(pilot, pane, "Tell me about the sea. " * 20)  # a prompt that takes a moment
        await wait_until(pilot, lambda: not pane.answering and pane.last_stats is not None, "the answer ends")
        await wait_until(pilot, lambda: states[-1] == pane.last_stats.brief(), "the border shows the figures")

        waiting = [s for s in states if s.startswith("processing prompt (")]
        assert waiting == [f"processing prompt ({pane.last_stats.prompt_tokens} tokens)…"]
        first_token = next(i for i, s in enumerate(states) if s.startswith("answering"))
        assert states.index(waiting[0]) < first_token
        assert states[-1] == pane.last_stats.brief() and len(states[-1]) < 36  # the short form fits the border

        await send(pilot, pane, "/stats")
        await wait_until(pilot, lambda: "KV pool" in str(pane.query(".note").last().render()), "the stats show")
        stats = str(pane.query(".note").last().render())
        assert "conversation: 2 messages" in stats and "last answer: 12 tokens" in stats


async def test_the_kv_legend_says_how_many_blocks_a_cell_stands_for(model_path):
    engine = build_engine(str(model_path), EngineConfig(backend="numpy", kv_memory="512MiB"), quiet=True)
    big = AsyncEngine(engine)
    try:
        app = tui(EngineClient(big), max_tokens=8)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("f2")
            kv_map, panel = app.query_one(KVMap), app.query_one(StatusPanel)
            await wait_until(pilot, lambda: kv_map.blocks, "the map arrives")
            await pilot.pause(0.2)
            cells = kv_map.size.width * kv_map.size.height
            per_cell = -(-len(kv_map.blocks) // cells)
            assert per_cell > 1
            assert f"one cell: {per_cell} blocks of 16 tokens" in str(panel.kv_legend.render())
            drawn = str(kv_map.render()).replace("\n", "")
            assert len(drawn) == -(-len(kv_map.blocks) // per_cell) <= cells
    finally:
        big.shutdown()


async def test_quitting_while_answers_stream_leaves_no_error(tiny_aengine, caplog):
    # the race is the TUI's and the engine thread's, not the model's: the tiny model streams faster
    # than the real one, so more of its tokens are in flight at the quit
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
    for _ in range(8):
        app = tui(EngineClient(tiny_aengine), max_tokens=3000, ignore_eos=True)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.press("ctrl+n")
            # both questions go in at once through Enter's own action: a pilot key press waits for the
            # process to idle, which it never does while an answer streams (seconds a press)
            for pane in app.sessions:
                box = pane.query_one(Input)
                box.value = LONG_PROMPT
                await box.action_submit()
            await wait_until(pilot, lambda: all(p.streamed_tokens >= 1 for p in app.sessions), "both stream")
            assert all(p.answering for p in app.sessions)  # the quit below lands mid-answer
            await pilot.press("ctrl+q")
        live, _ = await engine_state(tiny_aengine)
        assert live == []  # the quit aborted both answers
    await asyncio.sleep(0.1)
    assert errors == []
    assert not [r for r in caplog.records if "InvalidStateError" in r.getMessage()]


# first frames, fast typing, the last session, narrow screens, a redirected stderr ----------------


@pytest.fixture
def tiny_aengine(tiny_model) -> Iterator[AsyncEngine]:
    """An engine over the tiny random model: the TUI's own behaviour, without waiting on a real one."""
    from edgeserve.engine.llm_engine import LLMEngine

    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB")))
    yield aengine
    aengine.shutdown()


async def test_a_question_mark_typed_fast_at_the_end_of_a_line_is_typed(tiny_aengine):
    app = tui(EngineClient(tiny_aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        box = app.sessions[0].query_one(Input)
        for character in "And 3+3?":  # as a terminal delivers fast typing: all queued before any is handled
            app.post_message(events.Key(_character_to_key(character), character))
        await pilot.pause(0.2)

        assert box.value == "And 3+3?"
        assert not isinstance(app.screen, HelpScreen)


async def test_the_kv_map_waits_for_its_first_snapshot_rather_than_saying_there_is_none(tiny_aengine):
    app = EdgeserveApp(EngineClient(tiny_aengine), refresh_interval=3600)  # no snapshot but the one asked for
    async with app.run_test(size=(160, 45)) as pilot:
        kv_map = app.query_one(KVMap)
        first = screen_text(app)
        assert "no KV map" not in first and "waiting for the first snapshot" in first

        await app.refresh_status()
        await pilot.pause()

        assert kv_map.blocks and "waiting" not in str(kv_map.render())
        assert set(str(kv_map.render()).replace("\n", "")) <= set(GLYPHS.values())


async def test_closing_the_last_session_opens_a_fresh_one(tiny_aengine):
    app = tui(EngineClient(tiny_aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("ctrl+w")
        await wait_until(pilot, lambda: [s.number for s in app.sessions] == [2], "a fresh session opens")
        await pilot.pause()

        assert app.current_session() is app.sessions[0]  # its input line has the focus: ready to type
        assert "Session 2" in screen_text(app)


async def test_the_engine_panel_takes_a_third_of_a_narrow_screen(tiny_aengine):
    app = tui(EngineClient(tiny_aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.press("f2")
        await pilot.pause()
        panel, pane = app.query_one(StatusPanel), app.sessions[0]

        assert panel.display and panel.outer_size.width <= 80 * 0.36
        assert pane.outer_size.width >= 80 - panel.outer_size.width
        await pilot.resize_terminal(160, 45)
        await pilot.pause()
        assert panel.outer_size.width == PANEL_WIDTH  # its full width, where there is room


async def test_answers_keep_their_line_breaks(tiny_aengine, tmp_path):
    poem = "Roses are red,\nviolets are blue,\nsugar is sweet.\n\n```\nkeep = 1\nthis = 2\n```"
    saved = tmp_path / "poem.json"
    saved.write_text(json.dumps([{"role": "user", "content": "A poem?"}, {"role": "assistant", "content": poem}]))
    app = tui(EngineClient(tiny_aengine), max_tokens=8)
    async with app.run_test(size=(80, 24)) as pilot:
        await send(pilot, app.sessions[0], f"/load {saved}")
        await pilot.pause()

        lines = [line.strip(" │╭╮╰╯─") for line in screen_text(app).splitlines()]
        verses = ["Roses are red,", "violets are blue,", "sugar is sweet.", "keep = 1", "this = 2"]
        assert all(verse in lines for verse in verses), "\n".join(lines)


def test_a_tui_that_cannot_draw_on_stderr_says_so_on_stdout(tmp_path):
    log = tmp_path / "stderr.txt"
    with log.open("w") as stderr:
        result = subprocess.run(
            [sys.executable, "-c", "from edgeserve.cli.main import cli; cli()", "tui", "--model", "no-such-model"],
            stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=120, stdin=subprocess.DEVNULL,
            env={**os.environ, "EDGESERVE_HOME": str(tmp_path)})

    assert result.returncode == 1
    assert "the TUI draws on stderr, which is not a terminal here" in result.stdout
    assert "not a terminal" in log.read_text() and "Traceback" not in log.read_text()


async def test_the_engine_panel_counts_prompt_tokens_loaded_from_the_prefix_store(tiny_model):
    from test_prefix_store import generate, prompt, tiny_engine

    engine = tiny_engine(tiny_model, prefix_cache_ram="1MiB")
    aengine = AsyncEngine(engine)
    try:
        app = tui(EngineClient(aengine), max_tokens=8)
        async with app.run_test(size=(160, 45)) as pilot:
            title = app.query_one(StatusPanel).kv_title
            await pilot.pause(0.3)
            assert "prefix store" not in str(title.render())  # no line while it has given nothing back
            # a prompt, another that evicts its blocks into the RAM tier, then the first again
            await aengine.call(lambda e: [generate(e, prompt(seed, n)) for seed, n in ((0, 97), (1, 150), (0, 97))])
            await wait_until(pilot, lambda: "prefix store tokens: 96 ram, 0 disk" in str(title.render()),
                             "the panel shows the RAM tier's hits")
    finally:
        aengine.shutdown()


@pytest.mark.parametrize("through_server", [False, True], ids=["in-process", "server"])
async def test_the_engine_panel_shows_how_often_speculative_guesses_are_right(tiny_model, through_server):
    from edgeserve.engine.llm_engine import LLMEngine

    aengine = AsyncEngine(LLMEngine(tiny_model, EngineConfig(backend="numpy", kv_memory="16MiB", speculative="ngram")))
    try:
        with serving(create_app(aengine, "tiny")) as url:
            client = RemoteClient(url) if through_server else EngineClient(aengine)
            app = tui(client, max_tokens=24, ignore_eos=True)
            async with app.run_test(size=(160, 45)) as pilot:
                figures, pane = app.query_one(StatusPanel).figures, app.sessions[0]
                await pilot.pause(0.3)
                assert "guesses" not in str(figures.render())  # no line before a guess was checked
                await send(pilot, pane, "one two three one two three one two three one two")
                await wait_until(pilot, lambda: not pane.answering, "the answer finishes")
                st = await aengine.call(lambda e: e.stats())
                assert st.draft_checks > 0
                shown = (f"guesses  {100 * st.accepted_draft_tokens / st.draft_tokens:.0f}% right, "
                         f"{(st.accepted_draft_tokens + st.draft_checks) / st.draft_checks:.2f} tokens a check")
                await wait_until(pilot, lambda: shown in str(figures.render()), "the panel shows the engine's figures")
                assert "speculative guesses: " + shown.removeprefix("guesses  ") in await stats_report(
                    client, pane.conversation, None)  # and the chat's /stats
    finally:
        aengine.shutdown()
