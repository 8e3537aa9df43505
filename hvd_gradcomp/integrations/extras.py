"""The one ImportError an integration raises when its framework is missing: it names the extra to install."""
from typing import Any


def require(module: str, extra: str, what: str) -> Any:
    """``import module``, or one ImportError that names ``pip install 'hvd-gradcomp[extra]'``.

    >>> require("no_such_framework_here", "lightning", "GradCompStrategy")
    Traceback (most recent call last):
    ...
    ImportError: GradCompStrategy needs no_such_framework_here: pip install 'hvd-gradcomp[lightning]'
    """
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        pass
    raise ImportError(f"{what} needs {module}: pip install 'hvd-gradcomp[{extra}]'")
