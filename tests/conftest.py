"""Shared fixtures: a tiny random model for fast tests, and the real default model, pulled once into the cache.

The whole session runs with EDGESERVE_HOME in a temporary folder, so no test writes into the user's cache
(converted.json, pulled models). Real models are read from the user's cache through EDGESERVE_MODELS_CACHE
(a CI machine may point that at a folder it fills once); what is missing there is pulled into the temporary
home. At the end, the session fails if anything in the user's cache changed.

Tests that use the real model (the model_path and loaded_model fixtures) are marked slow here; files that load
another real model, build a wheel or drive tmux mark themselves.
"""

import contextlib
import io
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

# Under pytest-xdist with a worker a core, each worker (and the servers and commands it starts) keeps to its own
# core: the kernels size their thread pools by the cores a process may run on, and two workers each running
# a pool on every core make them wait on one another (a test took 3x its time alone, not 2x).
# The thread pool's own tests take every core back (the every_core fixture).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
_CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
_OWN_CORE = None
if _WORKER.startswith("gw") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) == len(_CORES) > 1:
    _OWN_CORE = {_CORES[int(_WORKER[2:]) % len(_CORES)]}
    os.sched_setaffinity(0, _OWN_CORE)

# The suite holds the quantized kernels to the exact int16 path's tolerances (subprocesses inherit
# this); the int8 default has its own tests against its own rounding (test_qmatmul_int8.py).
os.environ["EDGESERVE_ACTIVATIONS"] = "int16"

import sentencepiece as spm
import tokenizers

from edgeserve.backends import qmatmul as qm
from edgeserve.models.catalog import DEFAULT_MODEL, home, pull
from edgeserve.models.base import ModelArgs
from edgeserve.models.loader import LoadedModel
from edgeserve.text.tokenizer import Tokenizer

USER_HOME = home()  # read before the override below
os.environ.setdefault("EDGESERVE_MODELS_CACHE", str(USER_HOME))
os.environ["EDGESERVE_HOME"] = tempfile.mkdtemp(prefix="edgeserve-test-home-")
REAL_MODEL_FIXTURES = {"model_path", "loaded_model"}


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Each file under folder: (size, modification time)."""
    if not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): (st.st_size, st.st_mtime_ns)
            for p in folder.rglob("*") if not p.is_symlink() and p.is_file() and (st := p.stat())}


USER_HOME_BEFORE = _snapshot(USER_HOME)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """-n auto: a worker a core, at most 4 (each real-model test runs the kernels on every core, and each worker
    pulls the real models it needs into its own EDGESERVE_HOME)."""
    return max(1, min(4, os.cpu_count() or 1))


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        # the numba fallback's own variants of the matmul tests: each compiles its kernels (~10 s of CPU)
        callspec = getattr(item, "callspec", None)
        if callspec is not None and "numba" in callspec.id.split("-"):
            item.add_marker(pytest.mark.slow)


def _every_thread_on(cores: set[int] | list[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)


@pytest.fixture
def every_core():
    """The test's process on every core, its threads started before included, where the worker keeps to one: the
    kernels' thread pool then runs on several cores for real."""
    if _OWN_CORE is None:
        yield
        return
    _every_thread_on(_CORES)
    try:
        yield
    finally:
        _every_thread_on(_OWN_CORE)
        qm.set_num_threads()  # the kernels' default again: the worker's one core


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(os.environ["EDGESERVE_HOME"], ignore_errors=True)
    after = _snapshot(USER_HOME)
    changed = sorted(k for k in USER_HOME_BEFORE.keys() | after.keys() if USER_HOME_BEFORE.get(k) != after.get(k))
    if changed:
        print(f"\nthe tests changed the user's cache {USER_HOME}: {', '.join(changed[:10])}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

# Loading a GGUF model saves its repacked panels under EDGESERVE_HOME, a second copy of the model on
# disk: off unless a test turns it on (tests/test_panel_cache.py).
os.environ["EDGESERVE_PANEL_CACHE"] = "0"


TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(folder: Path) -> Tokenizer:
    """A character-level byte BPE over printable ASCII and newline (no merges) plus ChatML tokens.

    Every id decodes to exactly one character, so random outputs are plain text.
    """
    chars = ["\u010a", "\u0120", *map(chr, range(33, 127))]  # byte-level spelling of newline, space, then ASCII
    vocab = {tok: i for i, tok in enumerate([*TINY_SPECIAL_TOKENS, *chars])}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, []))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(TINY_SPECIAL_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "add_bos_token": False,
              "chat_template": TINY_CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return Tokenizer.from_dir(folder)


def tiny_model_from(folder: Path, seed: int = 0, heads: int = 4) -> LoadedModel:
    """Two layers, 64 wide, random weights from a seeded generator, over the tiny tokenizer; heads query heads
    (half as many KV heads, at least one)."""
    tokenizer = tiny_tokenizer(folder)
    args = ModelArgs(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=heads,
                     num_key_value_heads=max(1, heads // 2), vocab_size=tokenizer.vocab_size,
                     max_position_embeddings=4096)
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    h, kv, f = args.hidden_size, args.num_key_value_heads * args.head_dim, args.intermediate_size
    # an untied head: with tied embeddings a random model tends to repeat its last token forever
    weights = {"model.embed_tokens.weight": w(args.vocab_size, h), "lm_head.weight": w(args.vocab_size, h),
               "model.norm.weight": np.ones(h, np.float32)}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
            p + "self_attn.q_proj.weight": w(h, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
        })
    return LoadedModel(args, weights, tokenizer, folder, "safetensors")


SPM_WORDS = (
    "the quick brown fox jumps over lazy dog hello world café naïve über 東京 日本語 テスト".split()
)


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> tuple[Path, spm.SentencePieceProcessor]:
    """A tiny Llama-style SentencePiece BPE model (identity normalizer, byte fallback)."""
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(SPM_WORDS) for _ in range(12)) for _ in range(300)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=340,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        control_symbols=["<|im_end|>"],
        user_defined_symbols=["<|im_start|>"],
        minloglevel=2,
    )
    folder = tmp_path_factory.mktemp("spm")
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder, spm.SentencePieceProcessor(model_proto=model.getvalue())


@pytest.fixture
def impl(request):
    """Select a qmatmul code path ("c/<isa>" or "numba", parametrized indirectly) for one test, restoring the default C path afterwards."""
    name = request.param
    if name.startswith("c/"):
        qm._ext.set_isa(name[2:])
        yield "c"
        qm._ext.set_isa(None)
    else:
        yield name


@pytest.fixture
def mlx_on_cpu():
    """MLX on the CPU for one test, where its activations are float32 whatever the machine has."""
    import mlx.core as mx

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """A tiny random model: engine, scheduler and server tests on it run in milliseconds."""
    return tiny_model_from(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The default catalog model's GGUF file (pulled on first use)."""
    return pull(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def loaded_model(model_path: Path):
    """The default model parsed once per test session (GGUF parsing takes seconds)."""
    from edgeserve.models.loader import load_model

    return load_model(str(model_path))
