"""The engine log (engines/logs.py): where a replica's engine chatter goes, and the reason an
engine process gave for failing to start."""

from __future__ import annotations

from llmbatch.engines.logs import EngineLog

# vLLM 0.32's engine process on this CPU, failing to start (its traceback, prefixed, then bare)
FAILED_START = """\
(EngineCore pid=14360) ERROR 11-29 11:42:29 [core.py:1510] EngineCore failed to start.
(EngineCore pid=14360) ERROR 11-29 11:42:29 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=14360) ERROR 11-29 11:42:29 [core.py:1510]   File "/x/vllm/v1/executor/ray_utils.py", line 574, in initialize_ray_cluster
(EngineCore pid=14360) ERROR 11-29 11:42:29 [core.py:1510]     raise ValueError(
(EngineCore pid=14360) ERROR 11-29 11:42:29 [core.py:1510] ValueError: current platform cpu does not support ray.
Process EngineCore:
Traceback (most recent call last):
  File "/x/vllm/v1/executor/ray_utils.py", line 574, in initialize_ray_cluster
    raise ValueError(
ValueError: current platform cpu does not support ray.
"""


def test_the_reason_is_the_last_exception_written_since_the_start_began(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # (not in a Ray worker: the log goes here)
    log = EngineLog()
    log.fh.write("INFO a first start\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    mark = log.mark()
    assert log.reason_since(mark) is None  # the earlier start's failure is not this one's
    log.fh.write("INFO loading weights\nWARNING something: not an exception line\n")
    assert log.reason_since(mark) is None
    log.fh.write(FAILED_START)
    log.fh.flush()
    assert log.reason_since(mark) == "ValueError: current platform cpu does not support ray."
    assert log.reason_since(0) == "ValueError: current platform cpu does not support ray."
    log.fh.write("(EngineCore pid=9) ERROR 01-01 00:00:00 [core.py:1] torch.OutOfMemoryError: CUDA out of memory.\n")
    log.fh.flush()
    assert log.reason_since(mark) == "torch.OutOfMemoryError: CUDA out of memory."
    log.fh.close()
