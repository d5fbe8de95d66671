"""The short public names of the framework adapters, and the names of ``auto``'s modules.

The adapters live in :mod:`collectives.adapters` (the core library, the adapters and the
tools each have a folder of their own), but scripts import them by their short names:
``import collectives.torch``, ``import collectives.horovod.torch as hvd``. ``auto`` lives
in :mod:`collectives.auto`; ``collectives.tuning`` names that package (its public names)
and ``collectives.calibration`` its calibration. This finder answers those names with
the modules themselves (one module object under both names, so there is one copy of its
state), imported only when asked for.
"""

import importlib
import importlib.abc
import importlib.util
import sys

ALIASES = {
    "collectives.training": "collectives.adapters.training",
    "collectives.torch": "collectives.adapters.torch",
    "collectives.torch_backend": "collectives.adapters.torch_backend",
    "collectives.horovod": "collectives.adapters.horovod",
    "collectives.ps": "collectives.adapters.ps",
    "collectives.tuning": "collectives.auto",
    "collectives.calibration": "collectives.auto.calibration",
}


def target_of(name):
    """The module that ``name`` (a short name, or a module inside one) stands for, else None."""
    for alias, target in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            return target + name[len(alias):]
    return None


class _Loader(importlib.abc.Loader):
    def __init__(self, target):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)  # the adapter itself, not a copy

    def exec_module(self, module):
        pass  # already run by create_module's import


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        real = target_of(fullname)
        if real is None or importlib.util.find_spec(real) is None:
            return None
        return importlib.util.spec_from_loader(fullname, _Loader(real))


def install():
    """Answer the short names from now on (once per process)."""
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
