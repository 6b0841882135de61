# megamoe must be imported before triton: on a machine without CUDA it switches Triton to its interpreter.
import megamoe  # noqa: F401
import megamoe.symm  # noqa: F401

# isort: split
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import rank_fns by name

# `make test` runs this suite on pytest-xdist workers with ``--dist loadgroup``. The tests marked
# ``xdist_group("shm")`` (tests/test_symm.py, tests/test_launch.py) all run on one worker, one after another,
# because they are not safe beside each other: they kill ranks on purpose mid-set-up (leaving shm files that a
# sweep beside them would remove before the test looks) and sweep stale files themselves (``sweep_stale_shm``, also
# with ``min_age_s=0``, and asserting exactly what it removed).
# Other tests make shm files too, and a rank's file can outlive its creator for a moment (until its launcher
# unlinks it): ``no_leftovers`` therefore counts only files of processes its own test started, and the test that
# sweeps with ``min_age_s=0`` (which would take such a file) is marked ``alone``. The tests marked ``alone`` (that,
# and bounds on elapsed time) are left out of the parallel run and run afterwards, serially (see the Makefile).


@pytest.fixture
def no_leftovers(monkeypatch):
    """After the test: no child process of this one is left, and no shm file is still linked whose creator is a
    process that this test started (a ``launch`` rank or a torchrun-style subprocess) and that is dead. Files of
    live creators are in use; files of creators this test did not start (another xdist worker's or another test
    run's ranks on the same machine, which may be dead for a moment before their own launcher removes them) are
    not this test's and not counted."""
    import subprocess

    import rank_fns

    started: set[int] = set()
    real_start, real_popen_init = mp.process.BaseProcess.start, subprocess.Popen.__init__

    def start(self):
        real_start(self)
        started.add(self.pid)

    def popen_init(self, *args, **kwargs):
        real_popen_init(self, *args, **kwargs)
        started.add(self.pid)

    monkeypatch.setattr(mp.process.BaseProcess, "start", start)
    monkeypatch.setattr(subprocess.Popen, "__init__", popen_init)
    yield
    assert mp.active_children() == []
    assert [p for p in rank_fns.leaked_shm_files() if megamoe.symm._shm_creator_pid(p) in started] == []
