"""What a multi-node job's own network costs (issue #35): a 2-node DDP job's throughput and
POST -> first step with each node in its own network namespace, meshed across two hosts
(`TORCHJOBS_JOB_NETWORK=routed`, and the default `private`: workers/node_mesh.py), against
the same job on the hosts' own network (`TORCHJOBS_JOB_NETWORK=host`), in the same run.

    .venv/bin/python -m bench.mesh            # ~12 min on an idle machine
    .venv/bin/python -m bench.mesh --smoke    # one job each: the code path only

Six "hosts" (network namespaces on one bridge, service/testing/netns.py), a pair per side,
one one-slot worker each, under one production stack; the pairs not measured are drained
while the other runs, and the order of the sides turns every round. On this machine all
pairs share two cores and one kernel: what the figure shows is the cost of the veths, the
routes and the nftables rules on the path, not of a real NIC.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlparse

from bench.common import REPO, figure, print_figures, production_stack, workdir, write_result
from bench.launch import long_job, run_service
from service.testing import harness
from service.testing.netns import Network

SIDES = {"routed": ("ra", "rb"), "private": ("pa", "pb"), "host network": ("ha", "hb")}
# each side's workers: the routed pair with job subnets its admin gave; the private pair (the
# default) with the control plane's, from a pool no job of this machine's own uses (the bridge
# between the namespaces crosses the root namespace, whose walls would masquerade 10.213/16);
# the floor on the hosts' own network
NETWORKS = {
    "routed": {"TORCHJOBS_JOB_NETWORK": "routed"},
    "private": {"TORCHJOBS_JOB_NETWORK": "private", "TORCHJOBS_JOB_SUBNET_POOL": "10.242.0.0/16"},
    "host network": {"TORCHJOBS_JOB_NETWORK": "host"},
}


@contextmanager
def hosts(stack: harness.Stack) -> Iterator[None]:
    """The six hosts, a worker on each, in three pairs: routed, private, the hosts' network."""
    net = Network(tag="bm")
    net.up()
    try:
        db = urlparse(stack.env["TORCHJOBS_DATABASE_URL"])
        broker = urlparse(stack.env["TORCHJOBS_BROKER_URL"])
        pg, redis = net.forward(db.port or 5432), net.forward(broker.port or 6379)
        env = {
            "TORCHJOBS_DATABASE_URL": f"postgresql://{db.username}@{net.gateway}:{pg}{db.path}",
            "TORCHJOBS_BROKER_URL": f"redis://{net.gateway}:{redis}{broker.path}",
            "GLOO_SOCKET_IFNAME": "tj0",
        }
        for side, names in SIDES.items():
            for index, name in enumerate(names):
                address = net.add_host(name)
                extra = {**env, **NETWORKS[side]}
                if side == "routed":
                    extra["TORCHJOBS_JOB_SUBNET"] = f"10.241.{index}.0/24"
                stack.start_worker(name, 1, address=address, extra_env=extra, netns=net.namespace(name))
        yield
    finally:
        stack.stop()  # the workers first: their namespaces go next
        net.down()


def only(stack: harness.Stack, side: str) -> None:
    with stack.client() as c:
        for other, names in SIDES.items():
            for name in names:
                c.post(f"/v1/workers/{name}/{'readmit' if other == side else 'drain'}").raise_for_status()


def measure(rounds: int, spec: dict[str, Any], timeout: float) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    with (
        workdir("tj-bench-mesh-", keep_on_error=REPO / "test-artifacts" / "bench" / "mesh") as scratch,
        production_stack(scratch / "stack", {}) as (stack, _),
        hosts(stack),
    ):
        for i in range(rounds):
            order = list(SIDES)[i % 3 :] + list(SIDES)[: i % 3]
            for side in order:
                only(stack, side)
                try:
                    runs[side].append(run_service(stack, spec, timeout))
                except Exception as exc:  # recorded; the other runs go on
                    runs[side].append({"error": str(exc)[-1500:]})
                print(f"  round {i + 1} {side}: {runs[side][-1]}", file=sys.stderr, flush=True)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="one short job each")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    args = parser.parse_args(argv)
    spec = long_job("ddp", 4096 if args.smoke else 16384, 2)
    spec.update(name="bench-mesh", nodes=2, gpus_per_node=1)
    runs = measure(1 if args.smoke else args.rounds, spec, args.timeout)
    ok = {side: [r for r in rs if "error" not in r] for side, rs in runs.items()}
    setup = "ddp 2 nodes x 1, two hosts (netns)"
    floor_name = "the same job on the hosts' network"
    figures = []
    for side in ("routed", "private"):
        figures += [
            figure(
                f"2-node DDP throughput, {side} mesh",
                "samples/s",
                [r["samples_per_sec"] for r in ok[side] if r["samples_per_sec"]],
                [r["samples_per_sec"] for r in ok["host network"] if r["samples_per_sec"]],
                setup=setup,
                floor_name=floor_name,
                target="near 1",
            ),
            figure(
                f"2-node DDP POST -> first step, {side} mesh",
                "s",
                [r["first_step_s"] for r in ok[side] if r["first_step_s"]],
                [r["first_step_s"] for r in ok["host network"] if r["first_step_s"]],
                setup=setup,
                floor_name=floor_name,
            ),
        ]
    result = {
        "name": "mesh",
        "title": "A multi-node job's own network (routed, private): its cost against the hosts' network",
        "figures": figures,
        "notes": [f"{side}: {r['error'][-300:]}" for side, rs in runs.items() for r in rs if "error" in r],
        "raw": runs,
    }
    write_result(args.json, result)
    print_figures(result)
    return 1 if any(len(ok[s]) < len(runs[s]) for s in runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
