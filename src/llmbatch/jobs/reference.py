"""The configuration reference (docs/configuration.md), made from the fields' own docs.

Regenerate it with ``python -m llmbatch.jobs.reference > docs/configuration.md``; a test keeps
the committed page current.
"""

from __future__ import annotations

from llmbatch.config import (
    ChatTemplateStageConfig,
    DetokenizeStageConfig,
    HttpRequestProcessorConfig,
    HttpRequestStageConfig,
    LLMConfig,
    PrepareMultimodalStageConfig,
    ServeDeploymentProcessorConfig,
    SGLangEngineProcessorConfig,
    TokenizerStageConfig,
    vLLMEngineProcessorConfig,
)
from llmbatch.jobs.spec import InputSpec, JobSpec, ModelSpec, OutputSpec, PromptSpec

SECTIONS = [
    ("Processor configs", [vLLMEngineProcessorConfig, SGLangEngineProcessorConfig, HttpRequestProcessorConfig,
                           ServeDeploymentProcessorConfig]),
    ("Stage configs", [ChatTemplateStageConfig, TokenizerStageConfig, DetokenizeStageConfig, PrepareMultimodalStageConfig,
                       HttpRequestStageConfig]),
    ("Serve deployments", [LLMConfig]),
    ("Job files", [JobSpec, InputSpec, ModelSpec, PromptSpec, OutputSpec]),
]


def config_reference() -> str:
    """The whole reference page, in Markdown."""
    out = ["# Configuration reference", "",
           "Generated from the configs' field descriptions: `python -m llmbatch.jobs.reference > docs/configuration.md`.",
           ""]
    for title, classes in SECTIONS:
        out += [f"## {title}", ""]
        for cls in classes:
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            out += [f"### `{cls.__name__}`", "", doc, "", "| field | type | default | description |",
                    "| --- | --- | --- | --- |"]
            for name, field in cls.model_fields.items():
                default = "required" if field.is_required() else repr(
                    field.default_factory() if field.default_factory is not None else field.default)
                ann = field.annotation
                annotation = (ann.__name__ if isinstance(ann, type) else str(ann)).replace("typing.", "").replace("|", "\\|")
                description = (field.description or "").replace("|", "\\|")
                out.append(f"| `{name}` | `{annotation}` | `{default}` | {description} |")
            out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(config_reference())
