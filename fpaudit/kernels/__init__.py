"""Tensors to exact counts: the histogram, the block statistics, and the compiled kernels
that count them.
"""
