"""The links of a cluster as timeline resources, and transfers over them.

A plan rank is one GPU, or with tensor parallelism a group of `tp` consecutive GPUs of
one node that hold the same tokens (each a 1/tp shard of the heads). Links:

* each rank's intra-node port (NVLink, or PCIe on a PCIe-only node), egress and ingress;
* each NIC, egress and ingress, shared by the GPUs mapped to it (`ClusterSpec.nic_of`).

An intra-node transfer holds the sender's egress and the receiver's ingress; an
inter-node one holds the sending ranks' NIC egresses and the receiving ranks' NIC
ingresses (GPU-to-NIC traffic goes over PCIe, not NVLink). A TP group sends its tp
shards through its NICs in parallel. Seconds as `cost.seconds.p2p_time` (alpha-beta, the sender's GPU profile).
A routed hop (docs/design.md, section 6) is cut into one part per proxy pair: dispatch over
NVLink to the source-side proxy, NIC transfer to the far proxy, combine over NVLink.
"""

from __future__ import annotations

from ballonet.cost import hardware
from ballonet.errors import InputError
from ballonet.simulation.timeline import Timeline
from ballonet.specs import ClusterSpec


class Fabric:
    def __init__(self, cluster: ClusterSpec, num_ranks: int, tp: int):
        if num_ranks * tp != cluster.num_ranks:
            raise InputError(f"the plan has {num_ranks} ranks but cluster {cluster.name!r} has "
                             f"{cluster.num_ranks} GPUs (tp={tp}); the plan needs {cluster.num_ranks // tp}")
        self.num_ranks, self.tp = num_ranks, tp
        gpus = [[r * tp + k for k in range(tp)] for r in range(num_ranks)]
        self.node = [cluster.node_of(g[0]) for g in gpus]
        if any(len({cluster.node_of(x) for x in g}) > 1 for g in gpus):
            raise InputError(f"tp={tp} does not fit in the nodes of cluster {cluster.name!r}")
        self.group = [cluster.group_of(g[0]) for g in gpus]
        self.gpu = [grp.gpu_type for grp in self.group]
        self.intra_bw = [grp.intra_bw for grp in self.group]
        self.nics = [sorted({cluster.nic_of(x) for x in g}) for g in gpus]
        self.nic_bw = [grp.nic_bw for grp in self.group]
        self.num_nics = cluster.num_nics
        self._paths: dict = {}
        self.nic_ranks: dict[int, list[int]] = {}
        for r, nics in enumerate(self.nics):
            for n in nics:
                self.nic_ranks.setdefault(n, []).append(r)

    def nic_peer(self, rank: int) -> int | None:
        """The rank of the next node (cyclically) on the same rail: where `rank` sends in a
        ring all-reduce across nodes; None with one node."""
        if not hasattr(self, "_node_ranks"):
            self._node_ranks: dict[int, list[int]] = {}
            for r, n in enumerate(self.node):
                self._node_ranks.setdefault(n, []).append(r)
        nodes = sorted(self._node_ranks)
        if len(nodes) < 2:
            return None
        here = self._node_ranks[self.node[rank]]
        there = self._node_ranks[nodes[(nodes.index(self.node[rank]) + 1) % len(nodes)]]
        return there[here.index(rank) % len(there)]

    # ---- link ids: intra egress, intra ingress, NIC egress, NIC ingress ----------------

    def link_name(self, link: int) -> str:
        R, N = self.num_ranks, self.num_nics
        kind, index = divmod(link, R) if link < 2 * R else (2 + (link - 2 * R) // N, (link - 2 * R) % N)
        return ("link out", "link in", f"nic {index} out", f"nic {index} in")[kind]

    def link_owner(self, link: int) -> int:
        """The rank whose trace shows this link (a shared NIC: its first rank)."""
        R = self.num_ranks
        if link < 2 * R:
            return link % R
        return self.nic_ranks[(link - 2 * R) % self.num_nics][0]

    def path(self, src: int, dst: int) -> tuple[tuple[int, ...], float, float]:
        """(links, latency, seconds per byte) from src to dst, cached."""
        key = (src, dst)
        if key not in self._paths:
            R, N = self.num_ranks, self.num_nics
            if self.node[src] == self.node[dst]:
                links = (src, R + dst)
                p = hardware.profile(self.gpu[src])
                lat, bw = p.p2p_latency_s, p.p2p_efficiency * min(self.intra_bw[src], self.intra_bw[dst])
                per_byte = 1.0 / bw
            else:
                links = tuple(2 * R + n for n in self.nics[src]) + tuple(2 * R + N + n for n in self.nics[dst])
                p = hardware.profile(self.gpu[src])
                lat = p.nic_latency_s
                per_byte = self.tp * max(1.0 / (len(self.nics[r]) * self.nic_bw[r]) for r in (src, dst)) \
                    / p.nic_efficiency
            self._paths[key] = (links, lat, per_byte)
        return self._paths[key]

    def transfer_time(self, src: int, dst: int, num_bytes: float) -> float:
        """`cost.seconds.p2p_time` over the path; a TP group's shards share its NICs."""
        _, lat, per_byte = self.path(src, dst)
        return lat + num_bytes * per_byte if num_bytes > 0 else 0.0

    def links(self, src: int, dst: int) -> tuple[int, ...]:
        return self.path(src, dst)[0]

    # ---- transfers ---------------------------------------------------------------------

    def send(self, tl: Timeline, src: int, dst: int, num_bytes: float, after, name) -> int | None:
        """A direct transfer of `num_bytes` per GPU; None when there is nothing to send."""
        if num_bytes <= 0 or src == dst:
            return tl.join(after)
        links, lat, per_byte = self.path(src, dst)
        return tl.add(lat + num_bytes * per_byte, links=links, after=after, label=("send", src, name))

    def send_routed(self, tl: Timeline, src: int, dst: int, num_bytes: float, after, name,
                    proxies) -> int | None:
        """A hop split over proxy pairs: dispatch, parallel NIC transfers, combine."""
        if num_bytes <= 0:
            return tl.join(after)
        part = num_bytes / len(proxies)
        ends = []
        for a, b in proxies:
            t = self.send(tl, src, a, part, after, (name, "dispatch"))
            t = self.send(tl, a, b, part, [t], (name, "routed"))
            ends.append(self.send(tl, b, dst, part, [t], (name, "combine")))
        return tl.join(ends)
