"""Byte I/O under the stores and the read engine: :mod:`.local` reads and writes local
files."""
