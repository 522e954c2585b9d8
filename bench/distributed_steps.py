"""Per-step time and bytes sent per step of a model split across ranks (pipeline or tensor), against one rank.

    python bench/distributed_steps.py none                      # one process
    mlx.launch -n 2 --backend ring -- python bench/distributed_steps.py pipeline
    mlx.launch -n 3 --backend ring -- python bench/distributed_steps.py tensor

Rank 0 prints one JSON line: the prefill step's and the mean decode step's milliseconds for STREAMS greedy
streams, and the bytes a decode step puts on the links, summed over ranks: the step's message from rank 0
(measured: its size, which the ring's all_sum delivers to every rank), and the activations (from their shapes:
pipeline, the residual stream at each stage boundary and the tokens back to rank 0; tensor, every rank's share
of the two all_sums of each layer).
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from edgeserve.cli.options import join_group
from edgeserve.config import EngineConfig
from edgeserve.engine.llm_engine import LLMEngine
from edgeserve.models.catalog import DEFAULT_MODEL
from edgeserve.models.loader import load_model
from edgeserve.sampling_params import SamplingParams

STREAMS, PROMPT_TOKENS, DECODE_STEPS = 4, 32, 12


def main(mode: str, model: str = DEFAULT_MODEL) -> None:
    config = EngineConfig(backend="mlx", kv_memory="64MiB", distributed=None if mode == "none" else mode)
    join_group(model, config)
    loaded = load_model(model)
    engine = LLMEngine(loaded, config)
    group = getattr(engine.runner, "group", None)
    ranks = group.size if group is not None else 1
    params = SamplingParams(max_tokens=DECODE_STEPS + 1, temperature=0.0, ignore_eos=True)
    for i in range(STREAMS):
        engine.add_request([1 + (7 * i + j) % 1000 for j in range(PROMPT_TOKENS)], params)
    times, sent = [], []
    while engine.has_unfinished():
        before = group.bytes_sent if group is not None else 0
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        sent.append((group.bytes_sent if group is not None else 0) - before)
    engine.close()
    a = loaded.args
    width = 4  # float32 activations: MLX on the CPU (a GPU's float16 halves them)
    if mode == "pipeline":
        activations = (ranks - 1) * STREAMS * a.hidden_size * width + STREAMS * 4
        message = sent[2] - STREAMS * a.hidden_size * width  # rank 0's own send of the residual stream
    elif mode == "tensor":
        activations = 2 * a.num_hidden_layers * ranks * STREAMS * a.hidden_size * width
        message = sent[2]
    else:
        activations = message = 0
    decode = times[2:]  # the first decode step still compiles
    print(json.dumps({"mode": mode, "ranks": ranks, "streams": STREAMS, "prefill_ms": round(1000 * times[0], 1),
                      "decode_step_ms": round(1000 * statistics.mean(decode), 1),
                      "decode_step_ms_stdev": round(1000 * statistics.stdev(decode), 1),
                      "message_bytes_per_step": message,
                      "activation_bytes_per_step": activations}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
