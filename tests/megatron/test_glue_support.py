"""The tests' torchrun launcher picks a new port when another process took the one it picked."""

import subprocess

import glue_support


def _fake_run_group(outputs):
    calls = []

    def run_group(cmd, timeout, env=None, cwd=None):
        calls.append(cmd[cmd.index("--master-port") + 1])
        returncode, out = outputs[len(calls) - 1]
        return subprocess.CompletedProcess(cmd, returncode, out, "")

    return run_group, calls


def test_a_port_clash_is_retried_on_a_new_port(monkeypatch):
    ports = iter(["29501", "29502", "29503"])
    monkeypatch.setattr(glue_support, "free_port", lambda: next(ports))
    fake, calls = _fake_run_group([(1, "torch.distributed.DistNetworkError: ... EADDRINUSE"), (0, "trained")])
    monkeypatch.setattr(glue_support, "run_group", fake)
    result = glue_support.torchrun("python", 2, ["train.py"], ["--x"], timeout=5)
    assert result.returncode == 0 and result.stdout == "trained"
    assert calls == ["29501", "29502"]


def test_other_failures_are_not_retried_and_clashes_stop_after_the_attempts(monkeypatch):
    monkeypatch.setattr(glue_support, "free_port", lambda: "29501")
    fake, calls = _fake_run_group([(1, "ValueError: bad flag")])
    monkeypatch.setattr(glue_support, "run_group", fake)
    assert glue_support.torchrun("python", 2, ["train.py"], [], timeout=5).stdout == "ValueError: bad flag"
    assert len(calls) == 1
    fake, calls = _fake_run_group([(1, "Address already in use")] * 3)
    monkeypatch.setattr(glue_support, "run_group", fake)
    assert glue_support.torchrun("python", 2, ["train.py"], [], timeout=5, attempts=3).returncode == 1
    assert len(calls) == 3
