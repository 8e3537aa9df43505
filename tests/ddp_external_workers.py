"""Rank side of the DDP half of tests/test_external_codec.py, under torchrun (the runner of
tests/ddp_workers.py, with these scenarios): the compressor of tests/external_randomk.py through
``hvd_gradcomp.ddp.register``."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Dict

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import ddp_workers  # noqa: E402
from tests.workers import external  # noqa: E402


def randomk_ddp() -> Dict[str, Any]:
    return external.run(ddp_workers.register_wrapped, ddp_workers.mean_over_ranks, dist.get_rank(),
                        comm_bytes=lambda state, name: state.comm_stats.per_tensor[name][1],
                        save=ddp_workers.save_state, load=ddp_workers.load_state)


SCENARIOS = {"randomk_ddp": randomk_ddp}

if __name__ == "__main__":
    ddp_workers.main(SCENARIOS)
