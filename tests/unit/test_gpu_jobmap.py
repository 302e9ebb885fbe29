"""dcgm-exporter's job mapping files: the GPU list from the Prolog's environment, the file format dcgm-exporter
reads (one file per GPU index, job IDs one per line), concurrent hooks keeping each other's lines, and the
runner wiring (off without ``[hooks] gpu_job_map_dir``, never failing a hook)."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Iterator
from pathlib import Path

import pytest

from slurm_hooks import runner
from slurm_hooks.context import from_env
from slurm_hooks.gpu_jobmap import LOCK_NAME, add_job, jobs_on, parse_gpu_indices, remove_job


@pytest.fixture(autouse=True)
def _restore_clockwork_logger() -> Iterator[None]:
    """runner.main configures the ``clockwork`` logger; put it back (and close its files) afterwards."""
    logger = logging.getLogger("clockwork")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield
    for handler in list(logger.handlers):
        if handler not in saved[0]:
            logger.removeHandler(handler)
            handler.close()
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]


# ----- the GPU indices --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "want"),
    [
        ({"SLURM_JOB_GPUS": "0,2-3", "CUDA_VISIBLE_DEVICES": "7"}, (0, 2, 3)),
        ({"CUDA_VISIBLE_DEVICES": "1,5"}, (1, 5)),
        ({"SLURM_JOB_GPUS": "", "CUDA_VISIBLE_DEVICES": "4"}, (4,)),
        ({"CUDA_VISIBLE_DEVICES": "GPU-8a1c2d3e,2"}, (2,)),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ()),
        ({}, ()),
    ],
)
def test_parse_gpu_indices(env: dict[str, str], want: tuple[int, ...]) -> None:
    assert parse_gpu_indices(env) == want


def test_context_carries_the_gpus_on_a_node_only() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_GPUS": "1,3", "SLURMD_NODENAME": "n1"}
    assert from_env("prolog_slurmd", env).gpus == (1, 3)
    assert from_env("prolog_slurmctld", env).gpus == ()


# ----- the files ----------------------------------------------------------------------------------


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_files_are_named_by_index_with_one_job_per_line(tmp_path: Path) -> None:
    folder = tmp_path / "map"
    add_job(folder, 101, (0, 2))
    add_job(folder, 102, (2,))
    add_job(folder, 101, (0, 2))  # a Prolog run again: no duplicate line
    assert (folder / "0").read_text() == "101\n"
    assert (folder / "2").read_text() == "101\n102\n"
    assert (folder / "0").stat().st_mode & 0o777 == 0o644  # dcgm-exporter need not run as root
    assert _entries(folder) == {"0", "2", LOCK_NAME}  # nothing else dcgm-exporter could read as a GPU

    assert [p.name for p in remove_job(folder, 101)] == ["0", "2"]
    assert (folder / "2").read_text() == "102\n"
    assert not (folder / "0").exists()  # a file left empty is removed
    remove_job(folder, 102)
    assert _entries(folder) == {LOCK_NAME}


def test_remove_job_without_a_folder_or_a_line_changes_nothing(tmp_path: Path) -> None:
    assert remove_job(tmp_path / "never", 5) == []
    assert not (tmp_path / "never").exists()
    add_job(tmp_path, 6, (0,))
    assert remove_job(tmp_path, 5) == []
    assert jobs_on(tmp_path / "0") == ["6"]


def _hook_worker(folder: str, first: int, count: int, start: multiprocessing.synchronize.Event) -> None:
    start.wait()
    for job in range(first, first + count):
        add_job(Path(folder), job, (0, 1))
    for job in range(first, first + count, 2):  # the even ones end again
        remove_job(Path(folder), job)


def test_concurrent_hooks_keep_each_others_lines(tmp_path: Path) -> None:
    """Eight processes add and remove jobs on the same two GPU files at once: every surviving job is listed
    exactly once in both files (an unlocked read-modify-write loses lines here)."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    procs = [ctx.Process(target=_hook_worker, args=(str(tmp_path), 1000 + 100 * i, 40, start)) for i in range(8)]
    for proc in procs:
        proc.start()
    start.set()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    want = sorted(str(1000 + 100 * i + j) for i in range(8) for j in range(1, 40, 2))
    for gpu in ("0", "1"):
        assert sorted(jobs_on(tmp_path / gpu)) == want
    assert _entries(tmp_path) == {"0", "1", LOCK_NAME}  # no temporary file left behind


# ----- the hooks ----------------------------------------------------------------------------------


def _site(tmp_path: Path, map_dir: Path | None) -> dict[str, str]:
    config = tmp_path / "clockwork.toml"
    extra = f'gpu_job_map_dir = "{map_dir}"\n' if map_dir is not None else ""
    config.write_text(f'[log]\nfile = "{tmp_path / "hooks.log"}"\n[hooks]\nspool_dir = "{tmp_path / "spool"}"\n{extra}')
    return {"CLOCKWORK_CONFIG": str(config), "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1"}


def test_prolog_and_epilog_write_and_remove_the_mapping(tmp_path: Path) -> None:
    folder = tmp_path / "dcgm"
    env = _site(tmp_path, folder)
    assert runner.main(["prolog"], {**env, "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "1,3"}) == 0
    assert runner.main(["prolog"], {**env, "SLURM_JOB_ID": "42", "CUDA_VISIBLE_DEVICES": "3"}) == 0
    assert jobs_on(folder / "1") == ["41"]
    assert jobs_on(folder / "3") == ["41", "42"]
    # The Epilog needs no GPU list: it takes the job out of every file.
    assert runner.main(["epilog"], {**env, "SLURM_JOB_ID": "41"}) == 0
    assert not (folder / "1").exists()
    assert jobs_on(folder / "3") == ["42"]
    assert runner.main(["prolog_slurmctld"], {**env, "SLURM_JOB_ID": "43", "SLURM_JOB_GPUS": "0"}) == 0
    assert not (folder / "0").exists()  # the controller's hooks hold no GPU


def test_mapping_is_off_without_a_folder(tmp_path: Path) -> None:
    env = _site(tmp_path, None)
    assert runner.main(["prolog"], {**env, "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "0"}) == 0
    assert "dcgm-exporter" not in (tmp_path / "hooks.log").read_text()


def test_a_mapping_failure_never_fails_the_hook(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = _site(tmp_path, blocker / "dcgm")
    assert runner.main(["prolog"], {**env, "SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "0"}) == 0
    log_text = (tmp_path / "hooks.log").read_text()
    assert "job 41: dcgm-exporter job mapping in" in log_text
    assert "job 41: job.prolog on n1 recorded" in log_text  # the rest of the hook still ran
