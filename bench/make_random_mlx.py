"""Write a Llama-shaped model with random weights as an MLX folder, through edgeserve's own converter.

The folder is what `edgeserve convert` writes, which mlx-lm loads too, so both engines can be timed on
the same files (bench/compare_mlx_lm.py) without downloading a model. A Hugging Face folder (config.json,
float16 weights ~ N(0, 0.02), the tokenizer with a ChatML chat template) is written to a temporary folder
and converted from there, 4-bit by default. Decode speed does not depend on the weight values; the text is
gibberish.

The tokenizer comes from --tokenizer: a tokenizer.json, a model folder holding one, or a GGUF file (its
embedded vocabulary). Its vocabulary must have ChatML's <|im_start|> and <|im_end|> (SmolLM2's does).

    python bench/make_random_mlx.py --shape 135m --tokenizer tokenizer.json --out smollm2-135m-random-4bit
    python bench/make_random_mlx.py --shape 1b --bits 8 --tokenizer smollm2.gguf --out llama-1b-random-8bit
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import click
import numpy as np
import tokenizers
from make_gguf import SHAPES, Shape
from safetensors.numpy import save_file
from tqdm import tqdm

from edgeserve.models.base import ModelArgs
from edgeserve.models.convert import BITS, check_output, convert
from edgeserve.models.loader import load_model
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.text.tokenizer import Tokenizer

# make_gguf's Llama shapes, and two small ones: a tiny model for tests and SmolLM2-135M's
MLX_SHAPES = {
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, tied=True),
    "135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, tied=True, rope_base=100000.0),
    **{name: shape for name, shape in SHAPES.items() if shape.arch == "llama"},
}
STD = 0.02
CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")


def write_tokenizer(source: Path, folder: Path) -> int:
    """tokenizer.json and a tokenizer_config.json with the ChatML template into folder; returns the vocabulary size."""
    if source.suffix == ".gguf":
        Tokenizer.from_gguf(read_gguf(source).metadata).save_pretrained(folder)
    else:
        shutil.copyfile(source / "tokenizer.json" if source.is_dir() else source, folder / "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    missing = [t for t in CHATML_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise click.ClickException(f"{source}: the vocabulary has no {' or '.join(missing)} for the ChatML template")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "add_bos_token": False, "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return tok.get_vocab_size(with_added_tokens=True)


def model_args(shape: Shape, vocab: int) -> ModelArgs:
    return ModelArgs(hidden_size=shape.hidden, num_hidden_layers=shape.layers, intermediate_size=shape.ffn,
                     num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=vocab,
                     rope_theta=shape.rope_base, max_position_embeddings=shape.context,
                     tie_word_embeddings=shape.tied, head_dim=shape.head_dim)


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama model under its Hugging Face name."""
    h, f = args.hidden_size, args.intermediate_size
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    shapes = {"model.embed_tokens.weight": (args.vocab_size, h)}
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q), p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })
    shapes["model.norm.weight"] = (h,)
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    return shapes


def write_hf_folder(folder: Path, shape: Shape, tokenizer: Path, seed: int = 0) -> None:
    """A Hugging Face LlamaForCausalLM folder of float16 random weights (norms 1) and the tokenizer."""
    vocab = write_tokenizer(tokenizer, folder)
    args = model_args(shape, vocab)
    im_end = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    config = {**args.to_config(), "architectures": ["LlamaForCausalLM"], "torch_dtype": "float16",
              "bos_token_id": None, "eos_token_id": im_end}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    rng = np.random.default_rng(seed)
    weights = {}
    for name, dims in tqdm(weight_shapes(args).items(), desc="random weights", unit="tensor"):
        if len(dims) == 1:
            weights[name] = np.ones(dims, np.float16)
        else:  # float32 draws: twice as fast as float64 ones, and float16 keeps no more
            weights[name] = (rng.standard_normal(dims, dtype=np.float32) * STD).astype(np.float16)
    save_file(weights, str(folder / "model.safetensors"))


@click.command()
@click.option("--shape", type=click.Choice(list(MLX_SHAPES)), default="tiny", show_default=True)
@click.option("--tokenizer", type=click.Path(exists=True, path_type=Path), required=True,
              help="A tokenizer.json, a model folder holding one, or a GGUF file.")
@click.option("--out", "-o", type=click.Path(path_type=Path), required=True, help="Output folder (MLX format).")
@click.option("--bits", type=click.Choice([str(b) for b in BITS]), default="4", show_default=True,
              help="Width of the layers' weights, as `edgeserve convert --bits`; 16 writes float16.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists.")
def main(shape: str, tokenizer: Path, out: Path, bits: str, seed: int, force: bool) -> None:
    """Write a random-weight Llama-shaped model as an MLX folder (an `edgeserve convert` output)."""
    check_output(out, force)  # before minutes of writing
    with tempfile.TemporaryDirectory(prefix="random-hf-") as tmp:
        write_hf_folder(Path(tmp), MLX_SHAPES[shape], tokenizer, seed)
        result = convert(load_model(tmp), out, bits=int(bits), force=force)
    click.echo(f"{out}: {shape}, {result.describe()}, {result.total_bytes / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
