"""Not the kvstore package: the root of a checkout of its sources (the package is kvstore/).

Python imports this file only when it finds the checkout's folder under the name
``kvstore`` before the installed package: run from the folder that holds a clone
named ``kvstore`` (``python example.py``, ``python -m kvstore``), the current
directory comes first on ``sys.path``. Without this file that folder would be an
empty namespace package, and ``from kvstore import Store`` would fail with
"cannot import name 'Store' from 'kvstore' (unknown location)"; with it, the error
says what happened and what to do. Imported under any other name (a test runner
collecting the checkout), it does nothing.
"""

if __name__ == "kvstore":
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    raise ImportError(
        f"'import kvstore' found {_here}, a checkout of kvstore's sources, instead of the "
        f"installed package, because {_os.path.dirname(_here)} (the current directory, or "
        "the script's) comes first on sys.path. Run Python from another directory (or from "
        f"inside {_here}), or start it with 'python -P' (Python 3.11+), which leaves that "
        "directory off sys.path."
    )
