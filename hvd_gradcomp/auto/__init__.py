"""``gc.Auto()``: pick, per tensor and while training runs, the road that costs least (how it
explores, probes, decides and verifies: :mod:`hvd_gradcomp.auto.auto`).

* :mod:`~hvd_gradcomp.auto.auto`: :class:`Auto`, its settings, stock Horovod's protocol, and
  :class:`AutoExchange`, the exchange of hvd_gradcomp's optimizer; Auto wires its parts:
* :mod:`~hvd_gradcomp.auto.schedule`: the steps and the road each takes (``Schedule``);
* :mod:`~hvd_gradcomp.auto.measure`: codec costs, step times, the link's probe (``Measurements``,
  ``StepClock``, ``LinkProbe``);
* :mod:`~hvd_gradcomp.auto.decide`: the decisions and their verdicts (``Decider``);
* :mod:`~hvd_gradcomp.auto.residuals`: the compressed roads' compressors and the residuals handed
  across roads (``CompressedRoads``);
* :mod:`~hvd_gradcomp.auto.state`: the report and checkpoints, functions of the parts;
* :mod:`~hvd_gradcomp.auto.policy`: the roads' bytes and time model, pure functions.
"""
from .auto import Auto, AutoExchange, HorovodComm
from .measure import PILOT_NUMEL, PROBE_SECONDS, SAMPLES
from .schedule import OURS_ROADS, STOCK_ROADS

__all__ = ["Auto", "AutoExchange", "HorovodComm", "OURS_ROADS", "STOCK_ROADS", "SAMPLES", "PROBE_SECONDS",
           "PILOT_NUMEL"]
