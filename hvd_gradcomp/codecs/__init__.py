"""The codecs: what a compressor sends and by which collective.

* :mod:`~hvd_gradcomp.codecs.registry`: the registry of compressors by name (:func:`register`,
  :func:`build`, entry points) and the collective and nature each class declares; plain Python, no
  torch (:mod:`hvd_gradcomp.config` and the launcher read it). Its names are importable from here;
* :mod:`~hvd_gradcomp.codecs.interface`: the interface a codec implements (``pack``/``unpack``, ``Encoded``);
* :mod:`~hvd_gradcomp.codecs.compressor`: ``GradientCompressor``, the feedback policy around a codec, built
  from :mod:`~hvd_gradcomp.codecs.exempt`, :mod:`~hvd_gradcomp.codecs.binding` and
  :mod:`~hvd_gradcomp.codecs.steps`;
* :mod:`~hvd_gradcomp.codecs.qsgd`, :mod:`~hvd_gradcomp.codecs.topk`, :mod:`~hvd_gradcomp.codecs.powersgd`:
  the built-in codecs.
"""
from .registry import (ALLGATHER, COMPRESSED_ALLREDUCE, ALLREDUCE_ROUNDS, SPARSE_ALLREDUCE, COLLECTIVES, SPARSE, DENSE, LOW_RANK, NATURES,
                       NATURE_OF_COLLECTIVE, SETTINGS, Factory, ENTRY_POINTS, register, load_module, unregister, names,
                       lookup, accepted_settings, signature_settings, build, collective_of, nature_of, name_of)

__all__ = ["ALLGATHER", "COMPRESSED_ALLREDUCE", "ALLREDUCE_ROUNDS", "SPARSE_ALLREDUCE", "COLLECTIVES", "SPARSE", "DENSE", "LOW_RANK",
           "NATURES", "NATURE_OF_COLLECTIVE", "SETTINGS", "Factory", "ENTRY_POINTS", "register", "load_module",
           "unregister", "names", "lookup", "accepted_settings", "signature_settings", "build", "collective_of",
           "nature_of", "name_of"]
