"""``python -m benchmarks`` (what ``make bench`` runs): see :mod:`benchmarks.cli`."""
from benchmarks.cli import main

main()
