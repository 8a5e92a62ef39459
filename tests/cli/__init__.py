"""Tests of fpaudit/cli/: the command line, its options, config, rendering, CI, plots."""
