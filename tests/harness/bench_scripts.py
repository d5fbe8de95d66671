"""The checkout's bench/ scripts as modules, for the tests that run them in-process.

make's own benchmark tools (the GPU targets' bench/gpu_*.py) live in bench/, outside the
package: a test loads one by its path, under a name of its own, once.
"""
import importlib.util
import sys
from pathlib import Path


def bench_folder():
    """bench/ of the checkout these tests belong to (the folder above that holds setup.py)."""
    here = Path(__file__).resolve()
    for folder in here.parents:
        if (folder / "setup.py").is_file() and (folder / "bench").is_dir():
            return folder / "bench"
    raise FileNotFoundError(f"no checkout with bench/ above {here}")


def load(name):
    """The module of bench/<name>.py (loaded once, as ``bench_<name>``)."""
    module_name = f"bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, bench_folder() / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
