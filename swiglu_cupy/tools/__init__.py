"""Command-line tools: ``bench`` (benchmarks and the launch sweep),
``selftest`` (everything a lent GPU should run, in one command) and ``info``
(the environment). Built on everything else; run through ``python -m swiglu_cupy``."""
