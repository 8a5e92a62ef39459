"""Tests of fpaudit/run/: running the user's code (scan, verify, run, fp16-plan, ranks)."""
