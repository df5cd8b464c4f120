"""llmbatch: run large language models over whole datasets.

A drop-in for Ray's ``ray.data.llm`` (same configs, same row contract) with resumable,
exactly-once jobs on top. See the README for the two-minute tour.
"""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

#: each public name -> the module that defines it: imported on first use (PEP 562), so that a
#: process that needs one corner of llmbatch (the engine launcher, a Ray worker unpickling a
#: stage, ``llmbatch.startlog``) does not import Ray Data and the whole config layer first
_WHERE = {
    "build_llm_processor": "llmbatch.builders", "build_processor": "llmbatch.builders",
    **dict.fromkeys(("ChatTemplateStageConfig", "DetokenizeStageConfig", "HttpRequestProcessorConfig",
                     "HttpRequestStageConfig", "LLMConfig", "PrepareMultimodalStageConfig", "ProcessorConfig",
                     "ServeDeploymentProcessorConfig", "SGLangEngineProcessorConfig", "TokenizerStageConfig",
                     "vLLMEngineProcessorConfig"), "llmbatch.config"),
    "build_llm_deployment": "llmbatch.deployments",
    **dict.fromkeys(("ConfigError", "EndpointError", "JobError", "LLMBatchError", "RowError"), "llmbatch.errors"),
    "JobResult": "llmbatch.jobs.run", "run_job": "llmbatch.jobs.run",
    "JobSpec": "llmbatch.jobs.spec", "load_job": "llmbatch.jobs.spec",
    **dict.fromkeys(("VerifyReport", "verify_job", "verify_rows"), "llmbatch.jobs.verify"),
    "Processor": "llmbatch.processor",
}

if _typing.TYPE_CHECKING:  # the same names, for type checkers and editors
    from llmbatch.builders import build_llm_processor, build_processor
    from llmbatch.config import (
        ChatTemplateStageConfig,
        DetokenizeStageConfig,
        HttpRequestProcessorConfig,
        HttpRequestStageConfig,
        LLMConfig,
        PrepareMultimodalStageConfig,
        ProcessorConfig,
        ServeDeploymentProcessorConfig,
        SGLangEngineProcessorConfig,
        TokenizerStageConfig,
        vLLMEngineProcessorConfig,
    )
    from llmbatch.deployments import build_llm_deployment
    from llmbatch.errors import (
        ConfigError,
        EndpointError,
        JobError,
        LLMBatchError,
        RowError,
    )
    from llmbatch.jobs.run import JobResult, run_job
    from llmbatch.jobs.spec import JobSpec, load_job
    from llmbatch.jobs.verify import VerifyReport, verify_job, verify_rows
    from llmbatch.processor import Processor

__version__ = "0.1.0"

__all__ = sorted(_WHERE)  # (tests/test_public_api.py: the names above for type checkers match)


def __getattr__(name: str):
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'llmbatch' has no attribute {name!r}")
    value = getattr(_importlib.import_module(where), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
