"""A loaded model written back out as a Hugging Face or MLX-format folder, for tests that load one by path."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from edgeserve.models.loader import LoadedModel
from edgeserve.quant.affine import QuantizedTensor


def write_model_folder(loaded_model: LoadedModel, out: Path, quantized: bool = False) -> None:
    """A Hugging Face (float32) or MLX-format (quantized) folder holding the model's weights."""
    out.mkdir()
    tensors, quant = {}, {"group_size": 32, "bits": 4}
    for name, w in loaded_model.weights.items():
        if isinstance(w, QuantizedTensor) and quantized:
            stem = name[: -len(".weight")]
            tensors[name], tensors[stem + ".scales"], tensors[stem + ".biases"] = w.weight, w.scales, w.biases
            if (w.bits, w.group_size) != (4, 32):
                quant[stem] = {"group_size": w.group_size, "bits": w.bits}
        else:
            tensors[name] = w.dequantize() if isinstance(w, QuantizedTensor) else np.asarray(w, np.float32)
    config = loaded_model.args.to_config()
    config["architectures"] = ["LlamaForCausalLM"]
    if quantized:
        config["quantization"] = quant
    (out / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(out / "model.safetensors"))
    loaded_model.tokenizer.save_pretrained(out)
