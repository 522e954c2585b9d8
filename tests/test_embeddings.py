"""Embeddings over real HTTP: OpenAI's /v1/embeddings (its official client, float and base64) and Ollama's
/api/embed and /api/embeddings, on the tiny model; and on the real model, paraphrases closer than unrelated text."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import ollama
import openai
import pytest

from edgeserve.engine.llm_engine import LLMEngine
from loopback import ServerThread, serving

MODEL = "tiny"
TEXTS = ["hello there", "a much longer sentence about something else entirely", "hi"]
http = httpx.Client(timeout=60)


@pytest.fixture(scope="module")
def server(tiny_model) -> Iterator[ServerThread]:
    with serving(tiny_model, MODEL, kv_memory="16MiB") as server:
        yield server


def test_openai_embeddings_are_unit_length_deterministic_and_batch_invariant(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    batch = client.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    vectors = np.array([d.embedding for d in batch.data])
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.model == MODEL
    assert vectors.shape == (3, 64) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > 3
    alone = [client.embeddings.create(model=MODEL, input=t, encoding_format="float").data[0].embedding for t in TEXTS]
    np.testing.assert_allclose(np.array(alone), vectors, atol=1e-6)  # alone as in a batch, float as base64
    assert not np.allclose(vectors[0], vectors[1], atol=1e-3)
    ids = http.post(server.url + "/tokenize", json={"content": TEXTS[0], "add_special": True}).json()["tokens"]
    by_ids = client.embeddings.create(model=MODEL, input=[ids], encoding_format="float").data[0].embedding
    np.testing.assert_allclose(by_ids, vectors[0], atol=1e-6)


def test_openai_embeddings_refuse_what_they_cannot_do(server):
    url = server.url + "/v1/embeddings"
    dims = http.post(url, json={"input": "hi", "dimensions": 8})
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]["message"]
    assert http.post(url, json={"input": []}).status_code == 400
    assert http.post(url, json={"input": "hi", "model": "nope"}).status_code == 404
    too_long = http.post(url, json={"input": [[5] * 5000]})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"


def test_ollama_embed_matches_openai(server):
    client = ollama.Client(host=server.url)
    embedded = client.embed(model=MODEL, input=TEXTS)
    assert embedded.prompt_eval_count > 3 and len(embedded.embeddings) == 3
    openai_vectors = http.post(server.url + "/v1/embeddings", json={"input": TEXTS}).json()["data"]
    np.testing.assert_allclose(embedded.embeddings, [d["embedding"] for d in openai_vectors], atol=1e-6)
    older = client.embeddings(model=MODEL, prompt=TEXTS[0])
    np.testing.assert_allclose(older.embedding, embedded.embeddings[0], atol=1e-6)


def test_paraphrases_are_closer_than_unrelated_text(loaded_model):
    engine = LLMEngine(loaded_model, backend="numpy", kv_memory="64MiB")
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.", "Quarterly revenue rose by ten percent.",
             "How do I bake bread at home?", "What is a simple recipe for homemade bread?"]
    e = engine.embed([loaded_model.tokenizer.encode(t) for t in texts])
    similar = e @ e.T
    assert similar[0, 1] > max(similar[0, 2], similar[0, 3], similar[0, 4], similar[1, 2])
    assert similar[3, 4] > max(similar[3, 0], similar[3, 2], similar[4, 0], similar[4, 2])


def test_pooling_follows_the_model(tiny_model, tmp_path):
    """First-token pooling sees only the first token (attention is causal); last-token pooling sees the whole text;
    a sentence-transformers folder and a GGUF's pooling_type say which."""
    import dataclasses
    import json

    from edgeserve.models.loader import GGUF_POOLING, folder_pooling

    ids = tiny_model.tokenizer.encode("hello there friend")
    mean, cls, last = (LLMEngine(dataclasses.replace(tiny_model, pooling=p), backend="numpy", kv_memory="16MiB")
                       for p in ("mean", "cls", "last"))
    np.testing.assert_allclose(cls.embed([ids])[0], mean.embed([ids[:1]])[0], atol=1e-5)
    assert not np.allclose(last.embed([ids])[0], cls.embed([ids])[0], atol=1e-3)
    assert not np.allclose(last.embed([ids])[0], mean.embed([ids])[0], atol=1e-3)
    np.testing.assert_allclose(last.embed([ids])[0], last.embed([ids[:2], ids])[1], atol=1e-5)
    assert folder_pooling(tmp_path) == "mean"
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True,
                                                                    "pooling_mode_mean_tokens": False}))
    assert folder_pooling(tmp_path) == "last"
    assert [GGUF_POOLING.get(n, "mean") for n in range(5)] == ["mean", "mean", "cls", "last", "mean"]
