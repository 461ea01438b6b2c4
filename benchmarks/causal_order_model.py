"""How the order of the causal forward's query blocks fills an H100: a scheduling model, not a
timing (issue 20, target 6: the persistent, longest-first causal grid).

A causal forward block of query rows [m·BM, (m+1)·BM) visits m·BM/BN unmasked key tiles and one
masked diagonal block; its cost here is that many tiles, the diagonal weighted by the static
count of benchmarks/NOTES.md (masked diagonal / unmasked tile instructions), plus a fixed
prologue + epilogue of ``FIXED`` tiles. The GPU's block scheduler hands the next block, in
linear grid order (axis 0 fastest), to the first SM slot that frees up: a greedy list schedule,
simulated here with a heap. Compared per shape (makespan / ideal, ideal = total work / slots):

* ``per-head longest first``: what ``_attn_fwd`` launches (grid (blocks, heads, batch), block
  index reversed under causal): each head's longest blocks first, head after head;
* ``ascending``: the same grid without the reversal (the tutorial's order);
* ``global longest first``: every head's longest block before any shorter one (the query
  block on the slowest grid axis, or a persistent kernel's dynamic tile counter);
* ``persistent, static stride``: one program per slot walking the global longest-first list
  with a fixed stride (tile i -> program i mod slots), as a persistent kernel without an atomic
  tile counter does.

Run: ``python benchmarks/causal_order_model.py [--json out.json]`` (CPU only, a second).
"""
import argparse
import heapq
import json

SMS = 132            # H100 SXM
FIXED = 1.0          # prologue (Q tile, descriptors) + epilogue (O, lse stores), in tiles
# Masked diagonal per 128-row query block / unmasked 128x128 tile (sass_budget, fp16 causal).
DIAG_WEIGHT = {64: 6184 / 3544, 128: 6840 / 3792}
BLOCK = 128          # BLOCK_M = BLOCK_N of the sm_90 default forward configs


def block_costs(seq, head_dim):
    n = seq // BLOCK
    return [m + DIAG_WEIGHT[head_dim] + FIXED for m in range(n)]


def greedy(order, slots):
    """Makespan of a list schedule: each block, in order, goes to the first free slot."""
    free = [0.0] * slots
    heapq.heapify(free)
    end = 0.0
    for cost in order:
        t = heapq.heappop(free) + cost
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def static_stride(order, slots):
    loads = [0.0] * slots
    for i, cost in enumerate(order):
        loads[i % slots] += cost
    return max(loads)


def orders(costs, heads):
    n = len(costs)
    per_head_desc = [costs[m] for _ in range(heads) for m in reversed(range(n))]
    ascending = [costs[m] for _ in range(heads) for m in range(n)]
    global_desc = [costs[m] for m in reversed(range(n)) for _ in range(heads)]
    return {"per-head longest first": (greedy, per_head_desc),
            "ascending": (greedy, ascending),
            "global longest first": (greedy, global_desc),
            "persistent, static stride": (static_stride, global_desc)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json")
    a = ap.parse_args()
    rows = []
    print(f"{'d':>4} {'B*H':>5} {'seq':>6} {'CTA/SM':>6}  " + "  ".join(
        f"{k:>26}" for k in orders([1.0], 1)))
    for head_dim, ctas in ((64, 1), (128, 1)):
        for bh in (16, 32, 128):
            for seq in (1024, 4096, 16384):
                costs = block_costs(seq, head_dim)
                slots = SMS * ctas
                ideal = sum(costs) * bh / slots
                res = {k: f(o, slots) / ideal for k, (f, o) in orders(costs, bh).items()}
                rows.append(dict(head_dim=head_dim, bh=bh, seq=seq, ctas_per_sm=ctas, **res))
                print(f"{head_dim:>4} {bh:>5} {seq:>6} {ctas:>6}  "
                      + "  ".join(f"{v:>26.3f}" for v in res.values()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(model=__doc__.splitlines()[0], sms=SMS, fixed=FIXED,
                           diag_weight=DIAG_WEIGHT, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
