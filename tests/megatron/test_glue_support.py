"""The tests' launchers: torchrun picks a new port when another process took the one it picked; ranks
started directly get torchrun's environment, and a failing or hung launch ends like under torchrun."""

import json
import os
import subprocess
import sys
import time

import glue_support
import pytest


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


RANK_SCRIPT = """
import os, sys, time
rank = int(os.environ["RANK"])
print(f"rank {rank} of {os.environ['WORLD_SIZE']} local {os.environ['LOCAL_RANK']} port {os.environ['MASTER_PORT']}",
      flush=True)
printed = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank0-printed")
if rank == 0:
    open(printed, "w").close()
mode = sys.argv[1]
if mode.startswith("fail") and rank == 1:
    while not os.path.exists(printed):  # fail only once rank 0 has printed (the test reads both lines)
        time.sleep(0.01)
    sys.exit(7)
if mode == "fail-then-finish":
    time.sleep(1)
    print(f"rank {rank} finished")
elif mode != "ok":
    time.sleep(60)
"""


def _rank_script(tmp_path):
    path = tmp_path / "rank.py"
    path.write_text(RANK_SCRIPT)
    return [str(path)]


@pytest.mark.slow
def test_ranks_started_directly_get_torchruns_environment_and_their_outputs_are_kept(tmp_path):
    result = glue_support.launch_ranks(sys.executable, 3, _rank_script(tmp_path), ["ok"], timeout=30, preload=False)
    assert result.returncode == 0
    lines = result.stdout.splitlines()
    port = lines[0].split()[-1]
    assert lines == [f"rank {r} of 3 local {r} port {port}" for r in range(3)]


@pytest.mark.slow
def test_the_first_failing_rank_stops_the_others_like_torchrun(tmp_path):
    start = time.monotonic()
    result = glue_support.launch_ranks(sys.executable, 2, _rank_script(tmp_path), ["fail"], timeout=50, preload=False)
    assert result.returncode == 7 and time.monotonic() - start < 20  # not the other rank's 60 s sleep
    assert "rank 0 of 2" in result.stdout and "rank 1 of 2" in result.stdout


@pytest.mark.slow
def test_a_hung_launch_fails_the_test_at_its_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="timed out after 2s"):
        glue_support.launch_ranks(sys.executable, 2, _rank_script(tmp_path), ["hang"], timeout=2, preload=False)
    assert time.monotonic() - start < 20


@pytest.mark.slow
def test_ranks_by_hand_each_run_to_their_end(tmp_path):
    """For the start-up checks every rank must print its own error: a failure stops no other rank."""
    (code0, out0), (code1, out1) = glue_support.run_ranks_by_hand(
        sys.executable, [*_rank_script(tmp_path), "fail-then-finish"], 2, timeout=30, preload=False)
    assert (code0, code1) == (0, 7)
    assert "rank 0 finished" in out0 and out1.startswith("rank 1 of 2")


ENTRY_PROBE = """
import json, os, sys, threading, time
def late():
    time.sleep(0.5)
    print("non-daemon thread finished", flush=True)
threading.Thread(target=late).start()
print(json.dumps({"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd()}))
if sys.argv[-1] == "raise":
    raise RuntimeError("uncaught")
"""


@pytest.mark.slow
def test_forked_ranks_run_their_entry_as_python_would(tmp_path):
    """Each rank runs the entry as ``__main__`` with ``python script.py``'s argv and sys.path[0] (the
    script's directory), waits for its non-daemon threads like an interpreter exit, and an uncaught
    exception prints its traceback and exits 1; ``-m module`` entries run too."""
    script = tmp_path / "probe_entry.py"
    script.write_text(ENTRY_PROBE)
    ranks = glue_support.run_ranks_by_hand(sys.executable, [str(script), "--flag", "x"], 2, timeout=60)
    for code, output in ranks:
        assert code == 0, output
        probe = json.loads(output.splitlines()[0])
        assert probe["name"] == "__main__" and probe["argv"] == [str(script), "--flag", "x"]
        assert probe["path0"] == str(tmp_path) and probe["cwd"] == str(glue_support.ROOT)
        assert output.splitlines()[-1] == "non-daemon thread finished"
    failed = glue_support.launch_ranks(sys.executable, 2, [str(script)], ["raise"], timeout=60, preload=False)
    assert failed.returncode == 1 and "RuntimeError: uncaught" in failed.stdout
    module = glue_support.launch_ranks(sys.executable, 1, ["-m", "json.tool", "--help"], [], timeout=60,
                                       preload=False)
    assert module.returncode == 0 and "usage:" in module.stdout and "json.tool" in module.stdout


def test_the_entry_script_is_found_for_scripts_and_the_runner():
    from megatron_vshape.testing.fork_ranks import entry_script

    assert entry_script(["train.py", "--x"]) == "train.py"
    assert entry_script(["-m", "megatron_vshape.run", "ckpt/pretrain_gpt.py", "--x"]) == "ckpt/pretrain_gpt.py"
    assert entry_script(["-m", "json.tool"]) is None


CHECKOUT_PROBE = """
import json, sys
print(json.dumps({"core": sys.modules["megatron.core"].__file__, "version": sys.modules["megatron.core"].__version__}))
"""


@pytest.mark.slow
def test_forked_ranks_preload_the_megatron_of_the_scripts_checkout(tmp_path):
    """A script next to a megatron/ package gets that one preloaded, not the installed megatron-core: every
    rank would import it from there (``sys.path[0]``), and a preloaded module is never imported again."""
    (tmp_path / "megatron" / "core").mkdir(parents=True)
    (tmp_path / "megatron" / "core" / "__init__.py").write_text("__version__ = 'checkout'\n")
    script = tmp_path / "probe_checkout.py"
    script.write_text(CHECKOUT_PROBE)
    result = glue_support.launch_ranks(sys.executable, 1, [str(script)], [], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == {"core": str(tmp_path / "megatron" / "core" / "__init__.py"),
                                                          "version": "checkout"}


SERVED_PROBE = """
import os, sys, time
rank = int(os.environ["RANK"])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"pid{rank}"), "w") as out:
    out.write(str(os.getpid()))
print(f"rank {rank} of {os.environ['WORLD_SIZE']} port {os.environ['MASTER_PORT']} torch preloaded "
      f"{'torch' in sys.modules} cwd {os.getcwd()} marker {os.environ.get('VSHAPE_PROBE_MARKER')}", flush=True)
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(7)
if sys.argv[1] in ("hang", "fail"):
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_launches_of_one_script_share_one_launch_server_that_runs_each_like_fork_ranks(tmp_path):
    """Preloaded launches of one script in one environment reuse one server (torch imported once, before
    the rank runs); each launch still gets torchrun's environment, its own port and output; the first
    failing rank stops the others; a hung launch fails the test at its timeout with every rank killed, and
    the server serves the next launch; another environment gets its own server."""
    script = tmp_path / "served.py"
    script.write_text(SERVED_PROBE)
    servers = glue_support.LAUNCH_SERVERS
    first = glue_support.launch_ranks(sys.executable, 2, [str(script)], ["ok"], timeout=120)
    assert first.returncode == 0, first.stdout[-3000:]
    port = first.stdout.split()[5]
    assert first.stdout.splitlines() == [
        f"rank {r} of 2 port {port} torch preloaded True cwd {glue_support.ROOT} marker None" for r in range(2)]
    def servers_of_this_script():  # the process's servers may hold other tests' too
        return [s for key, s in servers._servers.items() if key[1] == os.path.realpath(tmp_path)]

    (server,) = servers_of_this_script()
    failed = glue_support.launch_ranks(sys.executable, 2, [str(script)], ["fail"], timeout=120)
    assert failed.returncode == 7 and "rank 0 of 2" in failed.stdout and not _alive(int((tmp_path / "pid0").read_text()))
    with pytest.raises(pytest.fail.Exception, match="timed out after 3s"):
        glue_support.launch_ranks(sys.executable, 2, [str(script)], ["hang"], timeout=3)
    hung = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in hung) and time.monotonic() < deadline:  # killed, then reaped by init
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in hung)
    again = glue_support.launch_ranks(sys.executable, 1, [str(script)], ["ok"], timeout=120)
    assert again.returncode == 0 and servers_of_this_script() == [server] and server.alive()
    marked = glue_support.launch_ranks(sys.executable, 1, [str(script)], ["ok"], timeout=120,
                                       env=glue_support.cpu_env(VSHAPE_PROBE_MARKER="other"))
    assert marked.returncode == 0 and marked.stdout.rstrip().endswith("marker other")
    others = servers_of_this_script()
    assert len(others) == 2 and others[0] is server and server.alive()


def test_a_closed_launch_server_leaves_no_error_file(tmp_path):
    """Closing a server removes its stderr file, whether the server still ran or had stopped (each server
    left one in the temporary directory: hundreds after a day of test runs)."""
    from megatron_vshape.testing.launch_server import _Server

    for still_running in (True, False):
        errors = tmp_path / f"server-{still_running}.log"
        errors.write_text("")
        process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE)
        if not still_running:
            process.stdin.close()
            process.wait(timeout=30)
        server = _Server(process, errors)
        server.close()
        assert not server.alive() and not errors.exists()


def test_training_launches_load_data_in_the_rank_unless_they_name_the_workers():
    script = ["-m", "megatron_vshape.run", "/x/pretrain_gpt.py", "--mock-data"]
    assert glue_support.loader_in_the_rank(script) == [*script, "--num-workers", "0"]
    assert glue_support.loader_in_the_rank([*script, "--num-workers", "2"]) == [*script, "--num-workers", "2"]
    other = ["-m", "megatron_vshape.verify", "train.py"]
    assert glue_support.loader_in_the_rank(other) == other
