"""Tests of fpaudit/rules/: the pure functions over a report's tables."""
