"""Transport speed and emulated-link fidelity of the multi-process real runtime.

    python benchmarks/bench_transport.py [--round-trips N] [--messages N] [--bytes B] [--out FILE]

Two workers (spawned, each pinned to its core with one thread; gloo on loopback), joined as the
two stages of a ``decentralized`` placement (``placement.nodes=2``):

1. bare round trip: a 32-byte message there and back, p50/p99 over ``--round-trips``, both
   through ``real.runtime.links.DistTransport`` (header + tensor, sender thread; no emulated delay) and
   with raw ``dist.send``/``dist.recv`` of the same tensor (what the transport adds);
2. emulated link at ``network=wan`` (20 ms, 1 Gb/s, 2 ms jitter): ``--messages`` one-way
   messages of ``--bytes`` bytes, one at a time (acknowledged, so none queues), delay measured
   on the shared clock (receive - send). Compared with the model's distribution
   (``testbed.links.LinkModel``: mean, p99) and with the model's own draws for exactly these
   messages (same seed: the part of the error the transport adds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from real.runtime.launch import launch  # noqa: E402
from real.runtime.links import Kind, Message  # noqa: E402
from real.runtime.worker import WorkerContext  # noqa: E402
from testbed.links import LinkDelays  # noqa: E402
from testbed.placement import make_placement  # noqa: E402
from tests.conftest import compose_exp  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def round_trips(ctx: WorkerContext, n: int) -> dict[str, list[float]]:
    first = ctx.info.group == "stage0"
    peer = ctx.placement.group("stage1" if first else "stage0").leader
    out = ctx.transport_to("stage1" if first else "stage0")
    inbox = ctx.transport_from("stage1" if first else "stage0")
    payload = torch.arange(8, dtype=torch.int32)  # 32 bytes: 8 token ids
    rtt_transport, rtt_raw = [], []
    warm = max(10, n // 10)
    for i in range(n + warm):
        if first:
            s = ctx.now()
            out.send(Message(Kind.DATA, round=i, tensors=(payload,)))
            inbox.recv()
            if i >= warm:
                rtt_transport.append(ctx.now() - s)
        else:
            m = inbox.recv()
            out.send(Message(Kind.DATA, round=i, tensors=m.tensors))
    buf = torch.empty_like(payload)
    for i in range(n + warm):  # raw gloo on the default group, same tensor
        if first:
            s = ctx.now()
            dist.send(payload, peer)
            dist.recv(buf, peer)
            if i >= warm:
                rtt_raw.append(ctx.now() - s)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    return {"transport": rtt_transport, "raw": rtt_raw}


def one_way(ctx: WorkerContext, n: int, nbytes: int) -> list[float]:
    if ctx.info.group == "stage0":
        out, back = ctx.transport_to("stage1"), ctx.transport_from("stage1")
        payload = torch.zeros(nbytes, dtype=torch.uint8)
        for r in range(n):
            out.send(Message(Kind.ACTIVATIONS, round=r, tensors=(payload,)))
            back.recv()
        return out.release_lateness_s
    inbox, ack = ctx.transport_from("stage0"), ctx.transport_to("stage0")
    delays = []
    for r in range(n):
        m = inbox.recv()
        delays.append(ctx.now() - m.sent_s)
        ack.send(Message(Kind.DATA, round=r))
    return delays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--round-trips", type=int, default=2000)
    ap.add_argument("--messages", type=int, default=400)
    ap.add_argument("--bytes", type=int, default=5 * 576 * 4, help="default: 5 tokens x 576 x fp32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    common = ("schedule=decentralized", "hardware=local", "placement.nodes=2", "placement.target_gpus=1",
              "placement.draft_gpus=1", f"seed={args.seed}")
    bare = compose_exp(*common, "network=nvlink")  # 0 latency, unlimited bandwidth, no jitter
    bare.backend = "real"
    res = launch(bare, round_trips, args=(args.round_trips,))[0].value
    out: dict[str, object] = {}
    for kind in ("transport", "raw"):
        xs = res[kind]
        out[f"rtt_{kind}_p50_us"], out[f"rtt_{kind}_p99_us"] = 1e6 * pct(xs, 0.5), 1e6 * pct(xs, 0.99)
        print(f"round trip, {kind:9s} ({len(xs)}): p50 {1e6 * pct(xs, 0.5):8.1f} µs   "
              f"p99 {1e6 * pct(xs, 0.99):8.1f} µs")

    wan = compose_exp(*common, "network=wan")
    wan.backend = "real"
    model = make_placement(wan).link("stage0", "stage1").model
    sender, receiver = launch(wan, one_way, args=(args.messages, args.bytes))
    measured, lateness = receiver.value, sender.value
    draws = LinkDelays(model, args.seed)
    same_seed = [model.serialization_s(args.bytes) + draws.propagation() for _ in measured]
    excess = [m - d for m, d in zip(measured, same_seed)]
    rows = [("model (distribution)", model.mean_s(args.bytes), model.quantile_s(args.bytes, 0.99)),
            ("model (same-seed draws)", statistics.mean(same_seed), pct(same_seed, 0.99)),
            ("measured", statistics.mean(measured), pct(measured, 0.99))]
    print(f"\nemulated link {model} — {len(measured)} messages of {args.bytes} B")
    for name, mean, p99 in rows:
        print(f"  {name:24s} mean {1e3 * mean:8.3f} ms   p99 {1e3 * p99:8.3f} ms")
    for name, mean, p99 in rows[:2]:
        print(f"  measured vs {name:24s} mean {100 * (rows[2][1] / mean - 1):+6.2f} %   "
              f"p99 {100 * (rows[2][2] / p99 - 1):+6.2f} %")
    print(f"  per-message excess over its draw: mean {1e6 * statistics.mean(excess):.1f} µs, "
          f"p50 {1e6 * pct(excess, 0.5):.1f} µs, p99 {1e6 * pct(excess, 0.99):.1f} µs, "
          f"min {1e6 * min(excess):.1f} µs")
    print(f"  of which the sender thread's wake-up after the due time: mean "
          f"{1e6 * statistics.mean(lateness):.1f} µs, p99 {1e6 * pct(lateness, 0.99):.1f} µs")
    out.update({"link": str(model), "messages": len(measured), "bytes": args.bytes,
                **{f"{k}_{n.split()[0]}{'_draws' if 'draws' in n else ''}_ms": 1e3 * v
                   for n, mean, p99 in rows for k, v in (("mean", mean), ("p99", p99))},
                "excess_mean_us": 1e6 * statistics.mean(excess), "excess_p99_us": 1e6 * pct(excess, 0.99),
                "release_lateness_mean_us": 1e6 * statistics.mean(lateness)})
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
