"""keep-manager and keep-worker started as local processes from a build of this repository, for
tests and benchmarks (as the C++ integration tests start them: free ports, logs in a temp dir,
the bound addresses read from their "serving on" log lines).

    with LocalServices(worker=True) as svc:
        ManagerClient(svc.manager.endpoint) ...
"""
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]  # the checkout (editable install)


def bin_path(name):
    d = os.environ.get("KEEP_BIN_DIR") or str(ROOT / "build" / "bin")
    p = pathlib.Path(d) / name
    if not p.exists():
        raise FileNotFoundError(f"{p} (build it, or set KEEP_BIN_DIR)")
    return str(p)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, argv, tag, log_dir):
        self.tag = tag
        self.log = pathlib.Path(log_dir) / f"{tag}.{time.monotonic_ns()}.log"
        self._f = open(self.log, "wb")
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=self._f)
        self.endpoint = None

    def wait_ready(self, timeout=60.0):
        deadline = time.monotonic() + timeout
        mark = re.compile(re.escape(self.tag) + r": serving on ([^,;\s]+)")
        while time.monotonic() < deadline:
            m = mark.search(self.log.read_text(errors="replace"))
            if m:
                self.endpoint = m.group(1)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.tag} did not start:\n{self.log.read_text(errors='replace')}")

    def kill9(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._f.close()

    def terminate(self, timeout=30.0):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill9()
                return -1
            self._f.close()
            return code
        self._f.close()
        return self.proc.returncode


class LocalServices:
    """A manager (on `port`, or a free one) and optionally a worker attached to it. KEEP_BIN_DIR
    (else build/bin) holds the binaries; the models are the checkout's models/."""

    def __init__(self, worker=True, extra_manager=(), port=None, extra_worker=(), device="cpu",
                 model=None, shm_bytes="32MiB"):
        self.tmp = tempfile.mkdtemp(prefix="keep_local_")
        self.model = model or str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf")
        self.shm = f"keep_local_{os.getpid()}_{time.monotonic_ns() % 10**9}"
        self.port = port or free_port()
        self.shm_bytes = shm_bytes  # the manager's KV region: it holds every memory's entry
        self.extra_manager = list(extra_manager)
        self.manager = self.start_manager()
        self.worker = None
        if worker:
            self.worker = Daemon([
                bin_path("keep-worker"), "--endpoint", "tcp://127.0.0.1:0", "--metrics-listen",
                "off", "--manager", self.manager.endpoint, "--shm-name", self.shm, "--model",
                self.model, "--device", device, "--context", "2048", "--job-poll-ms", "20"]
                + list(extra_worker), "worker", self.tmp).wait_ready(120)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def start_manager(self):
        return Daemon([
            bin_path("keep-manager"), "--data-dir", os.path.join(self.tmp, "data"), "--endpoint",
            f"tcp://127.0.0.1:{self.port}", "--metrics-listen", "off", "--shm-name", self.shm,
            "--shm-bytes", self.shm_bytes, "--encoder", str(ROOT / "models/all-MiniLM-L6-v2"),
            "--model", self.model] + self.extra_manager,
            "manager", self.tmp).wait_ready()

    def close(self):
        for d in (self.worker, self.manager):
            if d is not None:
                d.kill9()
        try:
            os.unlink(f"/dev/shm/{self.shm}")
        except OSError:
            pass
        shutil.rmtree(self.tmp, ignore_errors=True)
