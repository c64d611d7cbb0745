"""Online expert load balancing: per-layer expert counts from every step over a sliding
window, balanced placements recomputed every ``interval`` steps, expert weights moved on
device (a gather along the slot axis) and the placement tables swapped. Shapes never
change, so nothing recompiles after the first permutation; the model's function is the
same (only where each expert lives changes), so no request is lost or changed."""

from __future__ import annotations

from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from moejax.eplb.placement import Placement, balanced_placement, balancedness, rank_loads
from moejax.models.registry import abstract_variables
from moejax.parallel import processes
from moejax.parallel.sharding import EXPERT, put_replicated
from moejax.weights.param_tree import flatten, unflatten


def module_layer(path: tuple[str, ...]) -> int:
    """The layer index of an experts module's path (``layers_N/...``)."""
    return int(path[0].split("_")[1])


def expert_modules(cfg) -> list[tuple[str, ...]]:
    """Pytree paths of every routed-experts module, in layer order (from the model's routing variables):
    the decoder layers', then a DeepSeek MTP layer's (``layers_<num_hidden_layers>``)."""
    paths = [p[:-1] for p in flatten(abstract_variables(cfg, "float32").get("routing", {})) if p[-1] == "expert_slots"]
    return sorted(paths, key=module_layer)


def balanced_modules(cfg, modules) -> list[tuple[str, ...]]:
    """The experts modules EPLB rebalances: the decoder layers', whose load every step counts. A DeepSeek
    MTP layer's experts keep their initial placement (contiguous, plus the same replicas in the
    redundant slots): no step runs that layer yet, so there is no load to balance them by."""
    return [m for m in modules if module_layer(m) < cfg.num_hidden_layers]


def initial_placements(cfg, num_ranks: int, num_redundant: int) -> dict[tuple[str, ...], Placement]:
    """Contiguous experts, then replicas of experts 0, 1, ... in the redundant slots (every MoE layer's,
    a DeepSeek MTP layer's included)."""
    E = cfg.n_routed_experts
    if (E + num_redundant) % num_ranks:
        raise ValueError(f"n_routed_experts + num_redundant_experts = {E + num_redundant} is not divisible by "
                         f"the {num_ranks} expert-parallel ranks")
    if num_redundant > E * 7:
        raise ValueError("num_redundant_experts is too large")
    slots = np.concatenate([np.arange(E), np.arange(num_redundant) % E]).astype(np.int32)
    return {path: Placement(slots, num_ranks) for path in expert_modules(cfg)}


def routing_tree(placements: dict[tuple[str, ...], Placement], width: int) -> dict:
    flat = {}
    for path, p in placements.items():
        slots = p.slots_of_expert()
        slots = np.concatenate([slots, np.repeat(slots[:, :1], width - slots.shape[1], axis=1)], axis=1)
        flat[path + ("expert_slots",)] = slots.astype(np.int32)
        flat[path + ("expert_replicas",)] = p.num_replicas
    return unflatten(flat)


def _map_experts(params: dict, placements, fn) -> dict:
    """A copy of params with fn(leaf, module path, placement) applied to every leaf of each
    routed-experts module (weights and, with FP8, their block scales: all slot-major)."""
    flat = flatten(params)
    for path, p in placements.items():
        for leaf in [k for k in flat if k[:-1] == path]:
            flat[leaf] = fn(flat[leaf], path, p)
    return unflatten(flat)


READ_EVERY = 16  # steps between the balancer's reads of the expert counters from the device


def _ready(a) -> bool:
    return not isinstance(a, jax.Array) or a.is_ready()


class ExpertLoadBalancer:
    """Takes the runner's expert counts (device arrays) after every step; with ``eplb_interval`` set in
    the parallel layout, rebalances every that many steps (``rebalance`` may also be called directly).

    The counts stay on the device until read: every READ_EVERY steps those whose step is done are
    copied in one batch (no wait), and every query (window_load, rebalance, ...) first reads them all,
    so what it computes is exactly the per-step window it was before, without a per-step sync."""

    def __init__(self, config, runner, placements: dict[tuple[str, ...], Placement]):
        pc = config.parallel
        self.runner, self.placements = runner, dict(placements)
        self.names = balanced_modules(config.model, placements)  # expert-module paths, in layer order
        self.num_redundant = config.num_redundant_experts
        self.interval = pc.eplb_interval if pc else 0
        self.routing_width = 1 + self.num_redundant
        window = pc.eplb_window if pc else 1000
        self.counts: deque[np.ndarray] = deque(maxlen=window)  # [ranks, L_moe, E] per step
        self.dispatched: deque[np.ndarray] = deque(maxlen=window)  # [ranks, L_moe] per step
        self._dispatched_sum = None
        self._unread: deque[tuple] = deque()  # (counts, dispatched) device arrays of steps not read yet
        self.steps = 0
        self.num_rebalances = 0
        mesh = runner.mesh
        take = lambda w, src: jnp.take(w, src, axis=0)  # noqa: E731
        self._take = jax.jit(take) if mesh is None else jax.jit(take, out_shardings=NamedSharding(mesh, EXPERT))

    @property
    def num_ranks(self) -> int:
        return next(iter(self.placements.values())).num_ranks if self.placements else 1

    def record(self) -> None:
        """Called after every step is dispatched: keeps its counts; rebalances every ``interval`` steps."""
        if not self.names or self.runner.last_expert_counts is None:
            return
        c, d = self.runner.last_expert_counts, self.runner.last_dispatched
        for a in (c, d):
            if isinstance(a, jax.Array):
                a.copy_to_host_async()  # starts the copy once the step is done; reading it later costs no wait
        self._unread.append((c, d))
        self.steps += 1
        if self.interval and self.steps % self.interval == 0:
            self.rebalance()
        elif len(self._unread) >= READ_EVERY:
            # Across processes a read is a collective every process must make at the same step: it waits.
            self.read_counts(wait=processes.count() > 1)

    def read_counts(self, wait: bool = True) -> None:
        """Moves the unread steps' counts into the window, in step order, in one device-to-host copy:
        all of them (``wait``), or only those whose step is already done. Across processes a read is a
        collective (``to_host``), so only ``wait`` reads: which steps are done differs between processes,
        and one process (the server's /metrics) may ask alone."""
        if not wait and processes.count() > 1:
            return
        n = len(self._unread) if wait else next((i for i, (c, d) in enumerate(self._unread)
                                                 if not (_ready(c) and _ready(d))), len(self._unread))
        if not n:
            return
        got = processes.to_host([self._unread.popleft() for _ in range(n)])
        for c, d in got:
            c, d = np.asarray(c), np.asarray(d)
            if len(self.dispatched) == self.dispatched.maxlen:
                self._dispatched_sum -= self.dispatched[0]
            self.counts.append(c)
            self.dispatched.append(d)
            self._dispatched_sum = d.astype(np.int64) + (self._dispatched_sum if self._dispatched_sum is not None
                                                         else 0)

    def window_load(self) -> np.ndarray:
        """Tokens routed to each logical expert over the window: [L_moe, E]."""
        self.read_counts()
        E = self.runner.cfg.n_routed_experts
        return np.sum(self.counts, axis=(0, 1)) if self.counts else np.zeros((len(self.names), E))

    def predicted_rank_loads(self) -> np.ndarray:
        """[L_moe, ranks]: what the current placements predict each rank computes, from the window's
        per-source-rank counts (a replicated expert serves source rank r from replica r % n)."""
        self.read_counts()
        by_src = np.sum(self.counts, axis=0)  # [ranks, L_moe, E]
        out = np.zeros((len(self.names), self.num_ranks))
        for i, n in enumerate(self.names):
            p = self.placements[n]
            slots, reps, per_rank = p.slots_of_expert(), p.num_replicas, p.num_slots // p.num_ranks
            for r in range(by_src.shape[0]):
                dest = slots[np.arange(len(reps)), r % reps] // per_rank
                np.add.at(out[i], dest, by_src[r, i])
        return out

    def planned_rank_loads(self, load=None) -> np.ndarray:
        """[L_moe, ranks]: the planning model (a replicated expert's load split evenly)."""
        load = self.window_load() if load is None else load
        return np.stack([rank_loads(load[i], self.placements[n]) for i, n in enumerate(self.names)])

    def measured_rank_loads(self, wait: bool = True) -> np.ndarray:
        """[L_moe, ranks]: (token, expert) pairs each rank's dispatch actually computed, over the window."""
        # a running sum: /metrics reads it after every step (after read_counts(wait=False): no sync)
        if wait:
            self.read_counts()
        return self._dispatched_sum.T if self.dispatched else np.zeros((len(self.names), self.num_ranks))

    def balancedness(self, wait: bool = True) -> tuple[list[float], float]:
        """Per MoE layer and overall (mean over layers) mean/max tokens per rank, from measured counts
        (``wait=False``: of the steps read so far, without waiting for the device)."""
        if not wait:
            self.read_counts(wait=False)
        per_layer = [balancedness(r) for r in self.measured_rank_loads(wait)]
        return per_layer, float(np.mean(per_layer)) if per_layer else 1.0

    def rebalance(self, load=None) -> dict[str, Placement]:
        """Balanced placements from the window's load (or ``load`` [L_moe, E]); moves weights on device."""
        self.read_counts()  # the window the new placements are for ends here (apply clears it)
        load = self.window_load() if load is None else np.asarray(load)
        new = {n: balanced_placement(load[i], self.num_ranks, self.num_redundant) for i, n in enumerate(self.names)}
        self.apply(new)
        return new

    def apply(self, new: dict) -> None:
        def move(w, path, p):  # new slot s takes the weights of a current slot holding expert logical_of_slot[s]
            src = self.placements[path].slots_of_expert()[p.logical_of_slot, 0]
            return self._take(w, put_replicated(src.astype(np.int32), self.runner.mesh))

        params = _map_experts(self.runner.params, new, move)
        self.placements.update(new)
        self.runner.set_routing(params, put_replicated(routing_tree(self.placements, self.routing_width),
                                                       self.runner.mesh))
        self.counts.clear()
        self.dispatched.clear()
        self._dispatched_sum = None
        self.num_rebalances += 1
