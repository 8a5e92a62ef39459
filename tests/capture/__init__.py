"""Tests of fpaudit/capture/: the audit of autograd and modules, autocast, compile."""
