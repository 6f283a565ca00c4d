"""The suite's own schedule (tests/suite_schedule.py): under ``-n 2 --dist loadfile`` the files that
start ranks form one scope (one worker runs them in turn), every other file its own."""
from __future__ import annotations

from pathlib import Path

import suite_schedule

TESTS = Path(__file__).parent


def test_files_that_start_ranks_are_found_from_their_text():
    assert suite_schedule.starts_ranks(str(TESTS / "parallel" / "test_device_rules_layouts.py"))
    assert suite_schedule.starts_ranks(str(TESTS / "parallel" / "test_cli_layouts.py"))
    assert suite_schedule.starts_ranks(str(TESTS / "runtime" / "test_faults.py"))
    assert not suite_schedule.starts_ranks(str(TESTS / "test_cli.py"))
    assert not suite_schedule.starts_ranks(str(TESTS / "test_export_cmd.py"))  # in the pool: balances the workers


def test_the_rank_files_share_one_scope_and_the_others_run_by_file():
    root = str(TESTS.parent)
    ranks = {suite_schedule.scope_of("tests/parallel/test_device_rules_layouts.py::test_x[2]", root),
             suite_schedule.scope_of("tests/runtime/test_faults.py::test_y", root)}
    assert len(ranks) == 1
    assert suite_schedule.scope_of("tests/test_cli.py::t", root) == "tests/test_cli.py"
    assert suite_schedule.scope_of("tests/test_export_cmd.py::t", root) == "tests/test_export_cmd.py"
