"""Whose rows a job runs decides its media policy: an openai-batch job (what ``llmbatch serve``
runs for API clients) gets ``media_access: public`` unless it names one; a job over the
operator's own table (an image column, a folder of images) keeps ``local``."""

from __future__ import annotations

import json

import pytest

from llmbatch import build_processor
from llmbatch.jobs.spec import load_job


def batch_file(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
                                "body": {"model": "smollm2-135m-instruct",
                                         "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    return str(path)


def access(doc):
    return load_job(data=doc).processor_config().prepare_multimodal_stage.media_access


def test_openai_batch_jobs_default_to_public_media_and_the_operator_may_say_local(tmp_path):
    path = batch_file(tmp_path)
    base = {"input": {"path": path, "format": "openai-batch"}, "output": {"path": path + ".out"}}
    for mm in (None, True, {"enabled": True}):
        model = {"source": "smollm2-135m-instruct", **({"prepare_multimodal_stage": mm} if mm is not None else {})}
        assert access({**base, "model": model}) == "public", mm
    local = {"source": "smollm2-135m-instruct", "prepare_multimodal_stage": {"enabled": True, "media_access": "local"}}
    assert access({**base, "model": local}) == "local"


def test_jobs_over_the_operators_own_rows_keep_local_media(tmp_path):
    table = tmp_path / "rows.jsonl"
    table.write_text(json.dumps({"image": str(tmp_path / "a.png")}) + "\n")
    doc = {"input": {"path": str(table)}, "output": {"path": str(tmp_path / "out.jsonl")},
           "model": {"source": "smollm2-135m-instruct"},
           "prompt": {"user": "Describe it.", "image_column": "image"}}
    assert access(doc) == "local"


def test_the_job_llmbatch_serve_writes_for_a_batch_fetches_media_as_public(tmp_path):
    """The server's job file for a batch (its template with the operator's --set, the batch's
    input) builds a multimodal stage whose policy refuses local files and private addresses,
    also when the operator turned the stage on with a bare ``true``."""
    main = pytest.importorskip("llmbatch.server.main")
    from llmbatch.server.settings import ServerSettings

    settings = ServerSettings(data_dir=tmp_path, model="smollm2-135m-instruct",
                              overrides=["model.prepare_multimodal_stage=true"])
    path = batch_file(tmp_path)
    doc = {**main.job_template(settings),
           "input": {"path": path, "format": "openai-batch", "endpoint": "/v1/chat/completions",
                     "invalid_lines": "error"},
           "output": {"path": str(tmp_path / "output.jsonl"), "errors_path": str(tmp_path / "error.jsonl")},
           "job_dir": str(tmp_path / "job")}
    processor = build_processor(load_job(data=doc).processor_config())
    policy = processor.get_stage_by_name("prepare_multimodal").policy
    assert (policy.local_files, policy.private_networks, policy.root) == (False, False, None)
