# megamoe must be imported before triton: on a machine without CUDA it switches Triton to its interpreter.
import megamoe  # noqa: F401

# isort: split
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import rank_fns by name


@pytest.fixture
def no_leftovers():
    """After the test: no child process of this one is left, and no shm file of a dead creator is still linked
    (files of live creators, e.g. another test run's ranks mid-set-up, are in use and not counted)."""
    import rank_fns

    before = set(rank_fns.leaked_shm_files())
    yield
    assert mp.active_children() == []
    assert sorted(set(rank_fns.leaked_shm_files()) - before) == []
