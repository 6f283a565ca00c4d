"""How pytest-xdist shares the suite out (tests/conftest.py asks ``make_scheduler``): under
``--dist loadfile`` the files that start ranks form one scope, so one worker runs them one after
another while the other runs the single-process files. Two multi-rank jobs at once (4 + 4
processes on the CI machine's 2 cores) ran each 2-3x slower than alone
(``tests/parallel/test_device_rules_layouts.py``'s 4-rank case: 36 s alone, 108 s in the suite):
ranks waiting in a collective for a peer that is not scheduled waste the cores. pytest-xdist's
``--dist loadgroup`` would say the same with marks, but 3.8 writes its group into
``Item._nodeid``, which pytest 9 no longer reads.

A module of its own, not the conftest: tests import it (``import conftest`` finds whichever
conftest pytest registered under that name first).
"""
from __future__ import annotations

import functools
import os

# What a test file calls to start ranks (processes of a torch.distributed job: spawned ranks,
# torchrun, a measured multi-rank run). Read from the file's text, so that a new file that calls
# one is grouped without being listed.
_RANK_STARTERS = ("run_ranks", "run_named_layouts", "torchrun_train", "ranks_train", "fault_helpers", "_runs import",
                  "import _runs", "torch.distributed.run")


# Files with a few multi-rank tests among many single-process ones stay in the common pool: they
# balance the two workers (a development run with them in the group: the group's files took
# 859 s summed, the rest 661 s; the suite's wall time is the longer of the two).
_IN_THE_POOL = ("tests/test_export_cmd.py", "tests/test_recipes_train.py")


@functools.cache
def starts_ranks(path: str) -> bool:
    """Whether the test file at ``path`` starts ranks (``_RANK_STARTERS``) and runs with the
    others that do (not ``_IN_THE_POOL``)."""
    if path.replace(os.sep, "/").endswith(_IN_THE_POOL):
        return False
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        return False
    return any(s in text for s in _RANK_STARTERS)


def make_scheduler(config, log):
    """pytest-xdist's file scheduling with the rank files in one scope; None (xdist's own)
    under another ``--dist``."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    root = str(config.rootpath)

    class _RanksTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, root)

    return _RanksTogether(config, log)


def scope_of(nodeid: str, root: str) -> str:
    """The scope a test runs in under ``pytest_xdist_make_scheduler``: its file, or one scope
    for all the files that start ranks."""
    path = nodeid.split("::", 1)[0]
    return "the files that start ranks" if starts_ranks(os.path.join(root, path)) else path
