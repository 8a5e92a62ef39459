"""A run's numbers as data: the records a capture accumulates, the report tables, its
metadata, and the one writer.
"""
