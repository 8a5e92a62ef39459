"""Number formats and block-scaled recipes, and where a value lands in each: no autograd,
no I/O.
"""
