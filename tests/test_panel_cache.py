"""The panel cache: a GGUF model's repacked matrices saved once and mapped on later starts."""

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from bench_scripts import write_tiny

from edgeserve import system
from edgeserve.backends import pages, panel_cache, qmatmul, resident_weight_bytes
from edgeserve.backends.qmatmul import QMatrix
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models import loader
from edgeserve.models.loader import load_model
from edgeserve.quant.gguf_file import read_gguf

PROMPT = "The quick brown fox"


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGESERVE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(panel_cache.ENV_VAR, "1")
    return tmp_path / "home" / "panels"


@pytest.fixture(scope="module")
def model_file(tmp_path_factory, model_path):
    # Q4_K_M mixes Q4_K and Q6_K panels, q/k rows reordered for RoPE and a separate output head
    return write_tiny(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "q4_k_m", model_path)


def logits(path) -> tuple[np.ndarray, LLMEngine]:
    model = load_model(str(path))
    engine = LLMEngine(model, EngineConfig(backend="numpy", weights="quantized", kv_memory="16MiB"))
    return engine.prompt_logits(model.tokenizer.encode(PROMPT)), engine


def mapped_matrices(engine: LLMEngine) -> list[QMatrix]:
    """The engine's QMatrix weights whose packed words are views of a mapped cache file."""
    model = engine.runner.model
    mats = [model.embed, model.lm_head] + [m for layer in model.layers
                                           for m in (layer.attention.qkv, layer.attention.o, layer.mlp.gate_up, layer.mlp.down)]

    def is_mapped(a: np.ndarray) -> bool:
        while a is not None and not isinstance(a, np.memmap):
            a = a.base
        return a is not None and str(a.filename).endswith(".panels")  # not the partial file a first run writes

    return [m for m in mats if all(is_mapped(s.packed) for s in m.segments)]


@pytest.fixture(scope="module")
def uncached(model_file):
    """The logits with the cache off: what every cached run must reproduce bit for bit."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(panel_cache.ENV_VAR, "0")
        return logits(model_file)[0]


def test_a_miss_writes_the_cache_and_a_hit_maps_it_without_reading_the_weights(cache_home, model_file, uncached,
                                                                               monkeypatch):
    first, engine = logits(model_file)
    files = list(cache_home.glob("*.panels"))
    assert len(files) == 1 and not list(cache_home.glob("*.partial"))
    np.testing.assert_array_equal(first, uncached)
    assert len(mapped_matrices(engine)) == 2 + 4 * 8  # the first run already computes from the finished file

    def no_conversion(t):
        if len(t.shape) == 2:
            raise AssertionError(f"{t.name} converted on a cache hit")
        return real(t)

    real = loader.gguf_tensor_to_array
    monkeypatch.setattr(loader, "gguf_tensor_to_array", no_conversion)
    second, engine = logits(model_file)
    np.testing.assert_array_equal(second, uncached)
    assert len(mapped_matrices(engine)) == 2 + 4 * 8
    assert list(cache_home.glob("*.panels")) == files


def test_counting_a_models_quantized_bytes_converts_no_matrix(tmp_path, model_path, monkeypatch):
    """The resident bytes `edgeserve info` prints for a Q4_0 file come from its blocks as they are (counting them
    converted every matrix: 8.5 s and 3.4 GB for a 3B file): the Q4_0 values and scales exactly, as prepare holds
    them (no biases), the Q6_K head at 212 bytes a super-block, the rest float32."""
    path = write_tiny(tmp_path / "q4_0.gguf", "q4_0", model_path)
    expected = 0
    for t in read_gguf(path).tensors.values():
        values = int(np.prod(t.shape))
        if len(t.shape) == 2 and t.qtype == gguf.GGMLQuantizationType.Q6_K:
            expected += values // 256 * 212
        else:
            expected += t.data.nbytes if len(t.shape) == 2 else 4 * values

    def no_conversion(t):  # K-quants pass through as their blocks
        if len(t.shape) == 2 and t.qtype != gguf.GGMLQuantizationType.Q6_K:
            raise AssertionError(f"{t.name} converted to count its bytes")
        return real(t)

    real = loader.gguf_tensor_to_array
    monkeypatch.setattr(loader, "gguf_tensor_to_array", no_conversion)
    assert resident_weight_bytes(load_model(str(path)), "quantized") == expected


def test_a_changed_model_file_misses_and_replaces_its_cache(cache_home, model_file, tmp_path, model_path):
    path = write_tiny(tmp_path / "changing.gguf", "q4_k_m", model_path, seed=1)
    before, _ = logits(path)
    (old,) = cache_home.glob("changing-*.panels")
    write_tiny(path, "q4_k_m", model_path, seed=2)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a later mtime, whatever the clock
    after, _ = logits(path)
    (new,) = cache_home.glob("changing-*.panels")
    assert new != old  # the old file's cache is gone, not kept beside
    assert not np.array_equal(before, after)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(panel_cache.ENV_VAR, "0")
        np.testing.assert_array_equal(after, logits(path)[0])


def test_a_new_layout_version_misses(cache_home, model_file, monkeypatch):
    logits(model_file)
    (old,) = cache_home.glob("*.panels")
    monkeypatch.setattr(qmatmul, "PANEL_LAYOUT_VERSION", "a layout not seen before")
    logits(model_file)
    (new,) = cache_home.glob("*.panels")
    assert new != old


@pytest.mark.parametrize("damage", ["truncated", "garbled index", "garbage", "empty"])
def test_a_damaged_cache_file_is_rebuilt_not_an_error(cache_home, model_file, uncached, damage):
    logits(model_file)
    for thread in panel_cache.moving():
        thread.join()  # the file is damaged in place below, as no process that maps it would survive
    (path,) = cache_home.glob("*.panels")
    raw = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbled index":
        path.write_bytes(raw[:-200] + b"{" * 176 + raw[-24:])
    elif damage == "garbage":
        path.write_bytes(np.random.default_rng(0).bytes(len(raw)))
    else:
        path.write_bytes(b"")
    rebuilt, engine = logits(model_file)
    np.testing.assert_array_equal(rebuilt, uncached)
    assert path.read_bytes() == raw  # written again, the same bytes
    assert len(mapped_matrices(engine)) == 2 + 4 * 8


def test_the_cache_off_writes_nothing(cache_home, model_file, monkeypatch):
    monkeypatch.setenv(panel_cache.ENV_VAR, "0")
    _, engine = logits(model_file)
    assert not cache_home.exists() and mapped_matrices(engine) == []


def test_an_unwritable_cache_folder_leaves_the_weights_in_memory(cache_home, model_file, uncached):
    cache_home.parent.mkdir(parents=True)
    cache_home.write_text("a file where the cache folder would go")
    answer, engine = logits(model_file)
    np.testing.assert_array_equal(answer, uncached)
    assert mapped_matrices(engine) == [] and not list(cache_home.parent.glob("*.partial"))


RESIDENT_KIB = """
import re, sys
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.loader import load_model
path = sys.argv[1]
model = load_model(path)
LLMEngine(model, EngineConfig(backend="numpy", weights="quantized", kv_memory="16MiB")).prompt_logits(
    model.tokenizer.encode("The quick brown fox"))
kib, mapping = 0, False
for line in open("/proc/self/smaps"):
    if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
        mapping = line.rstrip().endswith(path)
    elif mapping and line.startswith("Rss:"):
        kib += int(line.split()[1])
print(kib)
"""


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads a mapping's resident pages from Linux's /proc")
def test_a_hit_leaves_none_of_the_model_file_resident(cache_home, model_file):
    """Loading touches the file's metadata and norms (2 MiB at a time where the kernel maps large folios); once the
    panels are mapped those pages are dropped, so the process holds the model about once, not once and a bit."""
    logits(model_file)  # the miss writes the cache
    done = subprocess.run([sys.executable, "-c", RESIDENT_KIB, str(model_file)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) <= 64, f"{done.stdout.strip()} KiB of the model file resident"


def _anonymous_bytes(start: int, end: int) -> int:
    """The bytes of anonymous memory (no file behind them) this process has mapped in [start, end)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: range, perms, offset, device, inode
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = start <= lo and hi <= end and head[4] == "0"
            elif inside and head[0] == "Anonymous:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the process's mappings from Linux's /proc")
def test_a_mapped_cache_file_moves_to_anonymous_memory_every_byte_in_place(tmp_path):
    """The kernels stream panels faster from anonymous (huge) pages than from a file's: the map moves there in the
    background, while steps read it, at the same addresses and with the same bytes; once per file and process."""
    path = tmp_path / "m.panels"
    expected = np.random.default_rng(0).integers(0, 256, (40 << 20) + 12345, dtype=np.uint8)
    expected.tofile(path)
    for thread in panel_cache.moving():
        thread.join()  # an earlier test's
    data = panel_cache._mapped(path)
    address = data.ctypes.data
    moving = panel_cache.moving()
    assert len(moving) == 1
    assert panel_cache._mapped(path) is data and panel_cache.moving() == moving  # shared, moved once
    sums = []
    while moving[0].is_alive():  # read while chunks are swapped in
        sums.append(int(data[:: 4096].sum()))
    moving[0].join()
    assert set(sums) <= {int(expected[:: 4096].sum())}
    np.testing.assert_array_equal(data, expected)
    assert data.ctypes.data == address
    start, end = pages.aligned_inside(data, pages.HUGE_PAGE)
    assert _anonymous_bytes(start, end) == end - start


def _cgroup_tree(root: Path, groups: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A /proc and a /sys/fs/cgroup of 20 GiB total and 16 GiB available, with the given cgroup lines and files."""
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       20971520 kB\nMemFree:  1 kB\nMemAvailable:   16777216 kB\n"
                                  "HugePages_Total:       0\n")
    (proc / "self" / "cgroup").write_text(groups)
    for name, text in files.items():
        (root / "cg" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "cg" / name).write_text(text)
    return proc, root / "cg"


def test_memory_headroom_is_the_tighter_of_the_system_and_a_container_limit(tmp_path):
    gib = 1 << 30
    free = _cgroup_tree(tmp_path / "a", "0::/user.slice\n", {"user.slice/memory.max": "max\n",
                                                             "user.slice/memory.current": "123\n"})
    assert system.memory_headroom(*free) == (16 * gib, 20 * gib)
    v2 = _cgroup_tree(tmp_path / "b", "0::/\n", {"memory.max": f"{4 * gib}\n", "memory.current": f"{3 * gib}\n"})
    assert system.memory_headroom(*v2) == (gib, 4 * gib)
    # cgroup v1, the limit on the parent of the process's group
    v1 = _cgroup_tree(tmp_path / "c", "5:cpu:/\n4:memory:/docker/abc\n0::/\n",
                      {"memory/docker/memory.limit_in_bytes": f"{2 * gib}\n",
                       "memory/docker/memory.usage_in_bytes": f"{gib // 2}\n",
                       "memory/docker/abc/memory.limit_in_bytes": "9223372036854771712\n",
                       "memory/docker/abc/memory.usage_in_bytes": "5\n"})
    assert system.memory_headroom(*v1) == (gib + gib // 2, 2 * gib)
    # a group's own limit, and its parent's larger one that its siblings have nearly filled
    nested = _cgroup_tree(tmp_path / "d", "0::/a/b\n",
                          {"a/memory.max": f"{8 * gib}\n", "a/memory.current": f"{7 * gib}\n",
                           "a/b/memory.max": f"{4 * gib}\n", "a/b/memory.current": "0\n"})
    assert system.memory_headroom(*nested) == (gib, 4 * gib)
    assert system.memory_headroom(tmp_path / "nowhere", tmp_path / "nowhere") is None


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads the process's mappings from Linux's /proc")
def test_a_cache_file_stays_mapped_where_memory_is_short(tmp_path, monkeypatch):
    """A copy cannot be dropped under memory pressure as the file's pages can: a container near its limit keeps them."""
    monkeypatch.setattr(pages, "memory_headroom", lambda: (1 << 30, 2 << 30))  # 1 of 2 GiB left: under the margin
    path = tmp_path / "m.panels"
    expected = np.random.default_rng(1).integers(0, 256, 8 << 20, dtype=np.uint8)
    expected.tofile(path)
    for thread in panel_cache.moving():
        thread.join()
    data = panel_cache._mapped(path)
    for thread in panel_cache.moving():
        thread.join()
    np.testing.assert_array_equal(data, expected)
    start, end = pages.aligned_inside(data, pages.HUGE_PAGE)
    assert end > start and _anonymous_bytes(start, end) == 0
