"""How payloads travel between ranks (layer *collectives*, docs/ARCHITECTURE.md).

* :mod:`~hvd_gradcomp.collectives.reduce`: decoding every rank's payloads in rank order and summing
  them, bit-identical on every rank; no Horovod, no ``torch.distributed``;
* :mod:`~hvd_gradcomp.collectives.rounds`: exchange algorithms written once, as generators that yield
  the collectives they need (PowerSGD's two rounds, QSGD's compressed allreduce);
* :mod:`~hvd_gradcomp.collectives.transport`: one interface for a collective, on Horovod and on
  ``torch.distributed``;
* :mod:`~hvd_gradcomp.collectives.inflight`, :mod:`~hvd_gradcomp.collectives.exchange`,
  :mod:`~hvd_gradcomp.collectives.fused`: Horovod's drivers, one per declared collective, and what they
  share (the tensor in flight, envelopes, step checks, the fused allgather).

The DDP hook's drivers are :mod:`hvd_gradcomp.ddp.exchanges`.
"""
