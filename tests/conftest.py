"""Session-wide test set-up: an isolated cache folder, tiny in-memory models, the default engine.

FLASHSPEC_CACHE_DIR holds converted default-model weights and router state. Unless the caller
set it (CI points it at a persistent folder so the ~20 s conversion happens once), tests use a
fresh session folder, so they never read or write a user's real cache.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # `import helpers` from any test folder

from helpers import one_thread, tiny_llama, tiny_loaded

from flashspec_core.models import CACHE_ENV


def pytest_configure(config: pytest.Config) -> None:
    """An xdist worker takes its share of the cores for torch (one each for two workers on two
    cores): threads beyond the cores stall torch's parallel regions and skew the timings that
    calibration tests compare."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


@pytest.fixture(scope="session", autouse=True)
def flashspec_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """$FLASHSPEC_CACHE_DIR if set, else a session temporary folder (exported for the session).

    Under pytest-xdist each worker gets a folder of its own (calibration and router state are
    per worker, as tests that damage or count them expect), whose models/ is one folder shared by
    all workers: the default model is converted once, by whichever worker needs it first (the
    conversion writes a temporary folder and renames it, so two at once are harmless).
    """
    given = os.environ.get(CACHE_ENV)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if given and not worker:
        yield Path(given)
        return
    path = tmp_path_factory.mktemp("flashspec-cache")
    if worker:
        shared = Path(given) if given else tmp_path_factory.getbasetemp().parent / "flashspec-cache"
        (shared / "models").mkdir(parents=True, exist_ok=True)
        (path / "models").symlink_to(shared / "models", target_is_directory=True)
    os.environ[CACHE_ENV] = str(path)
    try:
        yield path
    finally:
        if given:
            os.environ[CACHE_ENV] = given
        else:
            os.environ.pop(CACHE_ENV, None)


@pytest.fixture
def torch_one_thread():
    """Tiny models are dominated by per-op overhead; one thread avoids contention on busy cores."""
    with one_thread():
        yield


@pytest.fixture(scope="session")
def tiny_target():
    """A tiny random target (vocab 16, eos = token 15) with its in-memory tokenizer."""
    return tiny_loaded(16, seed=0)


@pytest.fixture(scope="session")
def tiny_draft_model():
    """Another tiny random model with the target's vocabulary, so a model draft's q is non-trivial."""
    return tiny_llama(16, seed=1)


@pytest.fixture(scope="session")
def default_target(flashspec_cache_dir):
    """The embedded default model (SmolLM2-135M-Instruct, fp32 CPU), loaded once per session."""
    from flashspec_core.loading import load_target

    return load_target(None)  # the same cached object `from_default` uses


@pytest.fixture(scope="session")
def default_engine(flashspec_cache_dir):
    """`SpecEngine.from_default()`, loaded once per session (it is a per-process singleton)."""
    from flashspec_core.engine import SpecEngine

    return SpecEngine.from_default()



# Under pytest-xdist (pyproject's addopts): the modules and packages that take longest on a 2-core
# CPU, longest first, so that no worker starts a long one last.
LONGEST_FIRST = (
    "tests/integrations/serve/",
    "tests/core/test_engine_joint.py",
    "tests/core/test_greedy_default.py",
    "tests/core/constrained/test_tool_tags_default.py",
    "tests/core/constrained/test_constrained_exactness.py",
    "tests/core/test_exactness.py",
    "tests/core/backends/test_llama_cpp.py",
    "tests/core/backends/test_calibration.py",
    "tests/core/verify/test_triton.py",
    "tests/integrations/langchain/test_langchain_standard.py",
    "tests/core/constrained/test_constrained_default.py",
    "tests/core/backends/test_blockq.py",
    "tests/core/test_greedy_q4_k_m.py",
    "tests/core/drafts/test_trained.py",
)
SERVE = "tests/integrations/serve/"


def _group(nodeid: str) -> str:
    """A test's unit of work under xdist: its module, or the serve package for a serve test (one
    Ray instance and deployment for the package)."""
    path = nodeid.split("::", 1)[0]
    return SERVE if path.startswith(SERVE) else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Each group runs whole on one worker, so module and package fixtures are built once; groups
    go to the workers in collection order as they free up."""
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return GroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker, the longest groups first (the controller queues groups in the order the
    workers collected them)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return

    def rank(item: pytest.Item) -> int:
        group = _group(item.nodeid)
        return next((i for i, g in enumerate(LONGEST_FIRST) if group.startswith(g)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the collection order within each rank
