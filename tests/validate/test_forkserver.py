"""The harness's rank processes, forked from a server that imported torch once (actmem_validate.forkserver): each
sees its caller's environment as it is when it starts, not the server's, and a rank that fails fails the start."""

import os

import pytest

torch = pytest.importorskip("torch")

from actmem_validate import forkserver  # noqa: E402


def _write_environment(rank: int, folder: str, name: str) -> None:
    with open(os.path.join(folder, f"{rank}.txt"), "w") as file:
        file.write(os.environ.get(name, "unset"))


def _fail(rank: int) -> None:
    raise RuntimeError(f"rank {rank} fails")


def test_a_rank_sees_the_environment_set_after_the_server_started(tmp_path, monkeypatch):
    forkserver.start(_write_environment, (str(tmp_path), "ACTMEM_FORKSERVER_TEST"), 1)     # the server runs
    monkeypatch.setenv("ACTMEM_FORKSERVER_TEST", "set after")
    forkserver.start(_write_environment, (str(tmp_path), "ACTMEM_FORKSERVER_TEST"), 2)
    assert [(tmp_path / f"{rank}.txt").read_text() for rank in (0, 1)] == ["set after", "set after"]
    monkeypatch.delenv("ACTMEM_FORKSERVER_TEST")
    forkserver.start(_write_environment, (str(tmp_path), "ACTMEM_FORKSERVER_TEST"), 1)
    assert (tmp_path / "0.txt").read_text() == "unset"


def test_a_failing_rank_fails_the_start():
    with pytest.raises(torch.multiprocessing.ProcessRaisedException, match="rank 1 fails|rank 0 fails"):
        forkserver.start(_fail, (), 2)


def test_the_server_imports_the_harness_and_only_what_is_installed():
    forkserver.preload("a_module_nobody_installed.sub")
    import multiprocessing.forkserver as server

    assert {"torch", "actmem_validate.measure"} <= set(server._forkserver._preload_modules)
    assert "a_module_nobody_installed.sub" not in server._forkserver._preload_modules
