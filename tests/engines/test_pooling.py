"""Pooled vectors stay float32 arrays from the engine to the output (engines/pooling.py): no
Python float per element, the same output column and OpenAI lines as before."""

from __future__ import annotations

import asyncio
import base64
import struct

import numpy as np
import pyarrow as pa
import pytest

from llmbatch.codec import rows_to_table
from llmbatch.engines.base import Request
from llmbatch.engines.pooling import as_vector, classification, cosine
from llmbatch.openai.responses import output_line
from llmbatch.rows import STATS
from llmbatch.stages.answers import answer_record
from llmbatch.stages.engine import result_size
from llmbatch.stages.output import OutputStage


def test_a_tensor_becomes_a_float32_array_of_its_own():
    torch = pytest.importorskip("torch")
    batch = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    vec = as_vector(batch[1])  # a row of the engine's batch
    assert vec.dtype == np.float32 and vec.shape == (4,) and vec.tolist() == [4.0, 5.0, 6.0, 7.0]
    batch[1, 0] = -1.0
    assert vec[0] == 4.0 and not np.shares_memory(vec, batch.numpy())  # a copy: it neither follows nor holds the batch
    half = as_vector(torch.tensor([0.5, -2.0], dtype=torch.bfloat16))
    assert half.dtype == np.float32 and half.tolist() == [0.5, -2.0]
    assert as_vector([1, 2.5]).tolist() == [1.0, 2.5] and as_vector([1, 2.5]).dtype == np.float32


def test_classification_and_cosine_take_arrays():
    logits = np.array([1.0, 3.0, 2.0], dtype=np.float32)
    out = classification(logits, {1: "good"}, activated=False)
    assert out["label"] == "good" and all(type(p) is float for p in out["probs"])
    assert abs(sum(out["probs"]) - 1.0) < 1e-9
    assert classification(np.array([0.0], dtype=np.float32), {}, activated=False) == {"probs": [0.5], "label": "LABEL_0"}
    a, b = np.array([1.0, 0.0, 1.0], dtype=np.float32), [1.0, 1.0, 0.0]
    assert type(cosine(a, b)) is float and cosine(a, b) == pytest.approx(0.5)
    assert cosine(np.zeros(3, dtype=np.float32), b) == 0.0


def test_array_embeddings_make_the_same_fixed_size_float32_column():
    vectors = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    rows = [{"id": i, "embeddings": v, "__inference_error__": ""} for i, v in enumerate(vectors)]
    rows.append({"id": 3, "embeddings": None, "__inference_error__": "engine: X: failed"})
    as_lists = [{**r, "embeddings": None if r["embeddings"] is None else r["embeddings"].tolist()} for r in rows]
    table, before = rows_to_table(rows), rows_to_table(as_lists)
    assert table.schema == before.schema and table.equals(before)
    assert table.schema.field("embeddings").type == pa.list_(pa.float32(), 384)
    flat = table.column("embeddings").combine_chunks().flatten().to_numpy()
    assert np.array_equal(flat.reshape(-1, 384)[:3], vectors)
    # the processor's output stage, an error row beside answered ones
    out = OutputStage().bind(task_type="embed", continue_on_error=True, postprocessed=False)
    shaped = out.to_table([{"prompt": "p", **r} for r in rows])
    assert shaped.schema.field("embeddings").type == pa.list_(pa.float32(), 384)
    assert shaped.column("embeddings").null_count == 1


def test_an_array_answer_counts_its_bytes_and_is_not_recorded():
    vec = np.zeros(384, dtype=np.float32)
    assert result_size({"embeddings": vec}) >= 384 * 4
    assert answer_record("t", b"k" * 16, {"embeddings": vec}) is None  # recomputed on resume


def test_openai_embedding_lines_from_array_rows():
    vec = np.array([0.5, -0.25], dtype=np.float32)
    rows = [{"custom_id": "e", "line": 4, "url": "/v1/embeddings", "model": None, "sub": i, "subs": 3,
             "embeddings": v, "num_input_tokens": 3, "encoding_format": fmt, STATS: {"finished_at": 1.0}}
            for i, (v, fmt) in enumerate([(vec, "float"), (vec, "base64"), (None, "float")])]
    data = output_line(rows, "served", "job")["response"]["body"]["data"]
    assert data[0]["embedding"] == [0.5, -0.25] and all(type(x) is float for x in data[0]["embedding"])
    assert list(struct.unpack("<2f", base64.b64decode(data[1]["embedding"]))) == [0.5, -0.25]
    assert data[2]["embedding"] == []


class _Final:
    def __init__(self, data):
        self.outputs = type("Pooled", (), {"data": data})()


def test_the_vllm_engine_answers_pooling_tasks_with_arrays():
    torch = pytest.importorskip("torch")
    from llmbatch.engines.settings import VLLMSettings
    from llmbatch.engines.vllm import VLLMEngine

    def engine(task):
        return VLLMEngine(VLLMSettings(model_source="m", engine_kwargs={}, task_type=task))

    params = type("Params", (), {"use_activation": False})()
    request = Request(prompt={"prompt_token_ids": [1]}, params=params)
    embed = asyncio.run(engine("embed")._pooled(request, _Final(torch.tensor([0.6, 0.8])), None))
    assert embed["embeddings"].dtype == np.float32 and embed["embeddings"].tolist() == pytest.approx([0.6, 0.8])
    classify = asyncio.run(engine("classify")._pooled(request, _Final(torch.tensor([0.0, 2.0])), None))
    assert classify["label"] == "LABEL_1" and classify["embeddings"].dtype == np.float32
    score = asyncio.run(engine("score")._pooled(request, _Final(torch.tensor([1.5])), None))
    assert type(score["score"]) is float and score["score"] == 1.5


def test_a_bi_encoder_score_is_the_cosine_of_two_arrays():
    torch = pytest.importorskip("torch")
    from llmbatch.engines.settings import VLLMSettings
    from llmbatch.engines.vllm import VLLMEngine

    class LLM:
        async def encode(self, prompt, params, request_id, lora_request=None):
            yield _Final(torch.tensor([1.0, 1.0, 0.0]))

    engine = VLLMEngine(VLLMSettings(model_source="m", engine_kwargs={}, task_type="score"))
    engine.llm = LLM()
    request = Request(prompt={"prompt_token_ids": [1]}, params=None, extra={"prompt_2": {"prompt_token_ids": [2]}})
    out = asyncio.run(engine._pooled(request, _Final(torch.tensor([1.0, 0.0, 1.0])), None))
    assert type(out["score"]) is float and out["score"] == pytest.approx(0.5)
    assert out["embeddings"].dtype == np.float32 and out["embeddings"].tolist() == pytest.approx([0.5])
