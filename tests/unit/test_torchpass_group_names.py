"""A generation whose process group failed to form leaves nothing behind that keeps the next one from forming.

The defect this guards against (issue 40, found by ``bench/exactness_fuzz.py --seed 46``: a rank's replacement
SIGKILLed while the generation that brought it in was forming): torch names the default process group by a
per-process count that ``init_process_group`` takes before it meets its peers, and only destroying a formed
default group resets it. The survivor whose formation failed named every later generation's group one further
than the newcomer, so they waited for each other's rendezvous keys under different names, every rebuild timed
out, and the job failed after ``max_resets`` rebuilds with "the same collective keeps failing there".

Two processes run :class:`torchpass.rank.backends.GlooBackend` as a rank does: ``a`` fails to form generation 1 (its
peer never comes; a 2 s timeout), then ``a`` and a fresh ``b`` form generation 2 and all-reduce over it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from torchpass.rank.backends import GlooBackend
    from torchpass.config import TorchPassConfig

    role, port = sys.argv[1], int(sys.argv[2])
    backend = GlooBackend(TorchPassConfig(collective_timeout_s=2))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=__import__("datetime").timedelta(seconds=30))
    if role == "a":
        try:
            backend.form_group(dist.PrefixStore("g1", store), 0, 2, 1, set())
        except Exception as exc:
            print(f"generation 1 did not form: {type(exc).__name__}", flush=True)
        else:
            sys.exit("generation 1 formed without its second member")
        backend.destroy()
        store.set("a-failed-once", "1")
    else:
        store.wait(["a-failed-once"])
    backend.form_group(dist.PrefixStore("g2", store), 0 if role == "a" else 1, 2, 2, set())
    total = torch.ones(1)
    dist.all_reduce(total)
    print(f"{role}: generation 2 formed, sum {int(total.item())}", flush=True)
    backend.destroy()
    """
)


def test_a_failed_formation_does_not_keep_the_next_generation_from_forming(tmp_path: Path) -> None:
    import torch.distributed as dist

    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    port = str(host.port)
    a = subprocess.Popen([sys.executable, str(script), "a", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    b = subprocess.Popen([sys.executable, str(script), "b", port], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out_a, _ = a.communicate(timeout=120)
    out_b, _ = b.communicate(timeout=120)
    said = out_a.decode() + out_b.decode()
    assert a.returncode == 0 and b.returncode == 0, said[-4000:]
    assert "generation 1 did not form" in said, said[-4000:]
    assert "a: generation 2 formed, sum 2" in said and "b: generation 2 formed, sum 2" in said, said[-4000:]
