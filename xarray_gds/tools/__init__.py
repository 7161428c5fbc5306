"""Tools built on the engine: the ``xarray-gds`` command line (:mod:`.cli`), its demo
(:mod:`.demo`), the benchmarks (:mod:`.bench`, :mod:`.bench_cluster`,
:mod:`.bench_refs`), the cost model's calibration (:mod:`.calibrate`) and the loopback
S3 server the remote benchmarks read from (:mod:`.s3_server`).

The core (every module of :mod:`xarray_gds` outside this package) never imports these:
``tests/test_layout.py`` checks it.
"""
