"""The thread count ranks run with: one intra-op thread each when several share a node, unless the user chose.

torchrun sets ``OMP_NUM_THREADS=1`` for the same reason (:func:`torchpass.rank_env.thread_default`): G ranks with a
pool as large as the node each run G x cores threads. Checked end to end here: what torch in each rank of a
local job (forked from the zygote, or a fresh interpreter) reports.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpass.rank_env import thread_default

# Each rank writes what it runs with, then waits for the other's file: a rank that exits first ends the job, and
# the other must have written by then.
SCRIPT = """\
import os, pathlib, sys, time, torch
out = pathlib.Path(sys.argv[1])
said = f"rank threads {torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}"
(out / os.environ["TORCHPASS_WORKER_ID"]).write_text(said)
deadline = time.monotonic() + 60
while len(list(out.iterdir())) < 2 and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def test_several_ranks_get_one_thread_unless_the_user_set_a_count() -> None:
    assert thread_default({}, 2) == {"OMP_NUM_THREADS": "1"}
    assert thread_default({"OMP_NUM_THREADS": " "}, 8) == {"OMP_NUM_THREADS": "1"}
    assert thread_default({"OMP_NUM_THREADS": "4"}, 8) == {}  # the user's choice is kept
    assert thread_default({}, 1) == {}  # one rank: torch's own default (the whole node)


@pytest.mark.parametrize(("zygote", "user_threads"), [(True, ""), (False, "2")])
def test_each_rank_of_a_local_job_runs_with_that_thread_count(tmp_path: Path, zygote: bool, user_threads: str) -> None:
    script = tmp_path / "threads.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if user_threads:
        env["OMP_NUM_THREADS"] = user_threads
    argv = [sys.executable, "-m", "torchpass", "run", "--local", "--nproc", "2", "--spares", "0"]
    out = tmp_path / "said"
    out.mkdir()
    argv += ["--set", f"zygote={'true' if zygote else 'false'}", str(script), str(out)]
    # The script never joins the job: the launcher says every process exited; what the ranks wrote is what counts.
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    said = [path.read_text() for path in sorted(out.iterdir())]
    expected = f"rank threads {user_threads or 1} OMP_NUM_THREADS={user_threads or 1}"
    # both ranks (and the spare the launcher may start once they have exited) said the same
    assert len(said) >= 2 and set(said) == {expected}, f"{said}\n{proc.stdout}{proc.stderr}"
