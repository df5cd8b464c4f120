import importlib

import llmbatch


def test_all_is_sorted_and_complete():
    assert llmbatch.__all__ == sorted(llmbatch.__all__)
    public = {name for name in dir(llmbatch) if not name.startswith("_")}
    modules = {name for name in public if type(getattr(llmbatch, name)).__name__ == "module"}
    assert public - modules - {"annotations"} == set(llmbatch.__all__)


def test_the_names_for_type_checkers_are_the_public_names():
    # the lazy names (llmbatch._WHERE, hence __all__) and the imports a type checker reads must agree
    import ast
    from pathlib import Path

    tree = ast.parse(Path(llmbatch.__file__).read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test))
    imported = {(alias.name, node.module) for node in block.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported == set(llmbatch._WHERE.items())


def test_every_name_resolves():
    for name in llmbatch.__all__:
        assert getattr(llmbatch, name) is not None


def test_ray_names_exist():
    # the names Ray's ray.data.llm users import
    for name in ("vLLMEngineProcessorConfig", "build_llm_processor", "build_processor", "Processor",
                 "ChatTemplateStageConfig", "TokenizerStageConfig", "DetokenizeStageConfig",
                 "PrepareMultimodalStageConfig", "HttpRequestProcessorConfig", "SGLangEngineProcessorConfig",
                 "ServeDeploymentProcessorConfig", "HttpRequestStageConfig"):
        assert name in llmbatch.__all__
    assert llmbatch.build_llm_processor is llmbatch.build_processor


def test_import_is_light():
    # building configs must not pull in vllm or start ray
    import subprocess
    import sys

    code = ("import sys, llmbatch; llmbatch.vLLMEngineProcessorConfig(model_source='smollm2-135m-instruct');"
            "print('vllm' in sys.modules, 'ray' in sys.modules and __import__('ray').is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
    importlib.import_module("llmbatch.cli")


def test_a_corner_of_llmbatch_imports_alone():
    """The package's names load on first use: a process that needs one module (the engine's
    launcher, a Ray worker unpickling a stage) does not import Ray Data and the config layer."""
    import subprocess
    import sys

    # (the CLI's package too: its commands' imports come after the engine launcher's start, cli.main)
    code = ("import sys, llmbatch.startlog, llmbatch.engines.settings, llmbatch.cli;"
            "print(sorted(m for m in ('ray', 'ray.data', 'llmbatch.config', 'llmbatch.builders', 'pydantic',"
            " 'pyarrow', 'llmbatch.cli.jobs') if m in sys.modules));"
            "print(llmbatch.vLLMEngineProcessorConfig.__name__, 'llmbatch.config' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["[]", "vLLMEngineProcessorConfig True"], out
    assert "run_job" in dir(llmbatch)
    try:
        llmbatch.no_such_name  # noqa: B018
    except AttributeError as exc:
        assert "no_such_name" in str(exc)
    else:
        raise AssertionError("llmbatch.no_such_name resolved")


def test_build_processor_has_rays_signature():
    """``build_processor`` is Ray 2.60's, parameter for parameter: the job layer's knobs
    (which private keys the output keeps, rows left encoded) are its output stage, passed to
    ``builders.build_layout``."""
    import inspect

    from ray.data import llm as ray_llm

    def shape(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert shape(llmbatch.build_processor) == shape(ray_llm.build_processor)
