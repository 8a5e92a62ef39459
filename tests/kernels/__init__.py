"""Tests of fpaudit/kernels/: tensors to exact counts (C++, Triton, block statistics)."""
