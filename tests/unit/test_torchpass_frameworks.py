"""The framework support of transparent mode that needs no training job: what a spare and the zygote pre-import,
which framework ``init_process_group`` callers select or refuse, and the names rebound to the DDP interposer.
The training itself is tested with real jobs (test_torchpass_lightning.py)."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from torchpass.frameworks import detect
from torchpass.frameworks.hf_trainer import HFTrainerAdapter
from torchpass.launch.warmup import framework_modules, imported_by, preimport, rebind_in_loaded_modules

SCRIPT = """
import os, json
from pathlib import Path
import lightning as L
from torch.utils.data import DataLoader
from . import sibling            # relative: not something a spare can import by name

def main():
    import transformers.trainer  # nested: still read
    from accelerate import Accelerator
"""


def test_a_spare_reads_every_absolute_import_of_the_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    assert imported_by(str(script)) == [
        "os",
        "json",
        "pathlib",
        "lightning",
        "torch.utils.data",
        "transformers.trainer",
        "accelerate",
    ]
    assert framework_modules(str(script)) == ("lightning", "transformers.trainer", "accelerate")


def test_an_unreadable_or_broken_script_imports_nothing(tmp_path: Path) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("import os\ndef (:\n")
    assert imported_by(str(broken)) == []
    assert imported_by(str(tmp_path / "missing.py")) == []


def test_preimport_skips_what_it_cannot_import(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import json\nimport cw_no_such_module_anywhere\nimport colorsys\n")
    sys.modules.pop("colorsys", None)
    done, seconds = preimport(str(script))
    assert done == ["colorsys"] and "colorsys" in sys.modules  # json was loaded already; the missing one skipped
    assert seconds >= 0


def test_names_bound_before_the_interposer_are_rebound_and_undone() -> None:
    original, replacement = object(), object()
    module = types.ModuleType("cw_fake_framework.strategies")
    module.DDP = original  # type: ignore[attr-defined]
    module.other = 1  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    undo: list[Any] = []

    def patch(owner: Any, name: str, value: Any) -> None:
        undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    # ``python -m torchpass.transparent.bootstrap`` is filed as __main__ and, by multiprocessing, as __mp_main__: the
    # bootstrap's own reference to the real class must stay the real class.
    bootstrap = types.ModuleType("__mp_main__")
    bootstrap.__spec__ = importlib.machinery.ModuleSpec("torchpass.transparent.bootstrap", None)
    bootstrap.REAL = original  # type: ignore[attr-defined]
    saved_alias = sys.modules.get("__mp_main__")
    sys.modules["__mp_main__"] = bootstrap
    try:
        assert rebind_in_loaded_modules(original, replacement, patch) == 1
        assert bootstrap.REAL is original  # type: ignore[attr-defined]
        assert module.DDP is replacement  # type: ignore[attr-defined]
        for owner, name, value in undo:
            setattr(owner, name, value)
        assert module.DDP is original  # type: ignore[attr-defined]
    finally:
        del sys.modules[module.__name__]
        if saved_alias is None:
            del sys.modules["__mp_main__"]
        else:
            sys.modules["__mp_main__"] = saved_alias


class _Session:
    """Only what detect() reads before it picks an adapter."""

    ctx: Any = None
    step_open = False

    def warn(self, message: str) -> None:
        raise AssertionError(message)

    def roll_back_open_step(self) -> bool:
        return False


@pytest.mark.parametrize("caller", ["accelerate.state", "transformers.training_args"])
def test_hugging_face_selects_the_trainer_adapter_which_finds_its_trainer_later(caller: str) -> None:
    adapter = detect(caller, _Session(), lambda: None)
    assert isinstance(adapter, HFTrainerAdapter) and adapter.trainer is None


def test_a_plain_script_selects_no_adapter() -> None:
    assert detect("__main__", _Session(), lambda: None) is None
    assert detect("mytrainer.loop", _Session(), lambda: None) is None


def test_the_torchrun_environment_makes_lightning_take_the_slot_as_its_rank() -> None:
    """Inside a Slurm job Lightning would read SLURM_PROCID (the agent's task); TORCHELASTIC_RUN_ID makes it
    read RANK, the slot. A local layout the launcher set (LOCAL_WORLD_SIZE) is kept and numbers the groups."""
    from torchpass.frameworks.environment import torchrun_environment

    env = {"SLURM_PROCID": "0", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    torchrun_environment(env, slot=5, world_size=8, host="10.0.0.7", job_id="42")
    assert env["RANK"] == "5" and env["WORLD_SIZE"] == "8" and env["LOCAL_RANK"] == "1"
    assert env["TORCHELASTIC_RUN_ID"] == "torchpass-42"
    assert env["GROUP_RANK"] == env["ROLE_RANK"] == "2" and env["GROUP_WORLD_SIZE"] == "4"
    assert env["MASTER_ADDR"] == "10.0.0.7"
    local: dict[str, str] = {}
    torchrun_environment(local, slot=1, world_size=2, host="127.0.0.1", job_id="")
    assert local["TORCHELASTIC_RUN_ID"] == "torchpass-local" and local["GROUP_RANK"] == "1"
