"""The order ``make test`` starts test files in (tests/conftest.py sorts the collected tests).

The longest test files (minutes each on a 2-core machine) go first: ``make test`` runs two files
at a time (pytest-xdist, one file per worker), and a long file started last would leave one
worker running it alone at the end.
"""

LONGEST_FIRST = ("tests/e2e/test_plan_shapes.py", "tests/e2e/test_examples.py", "tests/e2e/test_openai_server.py",
                 "tests/e2e/test_tasks.py", "tests/e2e/test_jobs.py", "tests/e2e/test_processor_vllm.py",
                 "tests/e2e/test_serve.py", "tests/e2e/test_errors.py")
