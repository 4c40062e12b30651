"""A user's functions named in a spec: ``module:function`` or ``path/to/file.py:function``.

Two fields name one: ``data.rewardFn`` and a custom workflow node's
``function``. The pre-flight check imports both, so a typo fails before any
worker starts; the workers import them again (cached per process) to call
them. When a call raises, ``distflow.errors.UserFunctionError`` says which function, on
what input, at which step: the user's traceback alone names none of these.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any, Callable

MAX_NAMES_SHOWN = 20
"""Names a 'no such function' message lists of a module before it says how many more there are."""


def _import_module(module_name: str, ref: str, what: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ValueError(f"{what} {ref!r}: file {module_name!r} not found")
        file_spec = importlib.util.spec_from_file_location(f"distflow_user_{path.stem}", path)
        module = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(module)
        except Exception as exc:  # noqa: BLE001 - any error of the user's file is reported the same way
            raise ValueError(f"{what} {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; "
                             "fix the file") from exc
        return module
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"{what} {ref!r}: cannot import module {module_name!r} ({exc}); "
            f"put it on PYTHONPATH or give a file as 'path/to/file.py:function'"
        ) from exc
    except Exception as exc:  # noqa: BLE001 - the module imports but its top level raises
        raise ValueError(f"{what} {ref!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}; "
                         "fix the module") from exc


@functools.lru_cache(maxsize=32)
def load_user_function(ref: str, what: str, arguments: tuple[str, ...] = ()) -> Callable:
    """The callable ``ref`` names (``module:function`` or ``path/to/file.py:function``).

    Args:
        what: what the function is for, opening every message (``reward``, ``workflow node 'x'``).
        arguments: the names of the positional arguments distflow calls it with; checked against
            its signature where it has one (a builtin may not).

    Raises:
        ValueError: ``ref`` is not ``module:function``, the module cannot be imported (or raises
            when imported), it has no such attribute, the attribute is not callable, or it cannot
            be called with ``arguments``.
    """
    module_name, sep, fn_name = ref.rpartition(":")
    if not sep or not module_name or not fn_name:
        raise ValueError(f"{what} {ref!r}: expected module:function (or path/to/file.py:function)")
    module = _import_module(module_name, ref, what)
    if not hasattr(module, fn_name):
        public = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
        shown = public if len(public) <= MAX_NAMES_SHOWN else public[:MAX_NAMES_SHOWN] + [
            f"... {len(public) - MAX_NAMES_SHOWN} more"]
        raise ValueError(f"{what} {ref!r}: module {module_name!r} has no function {fn_name!r}; it has {shown}")
    fn = getattr(module, fn_name)
    if not callable(fn):
        raise ValueError(f"{what} {ref!r}: {module_name}.{fn_name} is a {type(fn).__name__}, not a function")
    if arguments:
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
            return fn
        try:
            signature.bind(*arguments)
        except TypeError as err:
            raise ValueError(f"{what} {ref!r}: {module_name}.{fn_name}{signature} cannot be called as "
                             f"{fn_name}({', '.join(arguments)}) ({err}); give it that signature") from None
    return fn
