"""How a model splits over the ranks of a group, and what each rank then holds.

Pipeline: the decoder blocks in contiguous stages, one per rank (the first also holds the embedding, the last
the final norm and head). Tensor: every rank holds every block, but only its share of each layer's KV heads
(with their query heads) and of the MLP's columns; the embedding, norms and head are on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgeserve.backends.base import PartialSum
from edgeserve.config import DISTRIBUTED_MODES
from edgeserve.errors import EdgeserveError
from edgeserve.models.base import ModelArgs, Weights
from edgeserve.quant.affine import QuantizedTensor

# MLP columns go to ranks in multiples of this, so that no quantization group (32, 64 or 128 values) is cut
MLP_UNIT = 128


def split_range(n: int, weights: Sequence[float]) -> list[range]:
    """0..n in contiguous ranges, one per weight, sized in proportion to it, none empty (equal weights: sizes
    differ by at most one)."""
    k = len(weights)
    if n < k:
        raise EdgeserveError(f"{n} cannot be shared out over {k} ranks")
    total = float(sum(weights))
    bounds = [0]
    for i in range(1, k):
        ideal = round(n * sum(weights[:i]) / total)
        bounds.append(min(max(ideal, bounds[-1] + 1), n - (k - i)))  # each range keeps at least one
    bounds.append(n)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Share:
    """What one rank computes: its decoder blocks, and of each, its KV heads and MLP columns."""

    layers: range
    kv_heads: range
    mlp: range


def plan(args: ModelArgs, mode: str, ranks: int, memory: Sequence[float] | None = None) -> list[Share]:
    """Each rank's share; memory: each rank's free memory, to weigh pipeline stages by (None: even stages)."""
    every_layer, all_heads = range(args.num_hidden_layers), range(args.num_key_value_heads)
    if mode == "pipeline":
        stages = split_range(args.num_hidden_layers, memory or [1.0] * ranks)
        return [Share(stage, all_heads, range(args.intermediate_size)) for stage in stages]
    if mode != "tensor":
        raise EdgeserveError(f"unknown distributed mode {mode!r} (choose from {', '.join(DISTRIBUTED_MODES)})")
    if args.num_key_value_heads < ranks:
        raise EdgeserveError(f"tensor mode splits the {args.num_key_value_heads} KV heads over the ranks, so it takes "
                             f"at most {args.num_key_value_heads} ranks; use --distributed pipeline")
    heads = split_range(args.num_key_value_heads, [1.0] * ranks)
    # a model too small for whole units of columns per rank is a test's float one: any column will do
    unit = MLP_UNIT if args.intermediate_size >= MLP_UNIT * ranks else 1
    units = split_range(-(-args.intermediate_size // unit), [1.0] * ranks)
    return [Share(every_layer, h, range(u.start * unit, min(u.stop * unit, args.intermediate_size)))
            for h, u in zip(heads, units)]


def rank_args(args: ModelArgs, share: Share) -> ModelArgs:
    """The arguments of the model one rank runs in tensor mode: its heads and MLP columns."""
    group = args.num_attention_heads // args.num_key_value_heads
    return dataclasses.replace(args, num_key_value_heads=len(share.kv_heads),
                               num_attention_heads=len(share.kv_heads) * group, intermediate_size=len(share.mlp),
                               head_dim=args.head_dim)


def kv_args(args: ModelArgs, mode: str, share: Share) -> ModelArgs:
    """Arguments whose KV bytes per token are what one rank's pool holds of a token."""
    if mode == "pipeline":
        return dataclasses.replace(args, num_hidden_layers=len(share.layers))
    return rank_args(args, share)


def shard_weights(args: ModelArgs, weights: Weights, share: Share) -> Weights:
    """One rank's tensor-mode weights: rows of q/k/v (its heads) and gate/up (its MLP columns), columns of o and
    down (marked PartialSum: the ranks' products add up to the layer's); the rest as it is."""
    from edgeserve.backends.mlx_backend import mlx_form  # K-quants as MLX holds them, so columns can be cut

    group, hd = args.num_attention_heads // args.num_key_value_heads, args.head_dim
    q = range(share.kv_heads.start * group * hd, share.kv_heads.stop * group * hd)
    kv = range(share.kv_heads.start * hd, share.kv_heads.stop * hd)
    rows = {"self_attn.q_proj": q, "self_attn.k_proj": kv, "self_attn.v_proj": kv, "mlp.gate_proj": share.mlp,
            "mlp.up_proj": share.mlp}
    columns = {"self_attn.o_proj": q, "mlp.down_proj": share.mlp}
    out = dict(weights)
    for i in range(args.num_hidden_layers):
        prefix = f"model.layers.{i}."
        missing = [name for name in (*rows, *columns) if f"{prefix}{name}.weight" not in weights]
        if missing:
            raise EdgeserveError(f"tensor mode splits q/k/v/o and gate/up/down projections, which this model does "
                                 f"not hold as such ({prefix}{missing[0]}); use --distributed pipeline")
        for name, part in rows.items():
            for suffix in (".weight", ".bias"):
                if prefix + name + suffix in weights:
                    out[prefix + name + suffix] = _rows(weights[prefix + name + suffix], part)
        for name, part in columns.items():
            key = f"{prefix}{name}.weight"
            out[key] = PartialSum(_columns(mlx_form(weights[key]), part, key))
    return out


def _rows(w: Any, part: range) -> Any:
    if isinstance(w, QuantizedTensor):
        return QuantizedTensor(w.weight[part.start : part.stop], w.scales[part.start : part.stop],
                               w.biases[part.start : part.stop], w.bits, w.group_size)
    if hasattr(w, "blocks"):  # a GGUF K-quant: whole rows of blocks
        return dataclasses.replace(w, blocks=w.blocks[part.start : part.stop])
    return np.asarray(w)[part.start : part.stop]


def _columns(w: Any, part: range, name: str) -> Any:
    if not isinstance(w, QuantizedTensor):
        return np.asarray(w)[:, part.start : part.stop]
    if part.start % w.group_size or (part.stop - part.start) % w.group_size:
        raise EdgeserveError(f"tensor mode would cut a quantization group of {name} (groups of {w.group_size}); "
                             "use --distributed pipeline")
    g = w.group_size  # at least 32: a cut between groups is one between packed words too
    return QuantizedTensor(w.weight[:, part.start * w.bits // 32 : part.stop * w.bits // 32],
                           w.scales[:, part.start // g : part.stop // g], w.biases[:, part.start // g : part.stop // g],
                           w.bits, g)


def host_bytes(w: Any) -> int:
    """A weight's bytes as its file stores it."""
    if isinstance(w, QuantizedTensor):
        return w.weight.nbytes + w.scales.nbytes + w.biases.nbytes
    return int(w.nbytes)


def share_bytes(args: ModelArgs, weights: Weights, share: Share) -> int:
    """The weights one rank holds, as the file stores them (tensor mode: its fraction of each split weight)."""
    total = 0
    first, last = share.layers.start == 0, share.layers.stop == args.num_hidden_layers
    tied = "lm_head.weight" not in weights or args.tie_word_embeddings
    heads = len(share.kv_heads) / args.num_key_value_heads
    mlp = len(share.mlp) / args.intermediate_size
    for name, w in weights.items():
        if name.startswith("model.layers."):
            layer, _, kind = name[len("model.layers."):].partition(".")
            if int(layer) not in share.layers:
                continue
            fraction = heads if kind.startswith("self_attn.") and "norm" not in kind else (
                mlp if kind.startswith("mlp.") else 1.0)
            total += int(host_bytes(w) * fraction)
        elif name == "model.embed_tokens.weight":
            total += host_bytes(w) if first or (last and tied) else 0
        elif last:  # the final norm and an untied head
            total += host_bytes(w)
    return total


def describe_share(args: ModelArgs, share: Share) -> str:
    """What a rank holds, e.g. 'layers 0-14 and the embedding' or 'layers 0-29: KV heads 0-1, MLP columns 0-767'."""
    def span(r: range) -> str:
        return f"{r.start}-{r.stop - 1}" if len(r) > 1 else str(r.start)

    text = f"layers {span(share.layers)}"
    if len(share.kv_heads) < args.num_key_value_heads:
        return f"{text}: KV heads {span(share.kv_heads)}, MLP columns {span(share.mlp)}"
    extras = [name for name, held in (("the embedding", share.layers.start == 0),
                                      ("the norm and head", share.layers.stop == args.num_hidden_layers)) if held]
    return f"{text} and {' and '.join(extras)}" if extras else text
