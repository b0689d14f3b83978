"""`make cluster-test` (`python -m specbench.cluster run -- CMD`): a real single-node SLURM cluster on this machine,
started from nothing, CMD run against it, everything stopped after.

What a cluster brings that a laptop does not (a job's working directory and environment on the compute node, several
jobs writing one results tree, a rendezvous between nodes, a job cancelled or requeued half-way) can only be met on
SLURM itself, so this starts the real daemons, Debian's `slurm-wlm` 22.05, in the smallest layout that still has
every piece a site has:

    munged       credentials (its own key, its own socket)
    mariadbd     the accounting database (a private data directory)
    slurmdbd     accounting: `sacct`, which submitit polls to see a job cancelled, failed or requeued
    slurmctld    the controller
    slurmd       one compute node with this machine's cores and memory

No systemd and no cgroups: proctrack/linuxproc, task/none. Every daemon runs in the foreground as a child of this
process and is stopped by its pid. Unless `--no-isolate`, the whole thing runs in its own mount, network and pid
namespaces (`unshare`, root): the daemons can only listen on and reach this namespace's loopback, the default munge
socket path (/run/munge) is a bind mount of the cluster's own directory (sacct's connection to slurmdbd reads only
that path), and when CMD ends every process started inside (the daemons, slurmstepd, jobs) ends with the namespace.

  python -m specbench.cluster run -- pytest -q tests/cluster   # what `make cluster-test` runs
  python -m specbench.cluster run -- bash                       # a shell with SLURM_CONF set: sbatch, squeue, sacct

Missing packages are installed with apt-get when running as root (`slurm-wlm slurmdbd munge mariadb-server`);
otherwise the one line says which command to run.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from specbench.errors import SpecbenchError

PACKAGES = ("slurm-wlm", "slurmdbd", "munge", "mariadb-server")
BINARIES = ("munged", "mariadbd", "mariadb-install-db", "mariadb", "slurmdbd", "slurmctld", "slurmd", "sbatch",
            "sacct", "sacctmgr", "scontrol", "sinfo")
CLUSTER_NAME = "specbench"
PARTITION = "debug"
DB_USER, DB_PASSWORD, DB_NAME = "slurm", "specbench", "slurm_acct_db"
ISOLATED_ENV = "SPECBENCH_CLUSTER_ISOLATED"  # set inside the namespaces (the re-executed child)


def missing_binaries() -> list[str]:
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return [b for b in BINARIES if shutil.which(b, path=path) is None]


def ensure_installed() -> None:
    """Debian's packages, installed when missing (root only: anything else gets the command to run)."""
    if not missing_binaries():
        return
    if os.geteuid() != 0:
        raise SpecbenchError(f"SLURM is not installed ({', '.join(missing_binaries())} missing): run "
                             f"`sudo apt-get install -y {' '.join(PACKAGES)}`, then this again")
    print(f"cluster: installing {' '.join(PACKAGES)} (apt-get)", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *PACKAGES], check=True, env=env, stdout=subprocess.DEVNULL)
    if missing_binaries():
        raise SpecbenchError(f"apt-get installed {' '.join(PACKAGES)} but {', '.join(missing_binaries())} is "
                             "still missing")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def total_memory_mb() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


@dataclass
class Ports:
    slurmctld: int = field(default_factory=free_port)
    slurmd: int = field(default_factory=free_port)
    slurmdbd: int = field(default_factory=free_port)
    mariadb: int = field(default_factory=free_port)


@dataclass
class LocalCluster:
    """One controller, one node (this machine's cores and ~90% of its memory), accounting through slurmdbd."""

    root: Path
    cpus: int = field(default_factory=lambda: os.cpu_count() or 1)
    memory_mb: int = field(default_factory=lambda: int(total_memory_mb() * 0.9))
    munge_dir: Path | None = None  # None: <root>/munge (its socket at munge.socket.2 there)
    ports: Ports = field(default_factory=Ports)
    node: str = field(default_factory=lambda: socket.gethostname().split(".")[0])
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return (self.munge_dir or self.root / "munge") / "munge.socket.2"

    def env(self) -> dict[str, str]:
        """What a client (sbatch, sacct, submitit) needs to find this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "SPECBENCH_CLUSTER": CLUSTER_NAME}

    # ---- configuration -------------------------------------------------------------------------------------------
    def write_configs(self) -> None:
        for d in ("etc", "state", "spool", "log", "db"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        auth = f"socket={self.munge_socket},cred_expire=10"  # cred_expire: also how long a requeued job waits
        (self.root / "etc" / "slurm.conf").write_text("\n".join([
            f"ClusterName={CLUSTER_NAME}",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={self.ports.slurmctld}",
            f"SlurmdPort={self.ports.slurmd}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo={auth}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            # no systemd, no cgroups: a job step's processes tracked by their process group (linuxproc's /proc walk
            # fails under gVisor, leaving a cancelled step running), tasks not bound
            "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/slurmdbd", "AccountingStorageHost=127.0.0.1",
            f"AccountingStoragePort={self.ports.slurmdbd}",
            "SwitchType=switch/none", "MpiDefault=none",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            # a requeued job (preemption, `scontrol requeue`) starts again; SIGKILL 2 s after SIGTERM (submitit lets a job run on through SIGTERM)
            "ReturnToService=2", "JobRequeue=1", "KillWait=2", "MinJobAge=600",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")
        dbd = self.root / "etc" / "slurmdbd.conf"  # slurmdbd reads it beside SLURM_CONF; mode 600 or it refuses
        dbd.write_text("\n".join([
            "AuthType=auth/munge", f"AuthInfo={auth}",
            "DbdHost=localhost", "DbdAddr=127.0.0.1", f"DbdPort={self.ports.slurmdbd}", "SlurmUser=root",
            f"LogFile={self.root / 'log' / 'slurmdbd.log'}", f"PidFile={self.root / 'slurmdbd.pid'}",
            "StorageType=accounting_storage/mysql", "StorageHost=127.0.0.1", f"StoragePort={self.ports.mariadb}",
            f"StorageLoc={DB_NAME}", f"StorageUser={DB_USER}", f"StoragePass={DB_PASSWORD}",
        ]) + "\n")
        dbd.chmod(0o600)

    # ---- daemons -------------------------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as log:  # (the daemon keeps its own copy of the fd)
            self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                                env=self.env(), start_new_session=True)

    def _wait(self, name: str, ready, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise SpecbenchError(f"cluster: {name} exited with {proc.returncode} at start: "
                                     f"{self.log_tail(name)}")
            if ready():
                return
            time.sleep(0.2)
        raise SpecbenchError(f"cluster: {name} not ready after {timeout:.0f} s: {self.log_tail(name)}")

    def log_tail(self, name: str) -> str:
        path = self.root / "log" / f"{name}.out"
        lines = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
        return lines[-1] if lines else "(no output)"

    def _ok(self, cmd: list[str]) -> bool:
        try:
            return subprocess.run(cmd, env=self.env(), capture_output=True, timeout=5).returncode == 0
        except subprocess.TimeoutExpired:  # a daemon still starting may hold a client that long
            return False

    def start(self) -> "LocalCluster":
        self.write_configs()
        munge = self.munge_socket.parent
        munge.mkdir(parents=True, exist_ok=True)
        munge.chmod(0o755)  # munged: every client needs execute permission on the socket's directory
        key = munge / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
            key.chmod(0o400)
        self._spawn("munged", ["munged", "-F", "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
                               f"--log-file={self.root / 'log' / 'munged.log'}"])
        self._wait("munged", lambda: self.munge_socket.exists())
        self._start_database()
        self._spawn("slurmdbd", ["slurmdbd", "-D"])
        self._wait("slurmdbd", lambda: self._ok(["sacctmgr", "-n", "list", "cluster"]))
        subprocess.run(["sacctmgr", "-i", "add", "cluster", CLUSTER_NAME], env=self.env(), capture_output=True,
                       timeout=30)
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._wait("slurmctld", lambda: self._ok(["scontrol", "ping"]))
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node])
        self._wait("slurmd", self._node_idle)
        return self

    def _start_database(self) -> None:
        db, sock = self.root / "db", self.root / "mysql.sock"
        if not (db / "mysql").exists():
            res = subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={db}", "--user=root",
                                  "--auth-root-authentication-method=normal", "--skip-test-db"],
                                 capture_output=True, text=True, timeout=120)
            if res.returncode != 0:
                raise SpecbenchError(f"cluster: mariadb-install-db failed: {res.stderr.strip()[-300:]}")
        self._spawn("mariadbd", ["mariadbd", "--no-defaults", f"--datadir={db}", "--user=root", f"--socket={sock}",
                                 "--bind-address=127.0.0.1", f"--port={self.ports.mariadb}",
                                 f"--pid-file={self.root / 'mariadbd.pid'}", "--innodb-buffer-pool-size=64M",
                                 f"--log-error={self.root / 'log' / 'mariadbd.log'}"])
        sql = ["mariadb", "--no-defaults", "-S", str(sock), "-u", "root"]
        self._wait("mariadbd", lambda: sock.exists() and self._ok([*sql, "-e", "select 1"]))
        grants = "".join(f"create user if not exists '{DB_USER}'@'{h}' identified by '{DB_PASSWORD}'; "
                         f"grant all on {DB_NAME}.* to '{DB_USER}'@'{h}'; " for h in ("127.0.0.1", "localhost"))
        subprocess.run([*sql, "-e", f"create database if not exists {DB_NAME}; {grants}"], check=True,
                       capture_output=True, timeout=30)

    def _node_idle(self) -> bool:
        res = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                             timeout=30)
        return res.returncode == 0 and res.stdout.strip() == "idle"

    def stop(self) -> None:
        """Cancel every job, then stop the daemons in reverse order by pid (SIGTERM, SIGKILL after 10 s)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user", str(os.geteuid())], env=self.env(), capture_output=True,
                           timeout=30)
            end = time.monotonic() + 15
            while time.monotonic() < end and subprocess.run(
                    ["squeue", "-h", "-o", "%i"], env=self.env(), capture_output=True, text=True,
                    timeout=30).stdout.strip():
                time.sleep(0.5)
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()


@contextlib.contextmanager
def running(root: Path, **kw):
    cluster = LocalCluster(root, **kw)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def isolate(argv: list[str]) -> int:
    """Re-run this command inside new mount, network and pid namespaces (loopback only; every process started
    inside ends with it); /run/munge there is the cluster's own directory."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        raise SpecbenchError("cluster: isolation needs root and util-linux's unshare; pass --no-isolate to run the "
                             "daemons in this network namespace (they then listen on every interface)")
    # 127.0.0.2 on lo: glibc's AI_ADDRCONFIG (the daemons' wildcard bind) sees no IPv4 while 127.0.0.1 is the only one
    # bash stays the namespace's pid 1 (no exec): it reaps the orphans a cancelled job step leaves, which SLURM
    # otherwise counts as the step's processes forever (the node drained: "job not ending with signals")
    inner = ("set -e; ip link set lo up; ip addr add 127.0.0.2/8 dev lo; mkdir -p /run/munge; "
             'mount --bind "$SPECBENCH_CLUSTER_MUNGE" /run/munge; set +e; "$@"; exit $?')
    munge = Path(tempfile.mkdtemp(prefix="specbench-munge-"))
    env = {**os.environ, ISOLATED_ENV: "1", "SPECBENCH_CLUSTER_MUNGE": str(munge)}
    cmd = ["unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "bash", "-c", inner, "bash",
           sys.executable, "-m", "specbench.cluster", *argv]
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        shutil.rmtree(munge, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m specbench.cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="start the cluster, run CMD against it (SLURM_CONF set), stop it; exit with CMD's")
    r.add_argument("--dir", type=Path, default=None, help="the cluster's directory (default: a fresh temporary one)")
    r.add_argument("--no-isolate", action="store_true", help="run in this machine's namespaces (no unshare)")
    r.add_argument("--keep", action="store_true", help="keep the cluster's directory (logs) after it stops")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("run needs a command after --")
    try:
        ensure_installed()
        if not args.no_isolate and os.environ.get(ISOLATED_ENV) != "1":
            sys.exit(isolate(argv))
        root = args.dir or Path(tempfile.mkdtemp(prefix="specbench-slurm-"))
        # isolated: munged's socket at the default path, /run/munge (a bind mount of a private directory)
        munge = Path("/run/munge") if os.environ.get(ISOLATED_ENV) == "1" else None
        start = time.monotonic()
        with running(root, munge_dir=munge) as cluster:
            print(f"cluster: {CLUSTER_NAME} up in {time.monotonic() - start:.0f} s ({cluster.cpus} CPUs, "
                  f"{cluster.memory_mb} MB, SLURM_CONF={cluster.conf})", file=sys.stderr, flush=True)
            rc = subprocess.run(command, env=cluster.env()).returncode
        if not args.keep and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
        sys.exit(rc)
    except SpecbenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
