"""llmbatch: run large language models over whole datasets.

A drop-in for Ray's ``ray.data.llm`` (same configs, same row contract) with resumable,
exactly-once jobs on top. See the README for the two-minute tour.
"""

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

__all__ = [
    "ChatTemplateStageConfig",
    "ConfigError",
    "DetokenizeStageConfig",
    "EndpointError",
    "HttpRequestProcessorConfig",
    "HttpRequestStageConfig",
    "JobError",
    "JobResult",
    "JobSpec",
    "LLMBatchError",
    "LLMConfig",
    "PrepareMultimodalStageConfig",
    "Processor",
    "ProcessorConfig",
    "RowError",
    "SGLangEngineProcessorConfig",
    "ServeDeploymentProcessorConfig",
    "TokenizerStageConfig",
    "VerifyReport",
    "build_llm_deployment",
    "build_llm_processor",
    "build_processor",
    "load_job",
    "run_job",
    "vLLMEngineProcessorConfig",
    "verify_job",
    "verify_rows",
]
