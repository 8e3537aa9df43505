"""The benchmark behind benchmarks/results/BENCHMARKS.md, run from a checkout with ``make bench``.

It runs the examples of this repository (examples/), so it is not part of the installed
package: a product of its own beside the library. It imports :mod:`hvd_gradcomp` and nothing of
``tests/``; it writes its pages, raw figures (``data/``) and plots (``img/``) under
``benchmarks/results/``, and its tests are ``benchmarks/tests/``. One module per concern, in the
order a run goes:

- :mod:`benchmarks.plan`: the settings compared, targets, the plan and each job's command line;
- :mod:`benchmarks.netns`: rate-limited network namespaces (``ip netns`` + ``tc tbf``);
- :mod:`benchmarks.two_hosts`: the two hosts of ``scripts/two_hosts.sh`` (``--two-hosts``);
- :mod:`benchmarks.runner`: runs the jobs (:mod:`hvd_gradcomp.launchers.jobs`) and collects their JSON;
- :mod:`benchmarks.tables`: tables and targets from the raw figures;
- :mod:`benchmarks.plots`: the PNG plots;
- :mod:`benchmarks.markdown`: the page, from the run's data only;
- :mod:`benchmarks.cli`: the command line (``python -m benchmarks --help``).

The ``bench_*.py`` scripts beside them are micro-benchmarks of single pieces;
:mod:`benchmarks.study` is the convergence study behind benchmarks/results/STUDY.md (``make study``).
"""
