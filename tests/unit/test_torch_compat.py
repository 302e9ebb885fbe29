"""torchpass.rank.torch_compat: the torch release check, and FSDP2's held-back gradients found and dropped.

The release check runs at import: a release other than the tested one is refused with both versions named,
unless ``TORCHPASS_UNTESTED_TORCH=1`` asks to run anyway (a warning then). The FSDP2 helpers are checked on a real
one-rank FSDP2 model over gloo: a micro-batch under ``set_requires_gradient_sync(False)`` leaves gradients that
``zero_grad`` does not reach, and :func:`drop_held_back_gradients` does.
"""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from torchpass.errors import TorchPassError
from torchpass.rank import torch_compat


def test_the_tested_release_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(torch_compat.ENV_UNTESTED, raising=False)
    for version in ("2.13.0", "2.13.0+cpu", "2.13.1+cu128"):
        torch_compat._check_release(version)


def test_another_release_is_refused_with_both_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(torch_compat.ENV_UNTESTED, raising=False)
    with pytest.raises(TorchPassError, match=r"tested with torch 2\.13\.x .* this is torch 2\.14\.1") as error:
        torch_compat._check_release("2.14.1")
    assert "TORCHPASS_UNTESTED_TORCH=1" in str(error.value)
    with pytest.raises(TorchPassError):
        torch_compat._check_release("2.4.0")


def test_another_release_runs_with_a_warning_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(torch_compat.ENV_UNTESTED, "1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_compat._check_release("2.14.1")
    assert any("running anyway" in str(w.message) for w in caught)


@pytest.fixture(scope="module")
def one_rank_group() -> Iterator[None]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def test_held_back_gradients_are_found_and_dropped(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (1,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch_compat.check_fsdp_internals(model)
    assert not torch_compat.holds_back_gradients(model)

    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    assert torch_compat.holds_back_gradients(model)
    model.zero_grad(set_to_none=True)
    assert torch_compat.holds_back_gradients(model), "zero_grad reached the held-back gradients"
    assert torch_compat.drop_held_back_gradients(model) > 0
    assert not torch_compat.holds_back_gradients(model)

    # With nothing held back, a synchronising backward gives exactly the gradient of its own micro-batch.
    x = torch.randn(3, 4)
    model.set_requires_gradient_sync(True)
    model(x).sum().backward()
    got = [p.grad.full_tensor().clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    assert all(torch.equal(a, p.grad.full_tensor()) for a, p in zip(got, model.parameters(), strict=True))
