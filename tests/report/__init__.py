"""Tests of fpaudit/report/: the report's tables, files, checks and metadata."""
