"""``python -m llmbatch`` runs the CLI."""

from llmbatch.cli import main

main()
