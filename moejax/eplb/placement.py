"""Expert placement: which physical slot holds which logical expert.

There are E logical experts and P = E + num_redundant physical slots, P / ranks per
rank (slot s lives on rank s // (P / ranks)). A hot expert may own several slots
(replicas); a token routed to it from data-parallel rank r goes to replica
``r % num_replicas`` (moejax/parallel/dispatch.py ``physical_slots``), so with balanced
per-rank batches its tokens are split evenly among them, and the split is predictable
from per-rank counts.

``balanced_placement`` solves the balanced number-partitioning problem the way
EPLB does: replicas to the experts with the highest load per replica, then a
greedy longest-processing-time start (heaviest item to the lightest rank with a
free slot) improved by pairwise swaps between the heaviest rank and the others.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
    logical_of_slot: np.ndarray  # [P] int32
    num_ranks: int

    @property
    def num_slots(self) -> int:
        return len(self.logical_of_slot)

    @property
    def num_experts(self) -> int:
        return int(self.logical_of_slot.max()) + 1

    @property
    def num_replicas(self) -> np.ndarray:
        return np.bincount(self.logical_of_slot, minlength=self.num_experts).astype(np.int32)

    def slots_of_expert(self) -> np.ndarray:
        """[E, max_replicas] int32: the slots of each expert (unused entries repeat the first)."""
        reps = self.num_replicas
        out = np.zeros((self.num_experts, int(reps.max())), np.int32)
        for e in range(self.num_experts):
            s = np.flatnonzero(self.logical_of_slot == e)
            out[e] = np.resize(s, out.shape[1])
        return out

    def routing_tables(self) -> dict[str, np.ndarray]:
        """The MoE layer's "routing" variables."""
        return {"expert_slots": self.slots_of_expert(), "expert_replicas": self.num_replicas}


def contiguous_placement(num_experts: int, num_ranks: int) -> Placement:
    return Placement(np.arange(num_experts, dtype=np.int32), num_ranks)


def rank_loads(load: np.ndarray, placement: Placement) -> np.ndarray:
    """Expected tokens per rank: an expert's load split evenly over its replicas."""
    per_slot = load[placement.logical_of_slot] / placement.num_replicas[placement.logical_of_slot]
    return per_slot.reshape(placement.num_ranks, -1).sum(1)


def balancedness(rank_load: np.ndarray) -> float:
    """Mean over max tokens per rank (vLLM/SGLang's definition); 1.0 is perfect. Imbalance is its inverse."""
    m = float(np.max(rank_load))
    return float(np.mean(rank_load)) / m if m > 0 else 1.0


def balanced_placement(load: np.ndarray, num_ranks: int, num_redundant: int = 0, swap_rounds: int = 200) -> Placement:
    load = np.asarray(load, np.float64)
    E = len(load)
    P = E + num_redundant
    if P % num_ranks:
        raise ValueError(f"num_experts + num_redundant_experts = {P} must be divisible by the {num_ranks} ranks")
    per_rank = P // num_ranks
    reps = np.ones(E, np.int64)
    for _ in range(num_redundant):  # a replica for the expert with the highest load per replica
        reps[np.argmax(load / reps)] += 1
    items = np.repeat(np.arange(E), reps)
    weight = (load / reps)[items]
    order = np.argsort(-weight, kind="stable")
    groups: list[list[int]] = [[] for _ in range(num_ranks)]
    sums = np.zeros(num_ranks)
    for i in order:  # LPT with a cardinality limit; avoid two replicas of one expert on a rank
        open_ranks = [r for r in range(num_ranks) if len(groups[r]) < per_rank]
        clean = [r for r in open_ranks if items[i] not in (items[j] for j in groups[r])] or open_ranks
        r = min(clean, key=lambda r: sums[r])
        groups[r].append(i)
        sums[r] += weight[i]
    for _ in range(swap_rounds):  # swap an item of the heaviest rank with one of another rank
        h = int(np.argmax(sums))
        best = None
        for r in range(num_ranks):
            if r == h:
                continue
            experts_h = {items[j] for j in groups[h]}
            experts_r = {items[j] for j in groups[r]}
            for a in groups[h]:
                for b in groups[r]:
                    d = weight[a] - weight[b]
                    if d <= 0 or items[a] in experts_r or items[b] in experts_h:
                        continue  # no gain, or two replicas of one expert would share a rank
                    new_max = max(sums[h] - d, sums[r] + d)
                    gain = sums[h] - new_max
                    if gain > 1e-12 and (best is None or gain > best[0]):
                        best = (gain, r, a, b, d)
        if best is None:
            break
        _, r, a, b, d = best
        groups[h][groups[h].index(a)] = b
        groups[r][groups[r].index(b)] = a
        sums[h] -= d
        sums[r] += d
    logical_of_slot = np.array([items[i] for g in groups for i in sorted(g, key=lambda i: items[i])], np.int32)
    return Placement(logical_of_slot, num_ranks)


def zipf_load(num_experts: int, tokens: int = 100_000, s: float = 1.0, seed: int = 0,
              shuffle: bool = True) -> np.ndarray:
    """Synthetic expert popularity: Zipf(s) token counts, over a random permutation of the
    experts (``shuffle``) or with the hot experts next to each other (the contiguous
    placement's worst case: the hottest experts share rank 0)."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, num_experts + 1) ** s
    if shuffle:
        p = p[rng.permutation(num_experts)]
    return rng.multinomial(tokens, p / p.sum()).astype(np.float64)
