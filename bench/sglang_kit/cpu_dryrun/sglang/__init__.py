"""A stand-in for sglang, to dry-run the kit's scripts on a CPU (never installed; only put on
PYTHONPATH by hand): an Engine whose "scheduler" and "detokenizer" are real sleeping processes
named like SGLang's (so killing one is a dead engine), answering a constrained request with one
of its regex's alternatives and others with max_new_tokens words. FAKE_DELAY: seconds per answer."""
import asyncio
import os
import re
import subprocess
import sys
import types

import llmbatch.engines.sglang as _m

_m.require_gpu = lambda: None  # this stand-in needs no GPU
__version__ = "0.0-fake"


class Engine:
    def __init__(self, model_path, **kw):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(model_path)
        self.sched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "sglang::scheduler_TP0"])
        self.detok = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)", "sglang::detokenizer"])
        self.tokenizer_manager = types.SimpleNamespace(context_len=kw.get("context_length", 2048), asyncio_tasks=set(),
                                                       abort_request=lambda rid: None, _subprocess_watchdog=None)
        self.server_args = types.SimpleNamespace(max_running_requests=kw.get("max_running_requests"))

    def shutdown(self):  # as SGLang's: the engine's processes go
        for proc in (self.sched, self.detok):
            proc.kill()
            proc.wait()

    def get_all_child_pids(self):
        return [self.sched.pid, self.detok.pid]

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, rid=None, **kw):
        await asyncio.sleep(float(os.environ.get("FAKE_DELAY", "0.05")))
        if self.sched.poll() is not None:
            await asyncio.Event().wait()
        sp = sampling_params or {}
        if sp.get("regex"):
            alts = [re.sub(r"\\(.)", r"\1", a) for a in re.split(r"(?<!\\)\|", sp["regex"][1:-1])]
            text = alts[sum(input_ids or [0]) % len(alts)]
            reason = {"type": "stop", "matched": 2}
        else:
            text = "word " * sp.get("max_new_tokens", 16)
            reason = {"type": "length", "length": sp.get("max_new_tokens", 16)}
        ids = self.tok.encode(text, add_special_tokens=False)
        return {"text": text, "output_ids": ids, "meta_info": {"finish_reason": reason, "prompt_tokens": len(input_ids or []),
                "completion_tokens": len(ids), "cached_tokens": 0}}

    def generate(self, prompt=None, sampling_params=None, **kw):
        loop = asyncio.new_event_loop()
        return [loop.run_until_complete(self.async_generate(p, s, input_ids=self.tok.encode(p))) for p, s in zip(prompt, sampling_params)]
