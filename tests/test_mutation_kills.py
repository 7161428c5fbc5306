"""Tests written for mutants that survived ``scripts/mutation-run.py`` (Cosmic Ray's
mutants of the read and write modules, sampled without a person choosing them): each
test names the module and the mutation it stops, and compares with what zarr-python
(``engine="zarr"``) reads or writes wherever the engine's output is at stake."""

from __future__ import annotations
