"""Checkpoint download throughput through the API against plain ways to serve the same file,
and the API server's peak RSS while it serves a download and while it takes an upload.

    .venv/bin/python bench/checkpoint_download.py                 # 1 GiB, 3 rounds (~2-3 min)
    .venv/bin/python bench/checkpoint_download.py --size 64MiB --rounds 1   # a smoke run

What runs, all on loopback, one request at a time:

1. a real `torchjobs server` (SQLite, file:// storage) in its own process;
2. a checkpoint of --size bytes written with torch.save, uploaded with `POST /v1/checkpoints`
   (streamed from disk by the client) while the server's RSS is sampled every 5 ms;
3. the stored file downloaded through `GET /v1/checkpoints/{id}/download`, and the very same
   file from plain servers started by this script with the same uvicorn defaults as
   `torchjobs server`: Starlette's `FileResponse` (its default 64 KiB chunks, and 1 MiB), a
   `StreamingResponse` of 1 MiB chunks read in a worker thread, and `python -m http.server`.

The client is the same for every target: a raw socket reading into a 4 MiB buffer, which costs
far less CPU than any server here, so the numbers compare the servers. Every round takes every target,
each round starting one further along, so drift in a shared machine's speed hits all alike; each
target's best and median over the rounds are reported, and the API's median against the
fastest plain median. On a shared machine wall-clock speed swings with the neighbours' load;
the CPU seconds each server process spent per GB sent (from /proc) swing far less, and say
what each way of serving costs.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "tj_bench_admin_token_0123456789abcdef"
MiB = 1024 * 1024

PLAIN_APP = textwrap.dedent(
    """
    import os, sys
    import anyio.to_thread, uvicorn
    from starlette.applications import Starlette
    from starlette.responses import FileResponse, StreamingResponse
    from starlette.routing import Route

    PATH = sys.argv[1]
    CHUNK = 1024 * 1024

    class FileResponse1M(FileResponse):
        chunk_size = CHUNK

    async def file_default(request):
        return FileResponse(PATH)

    async def file_1m(request):
        return FileResponse1M(PATH)

    async def stream_1m(request):
        async def chunks():
            fh = await anyio.to_thread.run_sync(open, PATH, "rb")
            try:
                while chunk := await anyio.to_thread.run_sync(fh.read, CHUNK):
                    yield chunk
            finally:
                fh.close()
        size = os.path.getsize(PATH)
        return StreamingResponse(chunks(), headers={"Content-Length": str(size)},
                                 media_type="application/octet-stream")

    app = Starlette(routes=[Route("/file", file_default), Route("/file-1m", file_1m),
                            Route("/stream-1m", stream_1m)])
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning", access_log=False)
    """
)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r}")
    unit = (m.group(2) or "B").upper()[0]
    return int(float(m.group(1)) * {"B": 1, "K": 1024, "M": MiB, "G": 1024 * MiB}[unit])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=2)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(url)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_mb(pid: int, field: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


def rss_mb(pid: int) -> float:
    return _status_mb(pid, "VmRSS")


@contextmanager
def peak_rss(pid: int) -> Iterator[dict[str, float]]:
    """The process's RSS before the block and its peak during it, in MB.

    The peak is the kernel's own high-water mark (VmHWM, reset through /proc/PID/clear_refs),
    so nothing samples while the transfer runs: a sampling thread in this process would take
    the GIL from the client and slow exactly the transfers it watches. Where the reset is not
    allowed, a sampling thread it is.
    """
    result = {"before": rss_mb(pid), "peak": 0.0}
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                result["peak"] = max(result["peak"], rss_mb(pid))
                stop.wait(0.005)

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield result
        finally:
            stop.set()
            thread.join()
            result["peak"] = max(result["peak"], rss_mb(pid))
        return
    yield result
    result["peak"] = _status_mb(pid, "VmHWM")


def fetch(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, float]:
    """GET over a raw socket; (body bytes, seconds from request to last byte)."""
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    buf = bytearray(4 * MiB)
    view = memoryview(buf)
    with socket.create_connection(("127.0.0.1", port)) as s:
        start = time.perf_counter()
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            n = s.recv_into(view)
            if not n:
                raise ConnectionError("closed before headers")
            head += bytes(view[:n])
        head, _, rest = head.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            raise RuntimeError(f"{path}: HTTP {status}: {head[:200]!r}")
        length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
        got = len(rest)
        while got < length:
            n = s.recv_into(view)
            if not n:
                raise ConnectionError(f"closed after {got} of {length} bytes")
            got += n
        return got, time.perf_counter() - start


def write_checkpoint(path: Path, size: int) -> None:
    import torch

    n = max(1, size - 2048)  # the zip container adds a little
    torch.save({"state_dict": {"net": {"w": torch.ones(n, dtype=torch.uint8)}}, "epoch": 1, "step": 1}, path)


def upload(url: str, path: Path) -> tuple[dict, float]:
    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as fh:
            while chunk := fh.read(MiB):
                yield chunk

    start = time.perf_counter()
    resp = httpx.post(
        f"{url}/v1/checkpoints",
        params={"name": path.name},
        content=chunks(),
        headers={
            "Authorization": f"Bearer {TOKEN}",
            "Content-Type": "application/octet-stream",
            "Content-Length": str(path.stat().st_size),
        },
        timeout=None,
    )
    elapsed = time.perf_counter() - start
    resp.raise_for_status()
    return resp.json(), elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=parse_size, default=1024 * MiB, help="checkpoint size (default 1GiB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None, help="where the files go (default: a temp dir)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="tj-bench-", dir=args.workdir))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        home = work / "home"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHJOBS_")}
        env.update(
            TORCHJOBS_HOME=str(home),
            TORCHJOBS_ADMIN_TOKEN=TOKEN,
            TORCHJOBS_STORAGE_URL=f"file://{home / 'checkpoints'}",
            OMP_NUM_THREADS="1",
        )
        cli = [sys.executable, "-m", "service.cli.main"]
        subprocess.run([*cli, "db", "upgrade"], env=env, check=True, capture_output=True, cwd=ROOT)
        api_port = free_port()
        log = open(work / "server.log", "wb")  # noqa: SIM115 - lives as long as the server
        server = subprocess.Popen(
            [*cli, "server", "--port", str(api_port), "--no-scheduler"],
            env=env,
            stdout=log,
            stderr=log,
            cwd=ROOT,
        )
        procs.append(server)
        api = f"http://127.0.0.1:{api_port}"
        wait_http(f"{api}/healthz")

        source = work / "bench.pt"
        print(f"writing a {args.size / MiB:.0f} MiB checkpoint ...", file=sys.stderr)
        write_checkpoint(source, args.size)
        size = source.stat().st_size
        with peak_rss(server.pid) as up_rss:
            ckpt, up_s = upload(api, source)
        source.unlink()
        stored = next((home / "checkpoints" / "uploads").rglob("*"))
        while stored.is_dir():
            stored = next(stored.iterdir())

        plain_port, http_port = free_port(), free_port()
        plain_app = work / "plain_app.py"
        plain_app.write_text(PLAIN_APP)
        procs.append(
            subprocess.Popen([sys.executable, str(plain_app), str(stored), str(plain_port)], cwd=ROOT)
        )
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "http.server",
                    "-b",
                    "127.0.0.1",
                    "-d",
                    str(stored.parent),
                    str(http_port),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        wait_http(f"http://127.0.0.1:{plain_port}/file")
        wait_http(f"http://127.0.0.1:{http_port}/")

        auth = {"Authorization": f"Bearer {TOKEN}"}
        plain, files = procs[1], procs[2]
        targets: dict[str, tuple[int, Callable[[], tuple[int, float]]]] = {
            "torchjobs API /v1/checkpoints/{id}/download": (
                server.pid,
                lambda: fetch(api_port, f"/v1/checkpoints/{ckpt['id']}/download", auth),
            ),
            "Starlette FileResponse (default 64 KiB chunks)": (plain.pid, lambda: fetch(plain_port, "/file")),
            "Starlette FileResponse (1 MiB chunks)": (plain.pid, lambda: fetch(plain_port, "/file-1m")),
            "StreamingResponse, 1 MiB chunks": (plain.pid, lambda: fetch(plain_port, "/stream-1m")),
            "python -m http.server": (files.pid, lambda: fetch(http_port, f"/{stored.name}")),
        }
        speeds: dict[str, list[float]] = {name: [] for name in targets}
        cpu_per_gb: dict[str, list[float]] = {name: [] for name in targets}
        api_peak = 0.0
        api_before = rss_mb(server.pid)
        names = list(targets)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # each goes first in turn
                pid, run = targets[name]
                cpu0 = cpu_s(pid)
                if name.startswith("torchjobs"):
                    with peak_rss(server.pid) as dl_rss:
                        got, secs = run()
                    api_peak = max(api_peak, dl_rss["peak"])
                else:
                    got, secs = run()
                cpu_per_gb[name].append((cpu_s(pid) - cpu0) / (size / 1e9))
                assert got == size, (name, got, size)
                speeds[name].append(size / secs / 1e6)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)

        medians = {name: statistics.median(v) for name, v in speeds.items()}
        fastest_plain = max(v for k, v in medians.items() if not k.startswith("torchjobs"))
        print(f"\ncheckpoint {size / MiB:.0f} MiB, {args.rounds} round(s), {os.cpu_count()} CPUs\n")
        print("| server | median MB/s | best MB/s | median / fastest plain | server CPU s per GB |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for name, values in speeds.items():
            ratio = medians[name] / fastest_plain
            cpu = statistics.median(cpu_per_gb[name])
            print(f"| {name} | {medians[name]:.0f} | {max(values):.0f} | {ratio:.2f} | {cpu:.2f} |")
        print("\n| API server RSS (MB) | before | peak | growth |")
        print("| --- | ---: | ---: | ---: |")
        print(f"| during the downloads | {api_before:.0f} | {api_peak:.0f} | {api_peak - api_before:+.0f} |")
        print(
            f"| during the upload ({size / up_s / 1e6:.0f} MB/s, including validation) "
            f"| {up_rss['before']:.0f} | {up_rss['peak']:.0f} | {up_rss['peak'] - up_rss['before']:+.0f} |"
        )
        return 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
