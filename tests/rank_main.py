"""Entry point of one rank: ``rank_main.py module:function OUTDIR KWARGS_JSON`` (see harness.py)."""
import importlib
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    target, outdir, kwargs = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    import horovod.torch as hvd

    hvd.init()
    module, func = target.split(":")
    fn = getattr(importlib.import_module(f"tests.workers.{module}"), func)
    try:
        result = fn(**kwargs)
    except BaseException:
        print(f"[rank {hvd.rank()}] FAILED in {target}", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        # Exit non-zero at once: horovodrun/mpirun then stop the other ranks instead of
        # letting them wait forever in a collective.
        import os
        os._exit(1)
    (outdir / f"rank{hvd.rank()}.json").write_text(json.dumps(result))
    hvd.shutdown()


if __name__ == "__main__":
    main()
