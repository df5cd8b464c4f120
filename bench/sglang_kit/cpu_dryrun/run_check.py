"""Dry run of industry_check.py on a CPU, with the stand-in sglang of this folder on PYTHONPATH:
Ray gets a logical GPU so the processor's GPU check passes; the "engine" answers at once.

    PYTHONPATH=bench/sglang_kit/cpu_dryrun:src python bench/sglang_kit/cpu_dryrun/run_check.py \\
        --model ~/.cache/llmbatch/models/smollm2-135m-instruct --rows 600 --out /tmp/dry/flow --batch-size 64
"""
import runpy
import sys
from pathlib import Path

import ray

ray.init(num_gpus=1, num_cpus=4, include_dashboard=False, logging_level="ERROR")
sys.argv = ["industry_check.py"] + sys.argv[1:]
runpy.run_path(str(Path(__file__).resolve().parents[1] / "industry_check.py"), run_name="__main__")
