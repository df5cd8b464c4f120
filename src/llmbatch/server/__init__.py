"""``llmbatch serve``: OpenAI's Batch API (files and batches) on your own GPUs.

A batch is an llmbatch job (exactly once, resumable) run in a process of its own on the Ray
cluster ``RAY_ADDRESS`` names; metadata lives in a database (SQLite by default, migrated with
Alembic), file contents on local disk or any fsspec location. See ``server.app`` for the
routes and ``server.runner`` for how batches queue, run, stop and resume.
"""
