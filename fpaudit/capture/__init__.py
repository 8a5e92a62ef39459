"""Autograd and modules: the audit, the dispatch mode, the origin probe, and the patches of
fpaudit run.
"""
