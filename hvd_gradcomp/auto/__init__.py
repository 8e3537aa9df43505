"""``gc.Auto()``: pick, per tensor and while training runs, the road that costs least (how it
explores, probes, decides and verifies: :mod:`hvd_gradcomp.auto.auto`).

* :mod:`~hvd_gradcomp.auto.auto`: :class:`Auto`, its settings, error feedback across roads, stock
  Horovod's protocol, and :class:`AutoExchange`, the exchange of hvd_gradcomp's optimizer;
* :mod:`~hvd_gradcomp.auto.policy`: the roads' bytes and time model, pure functions;
* :mod:`~hvd_gradcomp.auto.schedule`, :mod:`~hvd_gradcomp.auto.measure`, :mod:`~hvd_gradcomp.auto.state`:
  Auto's mixins: the steps and the road each takes; measurements, the link's probe, decisions; the
  report and checkpoints.
"""
from .auto import Auto, AutoExchange, HorovodComm
from .measure import PILOT_NUMEL, PROBE_SECONDS, SAMPLES
from .schedule import OURS_ROADS, STOCK_ROADS

__all__ = ["Auto", "AutoExchange", "HorovodComm", "OURS_ROADS", "STOCK_ROADS", "SAMPLES", "PROBE_SECONDS",
           "PILOT_NUMEL"]
