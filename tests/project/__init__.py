"""Tests of the whole product: its shape, sizes, docs, install, samples, batteries."""
