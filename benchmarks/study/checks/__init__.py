"""The checks: investigations whose training is their own (a model, loop or launcher the study's
workers do not have), each run by ``study.py --config NAME`` (:mod:`benchmarks.study.configs`).

Each module has ``train(**job)``, called on every rank of a 2-rank job by
``benchmarks/study/check_worker.py``, which returns its record (or list of records) for rank 0 to
keep; the page is rendered from those records (:mod:`benchmarks.study.pages`).

* :mod:`.wrapper`: one compressor through every road, each driven as a user drives it;
* :mod:`.outside`: the README's TopKQSGD(1%, 8) on a task nothing was tuned on, both wrappers;
* :mod:`.small_mlp`: small MLPs whose gradients keep shrinking, and a digits MLP;
* :mod:`.freeze`: Adam and AdamW around the freeze of their second moment, on a quirky model.
"""
