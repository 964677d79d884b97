"""Wiola's benchmark suite (pytest-benchmark): the frame (``bench.frame``, fixtures in
``bench/conftest.py``), the roofline counts (``bench.roofline``) and the report (``bench.report``)."""
