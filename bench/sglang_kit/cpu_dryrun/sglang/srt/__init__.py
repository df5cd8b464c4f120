"""Stand-in for sglang.srt (CPU dry run only)."""
