"""Research sweeps and one-off comparisons behind the numbers in ``loadtests/results/``: run from a
checkout (``python -m paraseek.loadtests.research.NAME``); the wheel leaves them out."""
