"""Building and running change nothing global, and no surface pretends to work."""

from __future__ import annotations

import csv
import logging
import pickle
import subprocess
import sys
import textwrap

import pytest

from llmbatch import build_processor, vLLMEngineProcessorConfig
from llmbatch.config import PrepareMultimodalStageConfig
from llmbatch.errors import ConfigError

MODEL = "smollm2-135m-instruct"


def test_a_local_preprocess_travels_by_value_without_global_registration(tmp_path, monkeypatch):
    from ray import cloudpickle

    (tmp_path / "myhooks.py").write_text("SUFFIX = '!'\ndef pre(row):\n    return {'prompt': row['q'] + SUFFIX}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import myhooks

    before = set(cloudpickle.list_registry_pickle_by_value())
    processor = build_processor(vLLMEngineProcessorConfig(model_source=MODEL), preprocess=myhooks.pre)
    stage = processor.get_stage_by_name("preprocess")
    data = cloudpickle.dumps(stage)
    assert set(cloudpickle.list_registry_pickle_by_value()) == before  # nothing left registered
    # a process that cannot import myhooks still runs the function
    code = textwrap.dedent("""
        import pickle, sys
        stage = pickle.loads(sys.stdin.buffer.read())
        print(stage.fn({"q": "hi"})["prompt"])
    """)
    proc = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, cwd="/")
    assert proc.stdout.decode().strip() == "hi!", proc.stderr.decode()[-1000:]
    assert pickle.loads(pickle.dumps(stage)).fn({"q": "x"}) == {"prompt": "x!"}


def test_packages_installed_outside_site_packages_are_not_pickled_by_value(tmp_path, monkeypatch):
    """pip install --target DIR and PYTHONPATH=DIR (as on a machine without a venv): those
    packages have a distribution and stay imported by name; only the user's own modules travel
    by value (pickling a whole installed stack by value recursed without end)."""
    from llmbatch import codec

    site = tmp_path / "site"
    (site / "targetpkg").mkdir(parents=True)
    (site / "targetpkg" / "__init__.py").write_text("VALUE = 1\n")
    dist = site / "targetpkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: targetpkg\nVersion: 1.0\n")
    (dist / "top_level.txt").write_text("targetpkg\n")
    (tmp_path / "ownhooks.py").write_text("def pre(row):\n    return row\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.syspath_prepend(str(tmp_path))
    codec._installed_packages.cache_clear()
    import ownhooks
    import targetpkg

    try:
        assert not codec._is_local("targetpkg", targetpkg)
        assert codec._is_local("ownhooks", ownhooks)
    finally:
        codec._installed_packages.cache_clear()


def test_reading_a_csv_puts_the_field_size_limit_back(tmp_path):
    from llmbatch.io.readers import read_rows

    (tmp_path / "a.csv").write_text("a,b\n1,2\n")
    before = csv.field_size_limit()
    assert list(read_rows(str(tmp_path / "a.csv")))[0][0]["a"] == "1"
    assert csv.field_size_limit() == before


def test_a_job_puts_ray_datas_context_and_log_levels_back():
    import ray.data

    from llmbatch.jobs.driver import quiet_ray_data

    ctx = ray.data.DataContext.get_current()
    before = (ctx.enable_progress_bars, list(ctx.issue_detectors_config.detectors),
              logging.getLogger("ray.data").level)
    with quiet_ray_data():
        assert ctx.enable_progress_bars is False and ctx.issue_detectors_config.detectors == []
    assert (ctx.enable_progress_bars, list(ctx.issue_detectors_config.detectors),
            logging.getLogger("ray.data").level) == before


def test_processors_that_cannot_run_fail_when_the_job_is_loaded(tmp_path):
    from llmbatch.jobs.spec import load_job

    (tmp_path / "d.csv").write_text("q\nhi\n")
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""
        input: {path: d.csv}
        model: {source: x, processor: sglang}
        prompt: {user: "{q}"}
        output: {path: out.parquet}
    """))
    with pytest.raises(Exception, match="sglang|SGLang"):
        load_job(job)
    assert not (tmp_path / "out.parquet.job").exists()


@pytest.mark.parametrize("field,value", [("model_config_kwargs", {"limit_mm_per_prompt": {"image": 2}}),
                                         ("chat_template_content_format", "openai"),
                                         ("apply_sys_msg_formatting", True)])
def test_ray_multimodal_settings_are_accepted_without_side_effects(field, value):
    config = PrepareMultimodalStageConfig(enabled=True, **{field: value})
    assert getattr(config, field) == value
    with pytest.raises(ConfigError, match="chat_template_content_format"):
        PrepareMultimodalStageConfig(chat_template_content_format="markdown")


def test_log_engine_metrics_says_what_it_needs_where_ray_serve_is_missing():
    from llmbatch.engines.vllm_setup import ray_stat_logger
    from llmbatch.errors import MissingDependencyError

    try:
        import ray.serve  # noqa: F401
    except ImportError:
        serve = False
    else:
        serve = True
    if serve:
        assert ray_stat_logger() is not None
    else:
        with pytest.raises(MissingDependencyError, match=r"ray\[serve\]"):
            ray_stat_logger()
