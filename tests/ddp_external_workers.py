"""Rank side of the DDP half of tests/test_external_codec.py, under torchrun (the runner of
tests/ddp_workers.py, with these scenarios): a compressor written outside the package
(tests/workers/external.py's CODECS) through ``hvd_gradcomp.ddp.register``."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import ddp_workers  # noqa: E402
from tests.workers import external  # noqa: E402


def external_ddp(codec: str = "randomk") -> Dict[str, Any]:
    return external.run(ddp_workers.register_wrapped, ddp_workers.mean_over_ranks, dist.get_rank(), codec=codec,
                        comm_bytes=lambda state, name: state.comm_stats.per_tensor[name][1],
                        save=ddp_workers.save_state, load=ddp_workers.load_state)


SCENARIOS = {"external_ddp": external_ddp}

if __name__ == "__main__":
    ddp_workers.main(SCENARIOS)
