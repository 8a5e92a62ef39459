"""Tests of fpaudit/numerics/: formats, recipes, the bin layout."""
