"""Loading a model from a catalog name, a GGUF file, a Hugging Face folder, an MLX folder or a hub id.

Every format ends as the same thing: ModelArgs, a dict of weights under Hugging Face names
(float arrays or QuantizedTensor), and a Tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from edgeserve.errors import ModelLoadError, ModelNotFoundError
from edgeserve.models.base import ModelArgs, Weights
from edgeserve.models.catalog import CATALOG, pull, sha256_of
from edgeserve.system import home, write_text_whole
from edgeserve.models.registry import architecture, gguf_model_type
from edgeserve.quant.affine import QuantizedTensor
from edgeserve.quant.gguf_blocks import gguf_tensor_to_array, symmetric_blocks
from edgeserve.quant.gguf_file import GGUFFile, GGUFTensor, read_gguf
from edgeserve.quant.kquants import KQuantTensor
from edgeserve.sampling_params import SamplingDefaults
from edgeserve.text.tokenizer import Tokenizer

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Embedding pooling as GGUF's {arch}.pooling_type numbers it (llama.cpp's enum: 0 none, 1 mean, 2 cls, 3 last, 4
# rank; none and rank pool as mean here) and as sentence-transformers' Pooling module names it.
GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
ST_POOLING = {"pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}  # become args
_T = gguf.GGMLQuantizationType
# GGUF types that become affine groups (see quant/gguf_blocks.py), with their width there
_AFFINE_BITS = {_T.Q4_0: 4, _T.Q4_1: 4, _T.Q5_0: 8, _T.Q5_1: 8, _T.Q8_0: 8}
_KQUANTS = (_T.Q4_K, _T.Q5_K, _T.Q6_K)


@dataclass(frozen=True)
class WeightOrigin:
    """Where a weight comes from: a file's identity, a tensor in it, and the row order applied."""

    file: str  # path, size and modification time: a rewritten file is another file
    tensor: str
    rows: str = ""  # "" as stored; "rope-half" for q/k rows reordered to rotate-half

    @property
    def key(self) -> str:
        return f"{self.tensor}|{self.rows}"


def file_identity(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def content_hash(path: Path) -> str:
    """A SHA-256 digest of a file's bytes, remembered by its identity (path, size, modification time) in
    $EDGESERVE_HOME/file-hashes.json: a model of gigabytes takes seconds to hash, and every start of a server
    with a disk prefix cache needs the digest, so a start reads the file again only after it has changed."""
    identity = file_identity(path)
    memo_path = home() / "file-hashes.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if identity in memo:
        return memo[identity]
    digest = sha256_of(path)
    resolved = identity.split("|", 1)[0]
    # one identity a path: an older version of the file is never asked for again
    memo = {k: v for k, v in memo.items() if k.split("|", 1)[0] != resolved}
    memo[identity] = digest
    write_text_whole(memo_path, json.dumps(memo))  # unwritable: hashed again at the next start
    return memo[identity]


def model_files(source: Path) -> list[Path]:
    """A model's files: the GGUF file, or every file of its folder (weights, config, tokenizer), in order."""
    return [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())


def model_fingerprint(source: Path) -> str:
    """A digest of a model's files (`model_files`)."""
    h = hashlib.blake2b(digest_size=16)
    for p in model_files(source):
        h.update(f"{'' if p == source else p.relative_to(source)}\0{content_hash(p)}\0".encode())
    return h.hexdigest()


class _Deferred:
    """A GGUF matrix converted from the file's blocks when first needed, not at load time.

    Reading an attribute converts it once and keeps the result, as an eager tensor would;
    `materialize()` converts without keeping it, for a caller that repacks it and drops it (the
    NumPy backend, which with a panel cache hit never converts at all). `origin` names it.
    """

    origin: WeightOrigin
    _convert: Callable[[], Any]
    _held: Any
    _blocks: Callable[[], Any] | None = None  # the file's Q4_0/Q8_0 blocks, which the CPU kernels repack directly

    def materialize(self) -> Any:
        return self._held if self._held is not None else self._convert()

    def for_repacking(self) -> Any:
        """What a caller repacking the matrix (and dropping it) reads: the file's blocks where they are
        `SymmetricBlocks`, else `materialize()`."""
        return self._blocks() if self._blocks is not None else self.materialize()

    def _value(self) -> Any:
        if self._held is None:
            self._held = self._convert()
        return self._held

    def file_map(self) -> Any:
        """The file's memory map (whose pages a caller may drop once it has repacked everything)."""
        return self._map

    def reordered(self, order: np.ndarray, tag: str) -> Any:
        """The same matrix with its rows taken in `order`, still deferred."""
        w = type(self)(lambda: self.materialize().take_rows(order),
                       self._layout, WeightOrigin(self.origin.file, self.origin.tensor, tag), self._map)
        if self._blocks is not None:
            w._blocks = lambda: self._blocks().take_rows(order)
        return w


class DeferredQuantizedTensor(_Deferred, QuantizedTensor):
    """A GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 matrix as affine groups, converted on first use."""

    def __init__(self, convert: Callable[[], QuantizedTensor], layout: tuple[tuple[int, int], int, int],
                 origin: WeightOrigin, file_map: Any = None):
        self._convert, self._held, self.origin, self._map = convert, None, origin, file_map
        self._layout = layout
        self._shape, self.bits, self.group_size = layout

    shape = property(lambda self: self._shape)
    weight = property(lambda self: self._value().weight)
    scales = property(lambda self: self._value().scales)
    biases = property(lambda self: self._value().biases)


class DeferredKQuantTensor(_Deferred, KQuantTensor):
    """A GGUF K-quant matrix, its blocks read (or reordered) on first use."""

    def __init__(self, convert: Callable[[], KQuantTensor], layout: tuple[Any, int, int], origin: WeightOrigin,
                 file_map: Any = None):
        self._convert, self._held, self.origin, self._map = convert, None, origin, file_map
        self._layout = layout
        self.qtype, self._rows, self.cols = layout

    shape = property(lambda self: (self._rows, self.cols))
    blocks = property(lambda self: self._value().blocks)


def _deferred(t: GGUFTensor, identity: str) -> Any:
    """The tensor as a deferred weight where it is a 2-D quantized matrix, else converted now."""
    if len(t.shape) != 2 or (t.qtype not in _AFFINE_BITS and t.qtype not in _KQUANTS):
        return gguf_tensor_to_array(t)
    origin = WeightOrigin(identity, t.name)
    file_map = getattr(t.data, "_mmap", None)
    if t.qtype in _KQUANTS:
        return DeferredKQuantTensor(lambda: gguf_tensor_to_array(t), (t.qtype, *t.shape), origin, file_map)
    layout = ((t.shape[0], t.shape[1]), _AFFINE_BITS[t.qtype], 32)
    w = DeferredQuantizedTensor(lambda: gguf_tensor_to_array(t), layout, origin, file_map)
    if t.qtype in (_T.Q4_0, _T.Q8_0):
        w._blocks = lambda: symmetric_blocks(t)
    return w


@dataclass
class LoadedModel:
    args: ModelArgs
    weights: Weights
    tokenizer: Tokenizer
    source: Path
    format: str  # "gguf", "safetensors" or "mlx"
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)  # what the model asks to sample with
    pooling: str = "mean"  # how its embeddings pool the tokens' states: "mean", "cls" (the first) or "last"

    @property
    def num_parameters(self) -> int:
        return sum(int(np.prod(w.shape)) for w in self.weights.values())

    def quantization(self) -> str:
        """A short summary such as 'Q4_1 (4-bit, group 32) + Q8_0 embeddings' or 'float16'."""
        kinds: dict[str, int] = {}
        for w in self.weights.values():
            if isinstance(w, KQuantTensor):
                key = w.qtype.name
            elif isinstance(w, QuantizedTensor):
                key = f"{w.bits}-bit g{w.group_size}"
            else:
                key = str(w.dtype)
            kinds[key] = kinds.get(key, 0) + int(np.prod(w.shape))
        total = sum(kinds.values())
        return ", ".join(f"{k} {100 * n / total:.0f}%" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))


def resolve_model(name: str) -> Path:
    """A catalog name (pulled if missing), a local file/folder, or a hub id (downloaded)."""
    if name in CATALOG:
        return pull(name)
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "tokenizer.model"]))
        except Exception as exc:
            raise ModelNotFoundError(f"could not fetch {name!r} from the Hugging Face hub: {exc}") from exc
    raise ModelNotFoundError(
        f"model {name!r} not found: not a catalog name ({', '.join(sorted(CATALOG))}), local path or hub id"
    )


def load_model(name: str) -> LoadedModel:
    path = resolve_model(name)
    if path.is_dir():
        return load_folder(path)
    return load_gguf(path)


def _rope_rows_to_half(n_rows: int, n_heads: int) -> np.ndarray:
    """Row order that turns GGUF's interleaved-RoPE q/k rows back into rotate-half (Hugging Face) rows."""
    head_dim = n_rows // n_heads
    return np.arange(n_rows).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _permute_rows(w: Any, order: np.ndarray) -> Any:
    if isinstance(w, _Deferred):
        return w.reordered(order, "rope-half")
    return w.take_rows(order) if isinstance(w, (QuantizedTensor, KQuantTensor)) else w[order]


def gguf_args(g: GGUFFile) -> ModelArgs:
    md = g.metadata
    arch = g.architecture
    model_type = gguf_model_type(arch, g.path)

    def get(key: str, default: Any = None) -> Any:
        value = md.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{g.path}: missing metadata {arch}.{key}")
        return value

    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = md.get(f"{arch}.vocab_size") or len(md.get("tokenizer.ggml.tokens", [])) or g.tensors["token_embd.weight"].shape[0]
    rope_scaling = None
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1+: per-frequency divisors stored as a tensor
        rope_scaling = {"rope_type": "factors", "factors": gguf_tensor_to_array(g.tensors["rope_freqs.weight"]).tolist()}
    elif "rope_factors_long.weight" in g.tensors:  # Phi-3 LongRoPE: both factor sets stored as tensors
        rope_scaling = {"rope_type": "longrope",
                        "long_factor": gguf_tensor_to_array(g.tensors["rope_factors_long.weight"]).tolist(),
                        "short_factor": gguf_tensor_to_array(g.tensors["rope_factors_short.weight"]).tolist(),
                        "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
                        "attention_factor": md.get(f"{arch}.rope.scaling.attn_factor")}
    elif md.get(f"{arch}.rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(md[f"{arch}.rope.scaling.factor"])}
    args_class = architecture(model_type, g.path).args
    window = {}
    if "sliding_window" in args_class.__dataclass_fields__ and md.get(f"{arch}.attention.sliding_window"):
        window["sliding_window"] = int(md[f"{arch}.attention.sliding_window"])
    try:
        return args_class(
            hidden_size=hidden,
            num_hidden_layers=int(get("block_count")),
            intermediate_size=int(get("feed_forward_length")),
            num_attention_heads=n_heads,
            num_key_value_heads=int(get("attention.head_count_kv", n_heads)),
            vocab_size=int(vocab),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in g.tensors,
            attention_bias="blk.0.attn_q.bias" in g.tensors,
            head_dim=int(md.get(f"{arch}.attention.key_length", hidden // n_heads if n_heads > 0 else 0)),
            model_type=model_type,
            **window,
        )
    except ModelLoadError as exc:  # a size no model has: say which file
        raise ModelLoadError(str(exc) if str(exc).startswith(str(g.path)) else f"{g.path}: {exc}") from None


def gguf_weights(g: GGUFFile, args: ModelArgs) -> Weights:
    family = architecture(args.model_type, g.path)
    permuted = family.gguf_rope_permuted
    layer_names = {**_GGUF_LAYER_NAMES, **family.gguf_layer_names}
    identity = file_identity(g.path)
    weights: Weights = {}
    for name, t in g.tensors.items():
        if name in _GGUF_ROPE_TENSORS:
            continue
        if name in _GGUF_GLOBAL_NAMES:
            hf = _GGUF_GLOBAL_NAMES[name]
        else:
            parts = name.split(".")  # blk.N.kind.weight|bias
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_names:
                raise ModelLoadError(f"{g.path}: unexpected tensor {name!r}")
            hf = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
        w = _deferred(t, identity)
        if permuted and (".q_proj." in hf or ".k_proj." in hf):
            heads = args.num_attention_heads if ".q_proj." in hf else args.num_key_value_heads
            w = _permute_rows(w, _rope_rows_to_half(w.shape[0], heads))
        if family.gguf_norm_shift and hf.endswith("norm.weight"):
            w = w - np.float32(family.gguf_norm_shift)
        weights[hf] = w
    return weights


def load_gguf(path: Path) -> LoadedModel:
    g = read_gguf(path)
    args = gguf_args(g)
    weights = gguf_weights(g, args)
    _check_complete(weights, args, path)
    tokenizer = Tokenizer.from_gguf(g.metadata)
    if tokenizer.chat_template is None:
        tokenizer.chat_template = architecture(args.model_type, path).chat_template
    return LoadedModel(args, weights, tokenizer, path, "gguf", SamplingDefaults.from_gguf(g.metadata),
                       GGUF_POOLING.get(g.metadata.get(f"{g.architecture}.pooling_type"), "mean"))


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """All tensors of one file as NumPy arrays (memory-mapped).

    safetensors' NumPy loader has no bfloat16, so the header is read here and bfloat16 is widened.
    """
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        (header_len,) = struct.unpack("<Q", bytes(raw[:8]))
        header = json.loads(bytes(raw[8 : 8 + header_len]))
    except (struct.error, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a safetensors file ({exc})") from exc
    dtypes = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "I32": np.int32,
              "U8": np.uint8, "I8": np.int8, "F64": np.float64, "I64": np.int64}
    out = {}
    base = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in dtypes:
            raise ModelLoadError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > len(raw):
            raise ModelLoadError(f"{path}: truncated (tensor {name} runs past the end of the file)")
        arr = raw[base + start : base + end].view(dtypes[info["dtype"]]).reshape(info["shape"])
        if info["dtype"] == "BF16":
            arr = (arr.astype(np.uint32) << 16).view(np.float32)
        out[name] = arr
    return out


def folder_pooling(path: Path) -> str:
    """The pooling a sentence-transformers folder names (1_Pooling/config.json), else mean."""
    config = path / "1_Pooling" / "config.json"
    if not config.is_file():
        return "mean"
    modes = json.loads(config.read_text())
    return next((pooling for key, pooling in ST_POOLING.items() if modes.get(key)), "mean")


def load_folder(path: Path) -> LoadedModel:
    """A Hugging Face safetensors folder or an MLX-format (possibly quantized) folder."""
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path}: no config.json (expected a Hugging Face or MLX model folder)")
    config = json.loads(config_path.read_text())
    family = architecture(config.get("model_type", "llama"), path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weights")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(_read_safetensors(f))
    args = family.args.from_config(config)
    quant = config.get("quantization") or config.get("quantization_config")
    weights: Weights = {}
    for name, arr in tensors.items():
        if name.endswith((".scales", ".biases")) or "rotary_emb" in name:
            continue
        stem = name[: -len(".weight")]
        if name.endswith(".weight") and stem + ".scales" in tensors:
            spec = quant.get(stem, quant) if isinstance(quant, dict) else {}
            if not spec or "bits" not in spec:
                raise ModelLoadError(f"{path}: {name} is quantized but config.json has no quantization entry")
            weights[name] = QuantizedTensor(arr, tensors[stem + ".scales"], tensors[stem + ".biases"],
                                            int(spec["bits"]), int(spec["group_size"]))
        else:
            weights[name] = arr
    if args.tie_word_embeddings or "lm_head.weight" not in weights:
        args.tie_word_embeddings = True
        weights.pop("lm_head.weight", None)
    _check_complete(weights, args, path)
    return LoadedModel(args, weights, Tokenizer.from_dir(path), path, "mlx" if quant else "safetensors",
                       _folder_sampling_defaults(path), folder_pooling(path))


def _folder_sampling_defaults(path: Path) -> SamplingDefaults:
    """The sampling settings of the folder's generation_config.json, if it has a readable one."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return SamplingDefaults()
    return SamplingDefaults.from_generation_config(config) if isinstance(config, dict) else SamplingDefaults()


def _check_complete(weights: Weights, args: ModelArgs, path: Path) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    layer_weights = architecture(args.model_type, path).model.layer_weights
    for i in range(args.num_hidden_layers):
        needed += [f"model.layers.{i}.{n}.weight" for n in layer_weights]
    missing = [n for n in needed if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: missing weights {', '.join(missing[:3])}" + (" ..." if len(missing) > 3 else ""))
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    h, ffn = args.hidden_size, args.intermediate_size
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h)}
    for i in range(args.num_hidden_layers):
        layer = f"model.layers.{i}."
        shapes.update({layer + "self_attn.q_proj.weight": (q, h), layer + "self_attn.k_proj.weight": (kv, h),
                       layer + "self_attn.v_proj.weight": (kv, h), layer + "self_attn.o_proj.weight": (h, q),
                       layer + "mlp.gate_proj.weight": (ffn, h), layer + "mlp.up_proj.weight": (ffn, h),
                       layer + "mlp.down_proj.weight": (h, ffn)})
    for name, (rows, cols) in shapes.items():
        w = weights.get(name)
        if w is None:  # a family that fuses them (Phi-3's qkv_proj) or has none
            continue
        # the embedding may hold padding rows past the vocabulary, never fewer
        fits = w.shape[1] == cols and (w.shape[0] >= rows if name == "model.embed_tokens.weight" else w.shape[0] == rows)
        if len(w.shape) != 2 or not fits:
            raise ModelLoadError(f"{path}: {name} is {tuple(w.shape)}, where the model's sizes make it "
                                 f"({rows}, {cols}): the file is damaged")
    for name, w in weights.items():
        if not name.endswith("norm.weight"):
            continue
        if len(w.shape) != 1 or w.shape[0] not in (h, args.head_dim):
            raise ModelLoadError(f"{path}: {name} is {tuple(w.shape)}, where the model's sizes make it ({h},): the "
                                 "file is damaged")
        if not np.isfinite(np.asarray(w)).all():
            raise ModelLoadError(f"{path}: {name} holds NaN or infinite values: the file is damaged")
