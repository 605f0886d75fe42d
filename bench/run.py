"""Every benchmark, one command: a table of ratios, each against its floor measured in the same run.

    bench/setup.sh                                   # once: installs wrk (idempotent)
    .venv/bin/python -m bench.run                    # all of them (~40 min); writes docs/benchmarks.md
    .venv/bin/python -m bench.run --only launch api  # some; the other sections of the doc are kept
    .venv/bin/python -m bench.run --smoke            # the short version CI runs (~2 min), writes
                                                     # test-artifacts/bench/smoke/ only

Each benchmark runs as its own process (a crash or a hang of one never takes the others down),
in this order:

| name | what | its floor |
| --- | --- | --- |
| trainer | bench/trainer_vs_seed.py: builtin trainer samples/s | a seed-style hand loop |
| launch | bench/launch.py: POST -> first step, whole job, throughput | torchrun by hand |
| warm_launch | bench/warm_launch.py: POST -> first step warm, cold; a 20-trial sweep | torchrun by hand |
| sandbox | bench/sandbox.py: first step and throughput in the ranks' sandbox | the product unsandboxed |
| api | bench/api.py: GET/POST req/s and latency with wrk; list on 100k jobs | bare FastAPI; first page |
| submit | bench/submit.py: POST /v1/jobs, 1 and 2 API processes | bare POST; POST + the INSERTs |
| metrics | bench/metrics_read.py: GET a job's metrics, 100k points of 20 names | bare FastAPI, same bytes |
| scheduler | bench/scheduler.py: placement rate; freed GPU -> scheduled | plan() in memory |
| sweep | bench/sweep.py: a 1,000-point sweep's POST; the pass with it queued | 1,000 POSTs; plain queue |
| asha | bench/asha.py: a 9-child sweep's GPU-seconds with ASHA early stopping | the grid run to its end |
| scale | bench/scale.py: simulated hosts to 1,000; writes docs/scaling.md | none (a curve) |
| events | bench/event_stream.py: SSE lag at 1/50/200 streams; ingestion writes | 1 stream; reports/s |
| checkpoint | bench/checkpoint_download.py: 1 GiB download, RSS | fastest plain server |
| fsdp-checkpoint | bench/fsdp_checkpoint.py: fsdp stall per async DCP save | sync dcp.save; none |
| folder-checkpoint | bench/folder_checkpoint.py: 1 GiB from 2 nodes to listed; download | cp -r; disk read |
| mesh | bench/mesh.py: a routed 2-node DDP job's throughput and first step | the hosts' network |

No timing target is ever asserted: the command fails only when a benchmark itself fails (a
crash, a timeout, a stream that missed events). Targets are printed next to the ratios.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO, fmt_range, machine, utc_now

DOC = REPO / "docs" / "benchmarks.md"
DOC_JSON = REPO / "docs" / "benchmarks.json"
ARTIFACTS = REPO / "test-artifacts" / "bench"
PY = sys.executable


def given(
    median: float | None, lo: float | None = None, hi: float | None = None, n: int = 1
) -> dict[str, Any]:
    return {"median": median, "min": lo, "max": hi, "n": n}


def _num(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").lstrip("+"))
    except ValueError:
        return None
    return None if value != value else value  # NaN


# ------------------------------------------------------------------------------------------ parsers
# The three benchmarks written for their own issues print tables, not JSON. Their tables are
# read here leniently: a figure that cannot be found is left out with a note, and the whole
# output always goes into the document.


def parse_trainer(out: str) -> dict[str, Any]:
    runs = re.search(r"(\d+) runs each", out)
    n = int(runs.group(1)) if runs else 1
    batch = re.search(r"^cnn on synthetic.*$", out, re.MULTILINE)
    knobs = re.search(r"amp=(\w+), compile=(\w+)", out)
    setup = "torchrun, cpu"
    if knobs and knobs.group(1) != "None":
        setup += f", amp {knobs.group(1)}"
    if knobs and knobs.group(2) == "True":
        setup += ", compile"
    figs = []
    for m in re.finditer(
        r"^(single|ddp x\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s*$", out, re.MULTILINE
    ):
        figs.append(
            {
                "measure": f"trainer samples/s, {m.group(1)}",
                "setup": setup,
                "unit": "samples/s",
                "service": given(_num(m.group(2)), n=n),
                "floor_name": "seed-style hand loop, the same knobs",
                "floor": given(_num(m.group(3)), n=n),
                "ratio": given(_num(m.group(4)), _num(m.group(5)), _num(m.group(6)), n),
                "target": ">= 1.0",
                "note": "",
            }
        )
    return {
        "title": "The builtin trainer against a hand-written loop in the seed's style",
        "figures": figs,
        "notes": [batch.group(0)] if batch else [],
    }


LAG_ROW = re.compile(
    r"^(?P<setup>\S.*?)\s+(?P<streams>\d+)\s+(?P<events>\d+)\s+(?P<complete>\d+)/(?P<of>\d+)\s+"
    r"(?P<p50>[\d.]+|nan)\s+(?P<p95>[\d.]+|nan)\s+(?P<max>[\d.]+|nan)\s+"
    r"(?P<p99>[\d.]+|nan)\s+(?P<stored50>[\d.]+|nan)\s+(?P<stored99>[\d.]+|nan)\s*$",
    re.MULTILINE,
)


def _stored_target(setup: str, streams: int) -> str:
    """Issue 26's targets for the stored event -> client p99."""
    if not setup.startswith("PostgreSQL"):
        return "< 0.3"
    return {50: "< 0.1", 200: "< 0.25"}.get(streams, "")


def parse_events(out: str) -> dict[str, Any]:
    figs = []
    rows = [m.groupdict() for m in LAG_ROW.finditer(out)]
    single = {r["setup"]: _num(r["p50"]) for r in rows if r["streams"] == "1"}
    for r in rows:
        n = int(r["streams"])
        floor = single.get(r["setup"]) if n > 1 else None
        p50 = _num(r["p50"])
        figs.append(
            {
                "measure": f"event lag p50, {n} stream{'s' if n > 1 else ''}",
                "setup": r["setup"],
                "unit": "s",
                "service": given(p50, n=int(r["events"])),
                "floor_name": "the same with 1 stream" if floor else "",
                "floor": given(floor) if floor else None,
                "ratio": given(p50 / floor) if floor and p50 is not None else None,
                "target": "< 0.15 s" if r["setup"].startswith("PostgreSQL") else "",
                "target_on": "service",
                "note": f"p95 {r['p95']} s, p99 {r['p99']} s, max {r['max']} s; "
                f"{r['complete']}/{r['of']} streams got every event",
            }
        )
        stored99 = _num(r["stored99"])
        figs.append(
            {
                "measure": f"event lag p99 from the stored event, {n} stream{'s' if n > 1 else ''}",
                "setup": r["setup"],
                "unit": "s",
                "service": given(stored99, n=int(r["events"])),
                "floor_name": "",
                "floor": None,
                "ratio": None,
                "target": _stored_target(r["setup"], n),
                "note": f"p50 {r['stored50']} s; from the event's `ts` (stored) to the client",
            }
        )
    commits = re.search(r"^\s*commits\s+([\d.]+)\s+([\d.]+)", out, re.MULTILINE)
    stored = re.search(r"reports stored:\s*(\d+) in ([\d.]+) s", out)
    rows_written = re.search(r"^\s*all rows written\s+([\d.]+)", out, re.MULTILINE)
    if commits:
        rate = int(stored.group(1)) / float(stored.group(2)) if stored else 100.0
        value = float(commits.group(1))
        figs.append(
            {
                "measure": "ingestion: database commits/s per reports/s",
                "setup": "PostgreSQL + Redis",
                "unit": "/s",
                "service": given(value),
                "floor_name": "progress reports/s written by the rank",
                "floor": given(rate),
                "ratio": given(value / rate) if rate else None,
                "target": "",
                "note": (f"{rows_written.group(1)} rows written/s; " if rows_written else "")
                + "ratio = commits per report (batched ingestion < 1)",
            }
        )
    return {
        "title": "Event streams: lag to SSE clients, and what ingestion costs the database",
        "figures": figs,
        "notes": ["lag figures are percentiles over every event of one job (n = events), not runs"],
    }


def parse_checkpoint(out: str) -> dict[str, Any]:
    rounds_m = re.search(r"(\d+) round\(s\)", out)
    rounds = int(rounds_m.group(1)) if rounds_m else 1
    size = re.search(r"checkpoint (\d+) MiB", out)
    servers = []
    for m in re.finditer(
        r"^\|\s*([^|]+?)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|\s*([\d.]+)\s*\|", out, re.MULTILINE
    ):
        servers.append((m.group(1), float(m.group(2)), float(m.group(3))))
    api = next((s for s in servers if s[0].startswith("torchjobs")), None)
    plain = [s for s in servers if not s[0].startswith("torchjobs")]
    figs: list[dict[str, Any]] = []
    label = f"{size.group(1)} MiB" if size else ""
    if api and plain:
        fastest = max(plain, key=lambda s: s[1])
        figs.append(
            {
                "measure": f"checkpoint download {label}",
                "setup": "SQLite, file storage",
                "unit": "MB/s",
                "service": given(api[1], None, api[2], rounds),
                "floor_name": f"fastest plain: {fastest[0]}",
                "floor": given(fastest[1], None, fastest[2], rounds),
                "ratio": given(api[1] / fastest[1]),
                "target": ">= 0.8",
                "note": "max = best round",
            }
        )
    for what, pattern in (("download", r"during the downloads"), ("upload", r"during the upload[^|]*")):
        rss = re.search(
            rf"^\|\s*{pattern}\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*([+-]?\d+)\s*\|", out, re.MULTILINE
        )
        if rss:
            figs.append(
                {
                    "measure": f"API server RSS growth during the {label} {what}",
                    "setup": "SQLite, file storage",
                    "unit": "MB",
                    "service": given(float(rss.group(3))),
                    "floor_name": "",
                    "floor": None,
                    "ratio": None,
                    "target": "< 100",
                    "note": f"{rss.group(1)} MB before, {rss.group(2)} MB peak",
                }
            )
    return {
        "title": "Checkpoint download against plain ways to serve the same file; server memory",
        "figures": figs,
        "notes": [],
    }


# ------------------------------------------------------------------------------------------ registry


@dataclass
class Bench:
    name: str
    full: list[str]
    smoke: list[str]
    parse: Callable[[str], dict[str, Any]] | None = None  # None: the module writes --json
    timeout_full: float = 3600
    timeout_smoke: float = 300
    extra: dict[str, Any] = field(default_factory=dict)


BENCHMARKS = [
    Bench(
        "trainer",
        [PY, "bench/trainer_vs_seed.py"],
        [
            PY,
            "bench/trainer_vs_seed.py",
            "--runs",
            "1",
            "--epochs",
            "2",
            "--modes",
            "single",
            "--synthetic-size",
            "512",
        ],
        parse_trainer,
    ),
    *(
        Bench(
            f"trainer-{knob}",
            [PY, "bench/trainer_vs_seed.py", *args],
            [PY, "bench/trainer_vs_seed.py", *args, "--runs", "1", "--epochs", "1", "--modes", "single"]
            + ["--synthetic-size", "512"],
            parse_trainer,
        )
        for knob, args in (("bf16", ["--amp", "bf16"]), ("compile", ["--compile", "--runs", "3"]))
    ),
    Bench("launch", [PY, "-m", "bench.launch"], [PY, "-m", "bench.launch", "--smoke"]),
    Bench("warm_launch", [PY, "-m", "bench.warm_launch"], [PY, "-m", "bench.warm_launch", "--smoke"]),
    Bench("sandbox", [PY, "-m", "bench.sandbox"], [PY, "-m", "bench.sandbox", "--smoke"]),
    Bench("environment", [PY, "-m", "bench.environment"], [PY, "-m", "bench.environment", "--smoke"]),
    Bench("api", [PY, "-m", "bench.api"], [PY, "-m", "bench.api", "--smoke"]),
    Bench("submit", [PY, "-m", "bench.submit"], [PY, "-m", "bench.submit", "--smoke"]),
    Bench("metrics", [PY, "-m", "bench.metrics_read"], [PY, "-m", "bench.metrics_read", "--smoke"]),
    Bench("scheduler", [PY, "-m", "bench.scheduler"], [PY, "-m", "bench.scheduler", "--smoke"]),
    Bench("sweep", [PY, "-m", "bench.sweep"], [PY, "-m", "bench.sweep", "--smoke"]),
    Bench(
        "asha",
        [PY, "-m", "bench.asha"],
        [PY, "-m", "bench.asha", "--smoke"],
        timeout_full=1800,
        timeout_smoke=600,
    ),
    Bench(
        "resize",
        [PY, "-m", "bench.resize"],
        [PY, "-m", "bench.resize", "--smoke"],
        timeout_full=1800,
        timeout_smoke=900,
    ),
    Bench(
        "scale",
        [PY, "-m", "bench.scale", "--doc", "docs/scaling.md"],
        [PY, "-m", "bench.scale", "--smoke"],
    ),
    Bench("events", [PY, "bench/event_stream.py"], [PY, "bench/event_stream.py", "--smoke"], parse_events),
    Bench(
        "checkpoint",
        [PY, "bench/checkpoint_download.py"],
        [PY, "bench/checkpoint_download.py", "--size", "16MiB", "--rounds", "1"],
        parse_checkpoint,
    ),
    Bench(
        "fsdp-checkpoint",
        [PY, "-m", "bench.fsdp_checkpoint"],
        [PY, "-m", "bench.fsdp_checkpoint", "--smoke"],
    ),
    Bench(
        "folder-checkpoint",
        [PY, "-m", "bench.folder_checkpoint"],
        [PY, "-m", "bench.folder_checkpoint", "--smoke"],
    ),
    Bench("mesh", [PY, "-m", "bench.mesh"], [PY, "-m", "bench.mesh", "--smoke"], timeout_smoke=600),
]
NAMES = [b.name for b in BENCHMARKS]


def shown(argv: list[str]) -> str:
    return shlex.join([".venv/bin/python" if a == PY else a for a in argv])


def run_one(bench: Bench, smoke: bool, logs: Path) -> dict[str, Any]:
    argv = list(bench.smoke if smoke else bench.full)
    json_path = logs / f"{bench.name}.json"
    if bench.parse is None:
        json_path.unlink(missing_ok=True)
        argv += ["--json", str(json_path)]
    timeout = bench.timeout_smoke if smoke else bench.timeout_full
    print(f"\n=== {bench.name}: {shown(argv)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    out_path, err_path = logs / f"{bench.name}.out", logs / f"{bench.name}.err"
    rc = _run_logged(bench.name, argv, timeout, out_path, err_path)
    seconds = time.monotonic() - started
    stdout = out_path.read_text(errors="replace")
    entry: dict[str, Any] = {
        "name": bench.name,
        "command": shown(bench.smoke if smoke else bench.full),
        "seconds": seconds,
        "date": utc_now(),
        "status": "ok" if rc == 0 else ("timeout" if rc == "timeout" else f"failed (exit {rc})"),
        "output": stdout[-6000:],
    }
    result = _figures_of(bench, stdout, json_path)
    if entry["status"] == "ok" and not result["figures"]:
        result["notes"].append("no figures found in the output (see the output below)")
    if entry["status"] != "ok":
        entry["error_tail"] = err_path.read_text(errors="replace")[-3000:]
    entry.update(result)
    print(f"=== {bench.name}: {entry['status']} in {seconds:.0f} s", file=sys.stderr, flush=True)
    return entry


def _run_logged(name: str, argv: list[str], timeout: float, out_path: Path, err_path: Path) -> int | str:
    """Run `argv` with its stdout to `out_path` and its stderr both to `err_path` and, prefixed with
    `name`, to ours; its exit code, or "timeout" when it (and its process group) had to be stopped."""
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.PIPE, start_new_session=True)

        def tee() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                err.write(line)
                err.flush()
                sys.stderr.write(f"  [{name}] {line.decode(errors='replace')}")
                sys.stderr.flush()

        pump = threading.Thread(target=tee, daemon=True)
        pump.start()
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            import os
            import signal

            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = "timeout"
        pump.join(timeout=10)
    return rc


def _figures_of(bench: Bench, stdout: str, json_path: Path) -> dict[str, Any]:
    """The benchmark's title, figures and notes: parsed from its output, or from the JSON it wrote."""
    try:
        if bench.parse is not None:
            return bench.parse(stdout)
        if json_path.exists():
            result: dict[str, Any] = json.loads(json_path.read_text())
            result.pop("raw", None)
            return result
        return {"title": bench.name, "figures": [], "notes": []}
    except Exception as exc:  # a parse problem is reported, never fatal
        return {"title": bench.name, "figures": [], "notes": [f"could not read the figures: {exc!r}"]}


# ------------------------------------------------------------------------------------------ output


def target_met(fig: dict[str, Any], smoke: bool = False) -> str:
    if smoke:
        return "–"
    m = re.match(r"\s*(<=|>=|<|>)\s*([\d.]+)", fig.get("target") or "")
    # A target is on the ratio, unless the figure has no floor or says it is on the value itself
    basis = fig["service"] if fig.get("target_on") == "service" else fig.get("ratio")
    basis = basis or (fig["service"] if not fig.get("floor") else None)
    if not m or not basis or basis.get("median") is None:
        return ""
    value, bound = basis["median"], float(m.group(2))
    ok = {"<=": value <= bound, ">=": value >= bound, "<": value < bound, ">": value > bound}[m.group(1)]
    return "yes" if ok else "**no**"


def summary_rows(entries: list[dict[str, Any]], smoke: bool = False) -> list[list[str]]:
    rows = []
    for e in entries:
        if e["status"] != "ok" and not e.get("figures"):
            rows.append([e["name"], f"**{e['status']}**", "", "", "", "", "", ""])
        for f in e.get("figures", []):
            rows.append(
                [
                    e["name"],
                    f["measure"],
                    f["setup"],
                    fmt_range(f["service"], f["unit"]),
                    (f"{fmt_range(f['floor'], f['unit'])}: {f['floor_name']}" if f.get("floor") else "–"),
                    fmt_range(f["ratio"]) if f.get("ratio") else "–",
                    f.get("target") or "",
                    target_met(f, smoke),
                ]
            )
    return rows


BEGIN = "<!-- generated by `python -m bench.run`: everything down to the end marker is rewritten -->"
END = "<!-- end of the generated part -->"
HEAD = ["bench", "measure", "setup", "torchjobs", "floor", "ratio", "target", "met"]


def md_table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(entries: list[dict[str, Any]], smoke: bool) -> None:
    rows = [HEAD, *summary_rows(entries, smoke)]
    rows = [[c.replace("**", "") for c in r] for r in rows]
    rows = [
        [
            r[0],
            r[1],
            r[2],
            r[3],
            r[4].split(": ")[0].split(" (")[0] if r[4] != "–" else r[4],
            r[5],
            r[6],
            r[7],
        ]
        for r in rows
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    print()
    for i, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))


def render(entries: list[dict[str, Any]], info: dict[str, Any], command: str, smoke: bool) -> str:
    m = info["machine"]
    busy = [float(x) for x in m["loadavg"]]
    noisy = max(busy or [0]) > 0.5 * (m["nproc"] or 1)
    out = [
        BEGIN,
        "## Every benchmark, one command: `bench.run`"
        + (" (smoke run: not figures to quote)" if smoke else ""),
        "",
        f"Written by `{command}` on {info['date']}"
        + (" (sections keep their own dates)" if info["merged"] else "")
        + ". Regenerate with `bench/setup.sh && .venv/bin/python -m bench.run`; `--only NAME...` reruns some "
        "and keeps the other sections.",
        "",
        "Every figure is the median of several runs with the min and max in brackets, unless its note says "
        "otherwise; every ratio is torchjobs against a floor measured in the same run, on the same machine "
        "(per pair of runs where runs pair up). Targets are shown, never asserted.",
        "",
        "### Machine",
        "",
        md_table(
            ["nproc", "memory", "CPU", "kernel", "Python", "torch", "PostgreSQL", "Redis", "wrk", "commit"],
            [
                [
                    str(m["nproc"]),
                    f"{m['memory_gib']} GiB",
                    m["cpu"],
                    m["kernel"],
                    m["python"],
                    m["torch"],
                    m["postgresql"],
                    m["redis"],
                    m["wrk"],
                    m["commit"],
                ]
            ],
        ),
        "",
        f"Load average at the start: {' / '.join(m['loadavg'])} (1, 5, 15 min); at the end: "
        f"{' / '.join(info['loadavg_end'])}.",
    ]
    if noisy:
        out += [
            "",
            "**The machine was shared with other work while this ran** (load average above half the "
            "cores): absolute figures and the ratios are noisy; rerun on an idle machine before quoting "
            "them.",
        ]
    out += ["", "### Summary", "", md_table(HEAD, summary_rows(entries, smoke))]
    for e in entries:
        out += ["", f"### {e['name']}: {e.get('title', '')}", ""]
        out += [f"`{e['command']}` — {e['status']}, {e['seconds']:.0f} s, {e['date']}."]
        if e.get("figures"):
            out += [
                "",
                md_table(
                    ["measure", "setup", "torchjobs", "floor", "ratio", "target", "note"],
                    [
                        [
                            f["measure"],
                            f["setup"],
                            fmt_range(f["service"], f["unit"])
                            + (f" (n={f['service']['n']})" if f["service"].get("n") else ""),
                            f"{fmt_range(f['floor'], f['unit'])}: {f['floor_name']}"
                            if f.get("floor")
                            else "–",
                            fmt_range(f["ratio"]) if f.get("ratio") else "–",
                            f.get("target") or "",
                            f.get("note") or "",
                        ]
                        for f in e["figures"]
                    ],
                ),
            ]
        if e.get("details"):
            out += ["", e["details"]]
        for note in e.get("notes", []):
            out += ["", f"- {note}"]
        if e.get("error_tail"):
            out += ["", "Error output (tail):", "", "```text", e["error_tail"].strip(), "```"]
        if e.get("output") and e["name"] in ("trainer", "events", "checkpoint"):
            out += [
                "",
                "<details><summary>its output</summary>",
                "",
                "```text",
                e["output"].strip(),
                "```",
                "",
                "</details>",
            ]
    return "\n".join([*out, END]) + "\n"


def place_in_doc(existing: str | None, block: str) -> str:
    """The generated block replaces its previous self; whatever else the document holds (the
    benchmarks' own write-ups) is kept. A document without the block gets it after its title."""
    if not existing:
        return f"# Benchmarks\n\n{block}"
    if BEGIN in existing and END in existing:
        head, rest = existing.split(BEGIN, 1)
        return head + block.rstrip("\n") + rest.split(END, 1)[1]
    lines = existing.split("\n")
    if lines and lines[0].startswith("# "):
        rest = "\n".join(lines[1:]).lstrip("\n")
        return f"{lines[0]}\n\n{block.rstrip()}\n\n{rest}".rstrip("\n") + "\n"
    return f"{block}\n{existing}"


# ------------------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--smoke", action="store_true", help="the short CI version; writes test-artifacts/bench/smoke/"
    )
    parser.add_argument(
        "--only", nargs="+", choices=NAMES, metavar="NAME", help=f"some of: {', '.join(NAMES)}"
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite docs/benchmarks.md from docs/benchmarks.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        saved = json.loads(DOC_JSON.read_text())
        saved_run = saved["run"]
        DOC.write_text(
            place_in_doc(DOC.read_text(), render(saved["benchmarks"], saved_run, saved_run["command"], False))
        )
        print(f"rewrote {DOC.relative_to(REPO)}")
        return 0
    command = ".venv/bin/python -m bench.run" + (" --smoke" if args.smoke else "")
    if args.only:
        command += " --only " + " ".join(args.only)

    out_dir = ARTIFACTS / ("smoke" if args.smoke else "full")
    logs = out_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"date": utc_now(), "machine": machine(), "command": command, "merged": False}
    started = time.monotonic()
    entries = [run_one(b, args.smoke, logs) for b in BENCHMARKS if not args.only or b.name in args.only]
    info["loadavg_end"] = Path("/proc/loadavg").read_text().split()[:3]
    info["seconds"] = time.monotonic() - started

    doc, doc_json = (
        (out_dir / "benchmarks.md", out_dir / "benchmarks.json") if args.smoke else (DOC, DOC_JSON)
    )
    all_entries = entries
    if args.only and doc_json.exists():  # keep the sections not rerun
        previous = {e["name"]: e for e in json.loads(doc_json.read_text()).get("benchmarks", [])}
        fresh = {e["name"]: e for e in entries}
        all_entries = [fresh.get(n) or previous[n] for n in NAMES if n in fresh or n in previous]
        info["merged"] = len(all_entries) > len(entries)
    doc.parent.mkdir(parents=True, exist_ok=True)
    existing = doc.read_text() if doc.exists() and not args.smoke else None
    doc.write_text(place_in_doc(existing, render(all_entries, info, command, args.smoke)))
    doc_json.write_text(json.dumps({"run": info, "benchmarks": all_entries}, indent=2, default=str))

    print_table(entries, args.smoke)
    print(f"\n{len(entries)} benchmark(s) in {info['seconds']:.0f} s; wrote {doc.relative_to(REPO)}")
    failed = [e["name"] for e in entries if e["status"] != "ok"]
    if failed:
        print(f"FAILED: {', '.join(failed)} (logs in {logs.relative_to(REPO)})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
