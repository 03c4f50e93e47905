"""torchrun's own restarts: a worker SIGKILLed mid-step, mid-save or mid-async-save, torchrun restarts the whole
group (``--max-restarts``), the group resumes from the newest valid checkpoint, and the run ends bit-identical to
an uninterrupted one. Also two torchrun agents as two "nodes" on 127.0.0.1 (c10d rendezvous), one of which is
SIGKILLed and started again.

The loop is tests/scripts/ddp_restart_loop.py (DDP, 2 processes, gloo, dropout, AdamW, ElasticSampler).

torchrun's workers meet in the agent's TCPStore, which outlives the attempts, with no per-attempt key prefix; a
restarted worker could read the previous attempt's gloo address of its peer and hang or fail ("connectFullMesh ...
Connection refused"). ``import hf_resumable`` scopes every attempt's keys (hf_resumable.distributed); the first
tests here prove that on a store shared by successive groups, without torchrun in the way.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from hf_resumable import distributed as hfr_dist

from helpers import zygote
from helpers.distributed_launch import REPO_ROOT, child_env, free_port, launch_ranks, run_torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SCRIPT = Path(__file__).parent / "scripts" / "ddp_restart_loop.py"
GROUP = Path(__file__).parent / "scripts" / "agent_store_group.py"


def _agent_store() -> tuple[dist.TCPStore, int]:
    """A TCPStore like the one torchrun's agent hosts for all attempts (``multi_tenant``, no waiting for clients)."""
    port = free_port()
    return dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), multi_tenant=True), port


def _scoped(store: dist.Store, world_size: int) -> list[str]:
    """Every rank's ``_attempt_store`` over ``store`` at once (threads), each as the prefix its keys get."""
    prefixes: list[str] = [""] * world_size

    def rank(r: int) -> None:
        scoped = hfr_dist._attempt_store(store, r, world_size, timeout=datetime.timedelta(seconds=20))
        scoped.set(f"probe/{r}", "here")
        prefixes[r] = next(p for p in (f"hf_resumable/attempt-{n}" for n in range(50, 0, -1))  # the newest
                           if store.check([f"{p}/probe/{r}"]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return prefixes


def test_each_attempt_agrees_on_a_fresh_prefix_whatever_the_previous_attempt_left():
    store, _ = _agent_store()
    first = _scoped(store, 3)
    assert len(set(first)) == 1 and first[0]
    # What a killed attempt leaves behind: a join nonce and a reply to it (another process's, never answered now).
    meeting = dist.PrefixStore("hf_resumable/rendezvous", store)
    meeting.set("join/1", b"stale-nonce")
    meeting.set("reply/2", b"stale-nonce 1")
    second = _scoped(store, 3)
    assert len(set(second)) == 1 and second[0] and second[0] != first[0]


def test_a_rank_that_never_joins_is_a_typed_timeout_naming_it():
    store, _ = _agent_store()
    with pytest.raises(dist.DistStoreError, match="rank 1 to join"):
        hfr_dist._attempt_store(store, 0, 2, timeout=datetime.timedelta(seconds=0.5))


def test_plain_init_process_group_on_a_store_that_outlives_the_group_never_reads_the_last_groups_keys():
    """Two gloo groups, one after the other, in the same store (torchrun's agent store across a restart). In the
    second, rank 0 starts late: without the per-attempt prefix rank 1 reads rank 0's address from the first group
    and hangs (checked by hand: HF_RESUMABLE_ATTEMPT_STORE=0 hangs past 60 s here)."""
    store, port = _agent_store()
    for attempt, delays in enumerate([(0, 0), (2, 0)]):
        procs = []
        for rank, delay in enumerate(delays):
            env = child_env({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                             "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
                             "TORCHELASTIC_RESTART_COUNT": str(attempt)})
            env.pop("HF_RESUMABLE_ATTEMPT_STORE", None)
            procs.append(zygote.Popen([sys.executable, str(GROUP), str(delay)], env=env, cwd=REPO_ROOT,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            outs = [proc.communicate(timeout=400)[0] for proc in procs]  # a loaded machine is only slower
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait()
        assert [proc.returncode for proc in procs] == [0, 0], f"attempt {attempt}:\n" + "\n".join(outs)
        assert all("sum 3.0" in out for out in outs), outs
    assert dist.PrefixStore("hf_resumable/rendezvous", store).add("counter", 0) == 2  # both went through it


def _losses(out: Path) -> dict[int, list[float]]:
    """Each step's losses (every rank), as the last attempt that ran it logged them."""
    by_step: dict[int, list[float]] = {}
    for line in (out / "losses.jsonl").read_text().splitlines():
        record = json.loads(line)
        by_step[record["step"]] = record["loss"]
    return by_step


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    result = run_torchrun(SCRIPT, [str(out)], env=child_env(), timeout=600, forked=False)
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def _assert_same_run(out: Path, reference: Path) -> None:
    final, expected = json.loads((out / "final.json").read_text()), json.loads((reference / "final.json").read_text())
    assert final["attempt"] >= 1, "the group was never restarted"
    assert final["sha256"] == expected["sha256"]
    assert _losses(out) == _losses(reference)


@pytest.mark.parametrize("where,blocking", [pytest.param("step", True, marks=pytest.mark.extended), ("save", True),
                                            pytest.param("save", False, marks=pytest.mark.extended)],
                         ids=["mid-step", "mid-save", "mid-async-save"])
def test_torchrun_restarts_the_group_and_the_run_ends_bit_identical(tmp_path, reference, where, blocking):
    args = [str(tmp_path), "--kill-at", "4" if where == "save" else "5", "--kill-in", where, "--kill-rank", "1"]
    if not blocking:
        args.append("--async")
    result = run_torchrun(SCRIPT, args, env=child_env(), timeout=600, torchrun_args=["--max-restarts", "2"],
                          forked=False)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "SIGKILL" in result.stdout or "Signals.SIGKILL" in result.stdout or "exitcode: -9" in result.stdout
    _assert_same_run(tmp_path, reference)


def _agent(node_rank: int, port: int, out: Path, log: Path) -> subprocess.Popen:
    command = [str(Path(sys.executable).parent / "torchrun"), "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hfr-two-nodes",
               "--max-restarts", "3", "--monitor-interval", "0.5", "--node-rank", str(node_rank),
               # A dead agent is dropped from the rendezvous after 2 missed 1-second heartbeats.
               "--rdzv-conf", "keep_alive_interval=1,keep_alive_max_attempt=2,join_timeout=120",
               str(SCRIPT), str(out), "--kill-at", "0", "--step-delay", "0.4"]
    # Without TCPStore sharing: in torch 2.13 an agent that stays rank 0 across rounds does not republish the shared
    # store's address for the new round, and a re-joining agent waits for it forever.
    env = {**child_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    return subprocess.Popen(command, env=env, cwd=REPO_ROOT,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)


def _wait_until_listening(process: subprocess.Popen, port: int, timeout: float = 120) -> None:
    """Until ``process`` listens on ``port`` (a fixed sleep is not enough on a loaded machine: torch's import alone
    can take longer, and then the *other* agent hosts the store and killing it breaks the rendezvous)."""
    deadline = time.monotonic() + timeout
    while not any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                  for c in psutil.Process(process.pid).net_connections(kind="tcp")):
        assert process.poll() is None and time.monotonic() < deadline, f"agent 0 never listened on {port}"
        time.sleep(0.05)


def _report(out: Path, *agents: subprocess.Popen) -> str:
    """What a failed or stuck two-agent run shows: each agent's log tail, the processes still alive under each agent
    (state and command line) and the last steps logged."""
    lines = []
    for log in sorted(out.glob("agent*.log")):
        lines += [f"----- {log.name} (last 3000 characters)", log.read_text(errors="replace")[-3000:]]
    for agent in agents:
        try:
            root = psutil.Process(agent.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        lines.append(f"----- agent {agent.pid}: exit code {agent.poll()}")
        for proc in tree:
            try:
                lines.append(f"  {proc.pid} {proc.status()} {' '.join(proc.cmdline())[:200]}")
            except psutil.NoSuchProcess:
                pass
    losses = out / "losses.jsonl"
    lines += ["----- losses.jsonl (last lines)", *(losses.read_text().splitlines()[-4:] if losses.exists() else [])]
    return "\n".join(lines)


def _exit_code(agent: subprocess.Popen, timeout: float, out: Path, agents: tuple[subprocess.Popen, ...]) -> int:
    """The agent's exit code; an agent still running after ``timeout`` seconds fails the test with the report."""
    try:
        return agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"agent {agent.pid} still running after {timeout:.0f} s\n{_report(out, *agents)}")


def _kill_tree(process: subprocess.Popen) -> None:
    try:
        children = psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for proc in [psutil.Process(process.pid)] + children if process.poll() is None else children:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


# The multi-node variant of the group restart above (which stays in `make test`): `make test-all`.
@pytest.mark.extended
def test_two_agents_as_two_nodes_one_sigkilled_and_started_again(tmp_path, reference):
    """The agent that does not host the rendezvous store is SIGKILLed (with its worker) after the first checkpoint;
    starting it again re-forms the group, which resumes from that checkpoint and ends bit-identical."""
    port = free_port()
    host = _agent(0, port, tmp_path, tmp_path / "agent0.log")
    _wait_until_listening(host, port)  # the first agent to bind the endpoint hosts the rendezvous store: agent 0
    other = _agent(1, port, tmp_path, tmp_path / "agent1.log")
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ckpt" / "checkpoint-2" / "manifest.json").exists():
            assert time.monotonic() < deadline, (tmp_path / "agent0.log").read_text()[-3000:]
            assert host.poll() is None and other.poll() is None, (tmp_path / "agent1.log").read_text()[-3000:]
            time.sleep(0.05)
        _kill_tree(other)
        other.wait()
        time.sleep(5.0)  # let the rendezvous notice that the agent is gone
        other = _agent(1, port, tmp_path, tmp_path / "agent1-again.log")
        assert _exit_code(host, 240, tmp_path, (host, other)) == 0, _report(tmp_path, host, other)
        assert _exit_code(other, 60, tmp_path, (host, other)) == 0, _report(tmp_path, host, other)
    finally:
        for process in (host, other):
            _kill_tree(process)
    _assert_same_run(tmp_path, reference)


SETTLE = Path(__file__).parent / "scripts" / "settle_worker.py"


def test_a_settled_collective_leaves_gloo_holding_none_of_its_tensors(tmp_path):
    """gloo destroys a completed work on its worker thread a moment after ``wait()`` returned; a process that exits
    in that moment aborts (SIGABRT, "terminate called without an active exception": the reference run of the test
    above did, 1 run in about 15). ``settle`` waits for that release; the library's collectives call it."""
    rounds = 200
    for result in launch_ranks([str(SETTLE), str(tmp_path), str(rounds)], world_size=2, timeout=300):
        assert result.returncode == 0 and not result.killed_by_timeout, result.describe()
    for rank in (0, 1):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["ranks"] == [0, 1]
        assert len(record["counts"]) == rounds
        assert all(after == 1 for _, after in record["counts"]), record["counts"]
