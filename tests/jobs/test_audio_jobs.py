"""Jobs over audio: an audio column with a prompt template (the multimodal stage turned on by it),
from the job file and from the CLI's --audio-column."""

from __future__ import annotations

import numpy as np
import pytest

from llmbatch.errors import ConfigError, RowValidationError
from llmbatch.jobs.prompts import job_preprocess
from llmbatch.jobs.spec import load_job


def spec_of(tmp_path, prompt):
    return load_job(data={"input": {"path": str(tmp_path / "clips.parquet")}, "model": {"source": "smollm2-135m-instruct"},
                          "prompt": prompt, "output": {"path": str(tmp_path / "out.parquet")}})


def test_an_audio_column_puts_the_clip_before_the_prompt_and_enables_the_stage(tmp_path):
    spec = spec_of(tmp_path, {"user": "What is this sound ({id})?", "audio_column": "clip"})
    assert spec.processor_config().prepare_multimodal_stage.enabled
    assert "clip" in spec.prompt.fields()
    out = job_preprocess(spec)({"id": 7, "clip": b"RIFF..."})
    assert out["messages"] == [{"role": "user", "content": [{"type": "audio", "audio": b"RIFF..."},
                                                            {"type": "text", "text": "What is this sound (7)?"}]}]
    decoded = {"array": np.zeros(4, np.float32), "sampling_rate": 16000, "path": None}
    assert job_preprocess(spec)({"id": 1, "clip": decoded})["messages"][0]["content"][0]["audio"] is decoded
    for empty in (None, b"", {"bytes": None, "path": None}):
        with pytest.raises(RowValidationError, match="column 'clip' \\(the audio\\) is empty"):
            job_preprocess(spec)({"id": 1, "clip": empty})


def test_an_image_and_a_clip_in_one_row_and_the_column_needs_a_prompt(tmp_path):
    spec = spec_of(tmp_path, {"user": "Do they match?", "image_column": "img", "audio_column": "clip"})
    content = job_preprocess(spec)({"img": b"\x89PNG", "clip": "clips/a.wav"})["messages"][0]["content"]
    assert [p["type"] for p in content] == ["image", "audio", "text"]
    with pytest.raises(ConfigError, match="audio_column needs a prompt.user"):
        spec_of(tmp_path, {"prompt_column": "id", "audio_column": "clip"})


def test_the_cli_takes_an_audio_column(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from llmbatch import cli
    from llmbatch.cli import jobs

    seen = {}
    monkeypatch.setattr(jobs, "_run", lambda spec, *args, **kwargs: seen.update(spec=spec))
    result = CliRunner().invoke(cli.app, ["run", "--input", str(tmp_path / "clips.parquet"), "--audio-column", "clip", "-m", "tiny-audio",
                                          "--prompt", "What is this sound?", "--output", str(tmp_path / "o.parquet")])
    assert seen, result.output
    assert seen["spec"].prompt.audio_column == "clip"
