"""Text <-> token ids for a model: GGUF-embedded vocabularies and Hugging Face tokenizer folders.

Two engines do the actual work: the `tokenizers` library (byte-level BPE from GGUF, and any
tokenizer.json) and the `sentencepiece` library (SentencePiece vocabularies, from GGUF or a
tokenizer.model file). `Tokenizer` puts one face on both, with llama.cpp's conventions:
special tokens written in the text are parsed as special tokens, and BOS is added the way the
model declares.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import sentencepiece as spm
import tokenizers
from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from edgeserve.errors import ModelLoadError

WORD_JOINER = "\u2060"  # invisible, and no tokenizer merges it into a special token's text
# Texts of tokens that end a turn. llama.cpp stops on these as well as on the declared EOS,
# because many GGUF files declare only one of a model's several end tokens.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
    }
)

# Pre-tokenizer regexes of llama.cpp (llama-vocab.cpp), applied one after another: each splits
# the pieces the previous one produced, keeping both matches and the text between them.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [_GPT2_REGEX],
    "llama3": [_LLAMA3_REGEX],
    "qwen2": [_QWEN2_REGEX],
    "starcoder": [r"\p{N}", _GPT2_REGEX],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_REGEX, "[0-9][0-9][0-9]"],
}
# tokenizer.ggml.pre names (as llama.cpp spells them) -> regex family.
_PRE_TOKENIZER_FAMILY: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(["gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "exaone4"], "gpt2"),
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "dbrx",
            "smaug-bpe",
            "chatglm-bpe",
            "glm4",
        ],
        "llama3",
    ),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "megrez", "stablelm2"], "qwen2"),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"],
        "starcoder",
    ),
    "falcon": "falcon",
}
# llama.cpp matches whole words against the vocabulary before merging, and adds BOS by
# default, for the Llama 3 family.
_IGNORE_MERGES_FAMILIES = {"llama3"}
_ADD_BOS_BY_DEFAULT_FAMILIES = {"llama3"}


class _Codec(Protocol):
    """What `Tokenizer` needs from the library doing the work; special tokens in text are always parsed."""

    vocab_size: int
    special_ids: set[int]
    # BOS/EOS the vocabulary itself names, for folders whose tokenizer_config does not.
    default_bos_token_id: int | None
    default_eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...

    def decode_stream(self, skip_special_tokens: bool) -> Callable[[int], str | None] | None:
        """A function taking one id at a time and returning the text it completes (None while a character is
        split), as a full decode spells it; None where the library has none."""
        ...

    def token_to_id(self, token: str) -> int | None: ...

    def id_to_token(self, token_id: int) -> str | None: ...

    def adds_bos_by_default(self, bos_token_id: int | None) -> bool:
        """Whether a folder that does not say (no add_bos_token) gets BOS on raw prompts."""
        ...

    def save(self, out_dir: Path, bos_token: str | None, add_bos: bool) -> dict[str, Any]:
        """Write the vocabulary file(s); return the tokenizer_config.json entries they need."""
        ...


def _byte_level_bytes() -> dict[int, int]:
    """str.translate's table from GPT-2's byte-level alphabet (the character that spells each byte in a byte-level
    BPE vocabulary) to the bytes, as characters below 256; a character under 256 outside the alphabet goes to one
    above, so that encoding the result as latin-1 fails for a token the alphabet does not spell."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{c: 0x100 for c in others}, **{b: b for b in printable},
            **{256 + i: b for i, b in enumerate(others)}}


_BYTE_LEVEL_BYTES = _byte_level_bytes()


class _TokenizersCodec:
    """A Hugging Face `tokenizers` pipeline."""

    def __init__(self, tok: tokenizers.Tokenizer) -> None:
        self._tok = tok
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.special_ids = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}
        self.default_bos_token_id = self.default_eos_token_id = None
        self._pieces: dict[bool, list[bytes]] = {}  # by skip_special_tokens: each token's bytes

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool) -> Callable[[int], str | None]:
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            stream = decoders.DecodeStream(skip_special_tokens=skip_special_tokens)
            return lambda token_id: stream.step(self._tok, token_id)
        # a byte-level vocabulary spells each token as fixed bytes: the stream is those bytes through an incremental
        # UTF-8 decoder, a lookup and a C call a token where the library's stream decodes its window of ids again
        pieces = self._byte_pieces(skip_special_tokens)
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        held = ""  # text of the tokens since the stream last gave some, while a character is split

        def step(token_id: int) -> str | None:
            nonlocal held
            held += utf8.decode(pieces[token_id] if token_id < len(pieces) else b"")
            if utf8.getstate()[0]:  # as the library's stream, nothing until the character is whole
                return None
            text, held = held, ""
            return text

        return step

    def _byte_pieces(self, skip_special_tokens: bool) -> list[bytes]:
        """Each token's bytes as a decode of it alone spells them before UTF-8 (the ByteLevel decoder's bytes where
        the alphabet spells the token, else its text's own); a special token's none where skipped."""
        if not self._pieces:
            pieces = []
            for i in range(self.vocab_size):
                token = self._tok.id_to_token(i) or ""
                try:
                    pieces.append(token.translate(_BYTE_LEVEL_BYTES).encode("latin-1"))
                except UnicodeEncodeError:
                    pieces.append(token.encode())
            self._pieces[False] = pieces
            self._pieces[True] = [b"" if i in self.special_ids else piece for i, piece in enumerate(pieces)]
        return self._pieces[skip_special_tokens]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def adds_bos_by_default(self, bos_token_id: int | None) -> bool:
        added = self._tok.encode("", add_special_tokens=True).ids
        return bos_token_id is not None and added[:1] == [bos_token_id]

    def save(self, out_dir: Path, bos_token: str | None, add_bos: bool) -> dict[str, Any]:
        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        # The post-processor is what adds BOS in Hugging Face fast tokenizers (transformers 4
        # ignores add_bos_token for a generic fast tokenizer), so it must agree with add_bos.
        if add_bos and bos_token is not None:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos_token}:0 $A:0",
                pair=f"{bos_token}:0 $A:0 {bos_token}:1 $B:1",
                special_tokens=[(bos_token, tok.token_to_id(bos_token))],
            )
        else:
            tok.post_processor = None
        tok.save(str(out_dir / "tokenizer.json"))
        return {"tokenizer_class": "PreTrainedTokenizerFast"}


class _SentencePieceCodec:
    """A SentencePiece model, plus the tokens that llama.cpp cuts out of text before it."""

    def __init__(self, model_proto: bytes, added_tokens: dict[int, AddedToken] | None = None):
        # here and in _sentencepiece_from_gguf: protobuf's import adds ~10 ms to every start, and only
        # SentencePiece vocabularies need it
        from sentencepiece import sentencepiece_model_pb2

        self._proto = model_proto
        self._sp = spm.SentencePieceProcessor(model_proto=model_proto)
        parsed_proto = sentencepiece_model_pb2.ModelProto.FromString(model_proto)
        # SentencePiece drops the leading space of whatever it decodes (the dummy prefix); a
        # twin without the dummy prefix decodes the text after a special token faithfully.
        parsed_proto.normalizer_spec.add_dummy_prefix = False
        self._sp_inner = spm.SentencePieceProcessor(model_proto=parsed_proto.SerializeToString())
        self._added = dict(added_tokens or {})
        self._piece_count = len(parsed_proto.pieces)
        self.vocab_size = max([self._piece_count - 1, *self._added]) + 1
        self.special_ids = {
            i
            for i, p in enumerate(parsed_proto.pieces)
            if p.type in (TokenType.CONTROL, TokenType.UNKNOWN)
        } | {i for i, t in self._added.items() if t.special}
        # Control, unknown and user-defined pieces written in the text become their ids, and
        # each stretch of plain text between them gets its own dummy-prefix space (llama.cpp).
        self._cut = {
            p.piece: i
            for i, p in enumerate(parsed_proto.pieces)
            if p.type in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
        }
        self._cut.update({t.content: i for i, t in self._added.items()})
        self._cut_text = {i: text for text, i in self._cut.items()}
        by_length = sorted(self._cut, key=len, reverse=True)
        self._cut_re = re.compile("|".join(map(re.escape, by_length))) if by_length else None
        bos, eos = self._sp.bos_id(), self._sp.eos_id()
        self.default_bos_token_id = bos if bos >= 0 else None
        self.default_eos_token_id = eos if eos >= 0 else None

    def encode(self, text: str) -> list[int]:
        if self._cut_re is None:
            return self._sp.encode(text)
        ids: list[int] = []
        pos = 0
        for match in self._cut_re.finditer(text):
            if match.start() > pos:
                ids += self._sp.encode(text[pos : match.start()])
            ids.append(self._cut[match.group()])
            pos = match.end()
        if pos < len(text):
            ids += self._sp.encode(text[pos:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        parts: list[str] = []
        run: list[int] = []

        def flush_run() -> None:
            if run:
                parts.append((self._sp_inner if parts else self._sp).decode(run))
                run.clear()

        for i in ids:
            if i in self._cut_text:
                if skip_special_tokens and i in self.special_ids:
                    continue
                flush_run()
                parts.append(self._cut_text[i])
            elif 0 <= i < self._piece_count:  # ids outside the vocabulary decode to nothing
                run.append(i)
        flush_run()
        return "".join(parts)

    def decode_stream(self, skip_special_tokens: bool) -> None:
        return None

    def token_to_id(self, token: str) -> int | None:
        if token in self._cut:
            return self._cut[token]
        i = self._sp.piece_to_id(token)
        return None if i == self._sp.unk_id() else i  # the unknown piece itself is in _cut

    def id_to_token(self, token_id: int) -> str | None:
        if token_id in self._added:
            return self._added[token_id].content
        if 0 <= token_id < self._piece_count:
            return self._sp.id_to_piece(token_id)
        return None

    def adds_bos_by_default(self, bos_token_id: int | None) -> bool:
        return True  # what Llama's SentencePiece tokenizers do

    def save(self, out_dir: Path, bos_token: str | None, add_bos: bool) -> dict[str, Any]:
        (out_dir / "tokenizer.model").write_bytes(self._proto)
        config: dict[str, Any] = {"tokenizer_class": "LlamaTokenizer", "legacy": True}
        if self._added:
            config["added_tokens_decoder"] = {
                str(i): {
                    "content": t.content,
                    "special": t.special,
                    "normalized": False,
                    "lstrip": False,
                    "rstrip": False,
                    "single_word": False,
                }
                for i, t in sorted(self._added.items())
            }
        return config


class Tokenizer:
    """A model's tokenizer: encode/decode, special tokens, BOS/EOS ids and chat template."""

    def __init__(
        self,
        codec: _Codec,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        extra_eos_token_ids: Iterable[int] = (),
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self._codec = codec
        self.vocab_size: int = codec.vocab_size
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.bos_token = None if bos_token_id is None else codec.id_to_token(bos_token_id)
        self.eos_token = None if eos_token_id is None else codec.id_to_token(eos_token_id)
        self.add_bos = add_bos and bos_token_id is not None
        self.chat_template = chat_template
        declared = {eos_token_id, *extra_eos_token_ids} - {None}
        by_name = {
            i
            for text in END_OF_GENERATION_TEXTS
            if (i := codec.token_to_id(text)) is not None and i in codec.special_ids
        }
        self.eos_token_ids: set[int] = declared | by_name
        texts = sorted({t for i in codec.special_ids if (t := codec.id_to_token(i)) and len(t) > 1}, key=len,
                       reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, texts))) if texts else None
        self._token_texts: dict[int, str] = {}

    def defuse(self, text: str) -> str:
        """text with each special token it spells broken by a word joiner after its first character: it then encodes
        as the characters it shows, never as the control token (a user's "<|im_end|>" cannot end a turn)."""
        if self._special_text is None:
            return text
        return self._special_text.sub(lambda m: m.group()[0] + WORD_JOINER + m.group()[1:], text)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, special tokens written in it included.

        add_bos None follows the model (`self.add_bos`) but adds no second BOS when the text
        already starts with the BOS token (chat templates often write it).
        """
        if add_bos is None:
            add_bos = self.add_bos and not (self.bos_token and text.startswith(self.bos_token))
        ids = self._codec.encode(text)
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._codec.decode(list(ids), skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = False) -> Callable[[int], str | None] | None:
        """Text one id at a time, as decode gives it (None while a character is split): a byte-level vocabulary's
        token bytes through a UTF-8 decoder, or the library's own stream (Hugging Face tokenizers' DecodeStream);
        None where the library keeps none (sentencepiece)."""
        return self._codec.decode_stream(skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text, as decode([token_id]) gives it, remembered: logprobs name 21 tokens a token, mostly the
        same few hundred."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id])
        return text

    def is_special(self, token_id: int) -> bool:
        """True for control tokens (BOS, EOS, <|im_start|>, ...), which decode to markup."""
        return token_id in self._codec.special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._codec.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id, in the engine's own spelling (e.g. 'Ġworld')."""
        return self._codec.id_to_token(token_id)

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any]) -> Tokenizer:
        """The vocabulary embedded in a GGUF file's metadata (tokenizer.ggml.*)."""
        kind = metadata.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in metadata:
            raise ModelLoadError("GGUF file has no embedded vocabulary (tokenizer.ggml.tokens)")
        try:
            if kind == "gpt2":
                codec, add_bos_default = _byte_level_bpe_from_gguf(metadata)
            elif kind == "llama":
                codec, add_bos_default = _sentencepiece_from_gguf(metadata), True
            else:
                raise ModelLoadError(
                    f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2, llama)"
                )
        except ModelLoadError:
            raise
        except Exception as exc:  # tokenizers and sentencepiece refuse a damaged vocabulary with bare Exceptions
            raise ModelLoadError(f"the GGUF file's vocabulary is damaged: {str(exc).splitlines()[0]}") from None
        extra_eos = [
            metadata[key]
            for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
            if key in metadata
        ]
        return cls(
            codec,
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            extra_eos_token_ids=extra_eos,
            add_bos=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
            chat_template=metadata.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """A Hugging Face model folder: tokenizer.json or tokenizer.model, plus its configs."""
        path = Path(path)
        config = _read_json(path / "tokenizer_config.json")
        if (path / "tokenizer.json").is_file():
            try:
                codec: _Codec = _TokenizersCodec(
                    tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
                )
            except Exception as exc:  # tokenizers raises a bare Exception on bad files
                raise ModelLoadError(f"{path / 'tokenizer.json'}: cannot load ({exc})") from exc
        elif (path / "tokenizer.model").is_file():
            added = {
                int(i): AddedToken(t["content"], special=bool(t.get("special")), normalized=False)
                for i, t in config.get("added_tokens_decoder", {}).items()
            }
            try:
                codec = _SentencePieceCodec((path / "tokenizer.model").read_bytes(), added)
            except RuntimeError as exc:
                raise ModelLoadError(f"{path / 'tokenizer.model'}: cannot load ({exc})") from exc
        else:
            raise ModelLoadError(f"no tokenizer.json or tokenizer.model in {path}")

        bos_id = _configured_token_id(codec, config, "bos_token", codec.default_bos_token_id)
        eos_id = _configured_token_id(codec, config, "eos_token", codec.default_eos_token_id)
        generation = _read_json(path / "generation_config.json")
        generation_eos = generation.get("eos_token_id")
        if isinstance(generation_eos, int):
            generation_eos = [generation_eos]
        if eos_id is None and generation_eos:
            eos_id = generation_eos[0]
        if "add_bos_token" in config:
            add_bos = bool(config["add_bos_token"])
        else:
            add_bos = codec.adds_bos_by_default(bos_id)
        return cls(
            codec,
            bos_token_id=bos_id,
            eos_token_id=eos_id,
            extra_eos_token_ids=generation_eos or (),
            add_bos=add_bos,
            chat_template=_configured_chat_template(path, config),
        )

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Write tokenizer.json (or tokenizer.model) and tokenizer_config.json into out_dir.

        The folder loads back through `Tokenizer.from_dir` and `transformers.AutoTokenizer`
        with the same ids.
        """
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        config = self._codec.save(out_dir, self.bos_token, self.add_bos)
        config.update(
            {
                "bos_token": self.bos_token,
                "eos_token": self.eos_token,
                "add_bos_token": self.add_bos,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
            }
        )
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (out_dir / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def _byte_level_bpe_from_gguf(metadata: dict[str, Any]) -> tuple[_TokenizersCodec, bool]:
    """A GPT-2 style byte-level BPE built from GGUF tokens and merges; also its BOS default."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    family = _PRE_TOKENIZER_FAMILY.get(pre)
    if family is None:
        raise ModelLoadError(f"unsupported GGUF pre-tokenizer {pre!r} (tokenizer.ggml.pre)")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    if "tokenizer.ggml.merges" not in metadata:
        raise ModelLoadError("GGUF gpt2 vocabulary has no merges (tokenizer.ggml.merges)")
    model = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=[_split_merge(m) for m in metadata["tokenizer.ggml.merges"]],
        ignore_merges=family in _IGNORE_MERGES_FAMILIES,
    )
    tok = tokenizers.Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r), behavior="isolated")
            for r in _PRE_TOKENIZER_REGEXES[family]
        ]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(tokens[i], special=types[i] == TokenType.CONTROL, normalized=False)
            for i in range(len(tokens))
            if types[i] in (TokenType.CONTROL, TokenType.USER_DEFINED)
        ]
    )
    return _TokenizersCodec(tok), family in _ADD_BOS_BY_DEFAULT_FAMILIES


def _split_merge(merge: str) -> tuple[str, str]:
    """'left right' -> (left, right), cut where llama.cpp cuts: the first space after position 0."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise ModelLoadError(f"malformed GGUF merge {merge!r} (tokenizer.ggml.merges)")
    return merge[:cut], merge[cut + 1 :]


def _sentencepiece_from_gguf(metadata: dict[str, Any]) -> _SentencePieceCodec:
    """A SentencePiece BPE model rebuilt from GGUF tokens, scores and token types.

    GGUF token types number the kinds of piece as SentencePiece does, so they carry over as is.
    """
    from sentencepiece import sentencepiece_model_pb2

    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata.get("tokenizer.ggml.scores", [0.0] * len(tokens))
    types: list[int] = list(
        metadata.get("tokenizer.ggml.token_type", [TokenType.NORMAL] * len(tokens))
    )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    if TokenType.UNKNOWN not in types:  # SentencePiece refuses a model without an unknown piece
        types[unk_id] = TokenType.UNKNOWN
    proto = sentencepiece_model_pb2.ModelProto()
    proto.trainer_spec.model_type = sentencepiece_model_pb2.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = len(tokens)
    proto.trainer_spec.byte_fallback = TokenType.BYTE in types
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = bool(
        metadata.get("tokenizer.ggml.add_space_prefix", True)
    )
    proto.normalizer_spec.remove_extra_whitespaces = bool(
        metadata.get("tokenizer.ggml.remove_extra_whitespaces", False)
    )
    proto.normalizer_spec.escape_whitespaces = True
    for token, score, kind in zip(tokens, scores, types, strict=True):
        proto.pieces.add(piece=token, score=score, type=kind)
    try:
        return _SentencePieceCodec(proto.SerializeToString())
    except RuntimeError as exc:
        raise ModelLoadError(f"GGUF SentencePiece vocabulary is invalid ({exc})") from exc


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


def _configured_token_id(
    codec: _Codec, config: dict[str, Any], key: str, default: int | None
) -> int | None:
    """The id of a tokenizer_config special token (a string or an AddedToken dict), if set."""
    if key not in config:
        return default
    token = config[key]
    if isinstance(token, dict):
        token = token.get("content")
    return None if token is None else codec.token_to_id(token)


def _configured_chat_template(path: Path, config: dict[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja, or tokenizer_config's chat_template."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template
