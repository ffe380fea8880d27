"""The floor under a sharded recovery with a hot spare: what a fresh process spends in plain PyTorch before
its first step, against the same work in a process that has done it once (a survivor).

    python bench/cold_floor.py [--runs 5] [--layers 2] [--workers 2]

No trainguard here: `--workers` plain torch processes (gloo, CPU) form a group, import everything first (as
a hot spare has), then each builds the FSDP2 tutorial's model (examples/fsdp2_tutorial.py) on the meta
device, shards it with `fully_shard`, creates Adam's state (one step with zero gradients, as
torch.distributed.checkpoint does before a load) and runs one training step. Then it does the same a
second time in the same process. The first pass is what a replacement pays, the second what a survivor
pays. Rank 0's figures are printed, medians over --runs fresh groups.

The difference is mostly DTensor's sharding propagation: its cache is per process, and each
(operator, layout) it has not seen costs a fake-tensor run. `bench/recovery.py` measures the whole
recovery; this bench shows how much of it torch needs in any fresh process.
"""

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TUTORIAL = os.path.join(HERE, "..", "examples", "fsdp2_tutorial.py")
PHASES = ("build", "optimizer state", "first step")


def _tutorial():
    spec = importlib.util.spec_from_file_location("fsdp2_tutorial", TUTORIAL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def one_pass(tut, torch, fully_shard, layers: int) -> dict[str, float]:
    """Build, shard, create the optimizer state, one step: milliseconds for each."""
    args = tut.ModelArgs(n_layers=layers, n_heads=4, vocab_size=1024, max_seq_len=64, dropout_p=0.0)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = tut.Transformer(args)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    model.reset_parameters()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    t1 = time.perf_counter()
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for group in optim.param_groups:
        group["lr"] = 0.0
    optim.step()
    for group in optim.param_groups:
        group["lr"] = 1e-2
    optim.zero_grad(set_to_none=True)
    t2 = time.perf_counter()
    x = torch.randint(0, args.vocab_size, (4, args.max_seq_len))
    model(x).sum().backward()
    optim.step()
    optim.zero_grad()
    t3 = time.perf_counter()
    return {"build": 1e3 * (t1 - t0), "optimizer state": 1e3 * (t2 - t1), "first step": 1e3 * (t3 - t2)}


def rank_main(rank: int, world: int, port: int, layers: int) -> None:
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    import torch._dynamo  # noqa: F401 (a hot spare has imported it: the first optimizer would)

    warnings.filterwarnings("ignore", message="DTensor random operators")
    tut = _tutorial()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    cold = one_pass(tut, torch, fully_shard, layers)
    warm = one_pass(tut, torch, fully_shard, layers)
    if rank == 0:
        print(json.dumps({"cold": cold, "warm": warm}), flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_group(workers: int, layers: int) -> dict:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(workers), "--port",
                               str(port), "--layers", str(layers)], env=env, stdout=subprocess.PIPE, text=True)
             for r in range(workers)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.world, args.port, args.layers)
        return
    results = [one_group(args.workers, args.layers) for _ in range(args.runs)]
    print(f"FSDP2 tutorial model, {args.layers} layers, {args.workers} ranks (gloo, CPU), rank 0, "
          f"medians of {args.runs} fresh groups:")
    print(f"{'phase':<18}{'fresh process':>16}{'second pass':>14}{'extra':>10}")
    total = {"cold": 0.0, "warm": 0.0}
    for phase in PHASES:
        cold = statistics.median(r["cold"][phase] for r in results)
        warm = statistics.median(r["warm"][phase] for r in results)
        total["cold"] += cold
        total["warm"] += warm
        print(f"{phase:<18}{cold:>13.0f} ms{warm:>11.0f} ms{cold - warm:>7.0f} ms")
    print(f"{'total':<18}{total['cold']:>13.0f} ms{total['warm']:>11.0f} ms{total['cold'] - total['warm']:>7.0f} ms")


if __name__ == "__main__":
    main()
