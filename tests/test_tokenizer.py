"""Tokenizer (GGUF and Hugging Face folders; byte-level BPE and SentencePiece) and detokenizer."""

import json
from pathlib import Path

import numpy as np
import pytest
from sentencepiece import sentencepiece_model_pb2

from edgeserve.text.detokenizer import IncrementalDetokenizer
from edgeserve.errors import ModelLoadError
from edgeserve.quant.gguf_file import read_gguf
from edgeserve.text.tokenizer import Tokenizer

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_tokenizer.json"
LLAMA_CPP_CASES = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
MULTIBYTE_TEXTS = [
    "ÀÉÎÕÜ àéîõü ñ ß ç",
    "你好，世界",
    "こんにちは世界",
    "🙂🚀🔥 emoji 👩\u200d👩\u200d👧",
    "e=mc^2; ∑∫∂√∞",
    "Здравствуй, мир! 東京で寿司を食べた 🍣🍣 — «ça va?» 한국어 텍스트",
]


@pytest.fixture(scope="module")
def gguf_metadata(model_path):
    return read_gguf(model_path).metadata


@pytest.fixture(scope="module")
def smollm2(gguf_metadata) -> Tokenizer:
    return Tokenizer.from_gguf(gguf_metadata)


# --- the real model's GGUF vocabulary (byte-level BPE, pre-tokenizer "smollm") ---------------


@pytest.mark.parametrize("case", LLAMA_CPP_CASES, ids=lambda c: repr(c["text"])[:40])
def test_gguf_encode_decode_match_llama_cpp(smollm2, case):
    # The fixture was made with add_bos=False and special tokens parsed.
    assert smollm2.encode(case["text"], add_bos=False) == case["ids"]
    assert smollm2.decode(case["ids"]) == case["detokenized"]


def test_gguf_special_tokens_and_flags(smollm2, gguf_metadata):
    eos_id = gguf_metadata["tokenizer.ggml.eos_token_id"]
    assert smollm2.vocab_size == len(gguf_metadata["tokenizer.ggml.tokens"])
    assert smollm2.eos_token_id == eos_id and smollm2.eos_token == "<|im_end|>"
    assert eos_id in smollm2.eos_token_ids
    assert smollm2.bos_token_id == gguf_metadata["tokenizer.ggml.bos_token_id"]
    assert smollm2.add_bos is bool(gguf_metadata["tokenizer.ggml.add_bos_token"])
    assert smollm2.chat_template == gguf_metadata["tokenizer.chat_template"]
    assert smollm2.is_special(eos_id) and not smollm2.is_special(smollm2.encode("Hello")[0])
    assert smollm2.encode("Hello", add_bos=True) == [smollm2.bos_token_id, *smollm2.encode("Hello")]
    chat = "<|im_start|>user\nHi<|im_end|>"
    assert smollm2.decode(smollm2.encode(chat), skip_special_tokens=True) == "user\nHi"


def test_gguf_unsupported_vocabularies_are_refused(gguf_metadata):
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'no-such-pre'"):
        Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ModelLoadError, match="tokenizer model 'rwkv'"):
        Tokenizer.from_gguf({**gguf_metadata, "tokenizer.ggml.model": "rwkv"})


# --- incremental detokenizer -------------------------------------------------------------------


@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_detokenizer_streams_whole_characters(smollm2, text, skip_special_tokens):
    text = f"<|im_start|>assistant\n{text}<|im_end|>"
    ids = smollm2.encode(text)
    detok = IncrementalDetokenizer(smollm2, skip_special_tokens=skip_special_tokens)
    chunks = [detok.add(i) for i in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == smollm2.decode(ids, skip_special_tokens=skip_special_tokens)
    assert not any("\ufffd" in chunk for chunk in chunks)


def test_detokenizer_holds_back_partial_characters(smollm2):
    ids = smollm2.encode("🙂")
    assert len(ids) > 1  # the emoji is split over byte tokens, so streaming must wait
    detok = IncrementalDetokenizer(smollm2)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🙂"]
    assert detok.flush() == ""


def test_detokenizer_flush_releases_an_incomplete_tail(smollm2):
    first_byte_token = smollm2.encode("🙂")[0]
    detok = IncrementalDetokenizer(smollm2)
    assert detok.add(first_byte_token) == ""
    assert detok.flush() == smollm2.decode([first_byte_token])


@pytest.mark.parametrize("streaming", [True, False], ids=["stream", "window"])
def test_detokenizer_decodes_a_bounded_window(smollm2, monkeypatch, streaming):
    ids = smollm2.encode("The quick brown fox jumps over the lazy dog. 東京 🙂 " * 40)
    expected = smollm2.decode(ids, skip_special_tokens=True)
    window_sizes = []
    decode = smollm2.decode

    def recording_decode(token_ids, skip_special_tokens=False):
        window_sizes.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(smollm2, "decode", recording_decode)
    if not streaming:  # as for a sentencepiece vocabulary
        monkeypatch.setattr(smollm2, "decode_stream", lambda skip_special_tokens=False: None)
    detok = IncrementalDetokenizer(smollm2)
    text = "".join(detok.add(i) for i in ids) + detok.flush()
    assert text == expected
    assert len(ids) > 500 and max(window_sizes, default=0) <= 10
    # the tokenizer's stream (its table of token bytes here) decodes every id itself: no window decodes; the window
    # path decodes two per id
    assert len(window_sizes) == 0 if streaming else len(window_sizes) >= 2 * len(ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_byte_level_stream_spells_tokens_as_the_library_decodes_them(smollm2, skip_special_tokens):
    """A byte-level vocabulary streams from a table of each token's bytes: every token's bytes decode as the
    library decodes it alone, and random ids (special tokens, halves of characters and bytes that are no UTF-8
    among them) stream to the library's decode of them all."""
    skip = skip_special_tokens
    pieces = smollm2._codec._byte_pieces(skip)
    assert len(pieces) == smollm2.vocab_size
    assert [p.decode("utf-8", "replace") for p in pieces] == [smollm2.decode([i], skip) for i in range(len(pieces))]
    ids = np.random.default_rng(0).integers(0, smollm2.vocab_size, 4000).tolist()
    split = smollm2.encode("🙂")[:-1]  # a character split over tokens, its last missing
    ids[100 : 100 + len(split)] = split
    detok = IncrementalDetokenizer(smollm2, skip_special_tokens=skip)
    chunks = [detok.add(i) for i in ids]
    assert "".join(chunks) + detok.flush() == smollm2.decode(ids, skip_special_tokens=skip)
    assert split and chunks[100 : 100 + len(split)] == [""] * len(split)  # held while the character may complete


def test_detokenizer_flush_after_a_skipped_special_token(smollm2):
    ids = smollm2.encode("Hi<|im_end|>")
    detok = IncrementalDetokenizer(smollm2, skip_special_tokens=True)
    assert "".join(detok.add(i) for i in ids) == "Hi"
    assert detok.flush() == ""


# --- save_pretrained / from_dir ----------------------------------------------------------------


def test_save_pretrained_round_trip(smollm2, tmp_path):
    from transformers import AutoTokenizer

    smollm2.save_pretrained(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for case in LLAMA_CPP_CASES:
        assert reloaded.encode(case["text"]) == case["ids"]
        assert hf.encode(case["text"]) == case["ids"]
        assert hf.decode(case["ids"]) == case["detokenized"]
    assert (reloaded.bos_token_id, reloaded.eos_token_id, reloaded.add_bos) == (
        smollm2.bos_token_id,
        smollm2.eos_token_id,
        smollm2.add_bos,
    )
    assert reloaded.eos_token_ids == smollm2.eos_token_ids
    assert reloaded.chat_template == smollm2.chat_template == hf.chat_template


def test_from_dir_reads_generation_config_eos_ids(smollm2, tmp_path):
    smollm2.save_pretrained(tmp_path)
    extra_eos = smollm2.encode("<|endoftext|>")[0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [extra_eos, 7]}))
    assert {extra_eos, 7, smollm2.eos_token_id} <= Tokenizer.from_dir(tmp_path).eos_token_ids


def test_from_dir_bos_follows_the_post_processor(smollm2, tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "add_bos", True)
    smollm2.save_pretrained(tmp_path)
    monkeypatch.undo()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["add_bos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    reloaded = Tokenizer.from_dir(tmp_path)
    assert reloaded.add_bos
    assert reloaded.encode("Hello") == [smollm2.bos_token_id, *smollm2.encode("Hello")]


def test_from_dir_without_tokenizer_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no tokenizer.json or tokenizer.model in"):
        Tokenizer.from_dir(tmp_path)


# --- SentencePiece vocabularies ----------------------------------------------------------------

SPM_TEXTS = [
    "the lazy dog jumps over the quick brown fox",
    "hello world, café über alles",
    "  leading and  double spaces ",
    "東京 日本語 unseen: Zürich 😀 ☃",
    "line one\nline two\ttab",
    "",
]


def _as_gguf_metadata(model_file: Path) -> dict:
    proto = sentencepiece_model_pb2.ModelProto.FromString(model_file.read_bytes())
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [p.piece for p in proto.pieces],
        "tokenizer.ggml.scores": [p.score for p in proto.pieces],
        "tokenizer.ggml.token_type": [int(p.type) for p in proto.pieces],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }


def test_sentencepiece_folder_round_trip(spm_model):
    folder, sp = spm_model
    tok = Tokenizer.from_dir(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (sp.bos_id(), sp.eos_id())
    assert tok.add_bos  # Llama's default when the folder does not say
    for text in SPM_TEXTS:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)]
        assert tok.decode(tok.encode(text), skip_special_tokens=True) == text


def test_sentencepiece_special_tokens_in_text(spm_model):
    folder, sp = spm_model
    tok = Tokenizer.from_dir(folder)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|></s>", add_bos=False)
    user_defined, control = sp.piece_to_id("<|im_start|>"), sp.piece_to_id("<|im_end|>")
    assert ids[0] == user_defined and ids[-2:] == [control, sp.eos_id()]
    # Plain text between special tokens is encoded like a text of its own (dummy prefix).
    assert ids[1:-2] == sp.encode("user\nhi")
    assert (
        control in tok.eos_token_ids
        and tok.is_special(control)
        and not tok.is_special(user_defined)
    )
    assert tok.decode(ids, skip_special_tokens=True) == "<|im_start|> user\nhi"


def test_sentencepiece_from_gguf_matches_sentencepiece(spm_model, tmp_path):
    folder, sp = spm_model
    tok = Tokenizer.from_gguf(_as_gguf_metadata(folder / "tokenizer.model"))
    assert tok.add_bos and tok.vocab_size == sp.get_piece_size()
    for text in SPM_TEXTS:
        assert tok.encode(text, add_bos=False) == sp.encode(text)
        assert tok.decode(sp.encode(text)) == sp.decode(sp.encode(text))

    tok.save_pretrained(tmp_path)
    reloaded = Tokenizer.from_dir(tmp_path)
    for text in SPM_TEXTS:
        assert reloaded.encode(text) == tok.encode(text)
    assert (reloaded.bos_token, reloaded.eos_token, reloaded.add_bos) == ("<s>", "</s>", True)


def test_sentencepiece_folder_loads_in_transformers(spm_model, tmp_path):
    from transformers import AutoTokenizer

    folder, _ = spm_model
    Tokenizer.from_gguf(_as_gguf_metadata(folder / "tokenizer.model")).save_pretrained(tmp_path)
    ours, hf = Tokenizer.from_dir(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    # transformers' converted tokenizer differs from SentencePiece on runs of leading spaces,
    # so compare on ordinary text.
    for text in ["the lazy dog jumps over the quick brown fox", "hello world, café über 東京 😀"]:
        assert hf.encode(text) == ours.encode(text)
        assert hf.decode(ours.encode(text), skip_special_tokens=True) == text
