"""Plan ranks in the cluster file's group order whatever order torchrun's rendezvous gave
the nodes (`node_order`): what each rank says, and the order the ranks agree on. The
order's use under torchrun (the process group formed again) is tested in test_lease.py."""

import pytest

from ballonet import specs
from ballonet.training.jobs.node_order import claim, member_groups, order


def _cluster(tmp_path, groups):
    """A cluster file of `groups`: (gpu, nodes, gpus per node, loaned)."""
    text = 'name = "mixed"\n' + "".join(
        f'[[node_groups]]\ngpu = "{gpu}"\nnum_nodes = {n}\ngpus_per_node = {g}\nnics_per_node = {g}\nloaned = {str(lent).lower()}\n'
        for gpu, n, g, lent in groups)
    path = tmp_path / "mixed.toml"
    path.write_text(text)
    return str(path)


def _claims(cluster, job, told, device=None):
    """Every rank's claim and node, 2 ranks a node, in the rendezvous's order: `told` is
    each node's BALLONET_NODE_GROUP (None: unset)."""
    members = member_groups(cluster, job)
    return [(*claim(cluster, members, value, device), f"node {n}") for n, value in enumerate(told) for _ in range(2)]


def test_ranks_are_put_in_the_files_group_order_whatever_the_rendezvous_order(tmp_path):
    path = _cluster(tmp_path, [("h800", 1, 2, False), ("h20", 2, 2, True)])
    cluster, job = specs.cluster(path), specs.job_cluster(path, 6)
    # the rendezvous put a loaned node first, the training node second: plan ranks 0-1 are torchrun's 2-3
    assert order(cluster, job, _claims(cluster, job, ["1", "0", "1"])) == [2, 3, 0, 1, 4, 5]
    assert order(cluster, job, _claims(cluster, job, ["0", "1", "1"])) == list(range(6))  # already in order
    assert order(cluster, job, _claims(cluster, job, [None, None, None])) == list(range(6))  # none can tell: as is
    # reclaimed: the job is the training group alone
    own = specs.job_cluster(path, 2)
    assert order(cluster, own, _claims(cluster, own, ["0"])) == [0, 1]


def test_gpus_tell_their_group_by_their_type_and_problems_are_one_line(tmp_path):
    path = _cluster(tmp_path, [("h800", 1, 2, False), ("h20", 1, 2, True)])
    cluster, job = specs.cluster(path), specs.job_cluster(path, 4)
    members = member_groups(cluster, job)
    assert claim(cluster, members, None, "NVIDIA H20") == (1, None, None)
    assert claim(cluster, members, None, "NVIDIA H800 PCIe") == (0, None, None)
    assert claim(cluster, members, "0", "NVIDIA H20")[0] == 0  # told: the device is checked later (preflight)
    assert claim(cluster, members, None, "NVIDIA A10")[1] == ("its device, a NVIDIA A10, is of no node group's GPU "
                                                              "type in this job of cluster 'mixed' (0: h800, 1: h20 loaned)")
    assert claim(cluster, members, "2", None)[1] == ("BALLONET_NODE_GROUP=2: cluster 'mixed' has node groups 0 to 1 "
                                                     "(0: h800, 1: h20 loaned)")
    claims = [(*claim(cluster, members, None, name), f"node {n}") for n, name in enumerate(["NVIDIA H20", "NVIDIA H800"])
              for _ in range(2)]
    assert order(cluster, job, claims) == [2, 3, 0, 1]

    same = _cluster(tmp_path, [("h800", 1, 2, False), ("h800", 1, 2, True), ("h20", 1, 2, True)])
    cluster, job = specs.cluster(same), specs.job_cluster(same, 6)
    claims = [(*claim(cluster, member_groups(cluster, job), None, name), f"node {n}")
              for n, name in enumerate(["NVIDIA H20", "NVIDIA H800", "NVIDIA H800"]) for _ in range(2)]
    with pytest.raises(ValueError, match=r"^rank 2 \(node 1\): cannot tell which node group its node is in \(its "
                       r"NVIDIA H800 is the type of node groups 0 and 1\), while other nodes can; set "
                       r"BALLONET_NODE_GROUP=INDEX"):
        order(cluster, job, claims)


def test_claims_that_do_not_fit_the_job_fail_on_every_rank_alike(tmp_path):
    path = _cluster(tmp_path, [("h800", 1, 2, False), ("h20", 1, 2, True)])
    cluster, job = specs.cluster(path), specs.job_cluster(path, 4)
    with pytest.raises(ValueError, match=r"^node group 0 \(h800\) has 2 GPUs in this job of 4 ranks, but 4 ranks say"):
        order(cluster, job, _claims(cluster, job, ["0", "0"]))
    own = specs.job_cluster(path, 2)  # reclaimed, but a loaned node came instead of the training node
    with pytest.raises(ValueError, match=r"^node group 0 \(h800\) has 2 GPUs in this job of 2 ranks, but 0"):
        order(cluster, own, _claims(cluster, own, ["1"]))
    claims = _claims(cluster, job, ["1", "0"])
    claims[1] = (0, None, None, "node 0")  # one node, two groups
    with pytest.raises(ValueError, match=r"^node 0: its ranks say node groups 1 and 0; a node is in one group"):
        order(cluster, job, claims)
    with pytest.raises(ValueError, match=r"^rank 0 \(node 0\): cannot tell .* \(a CPU rank without BALLONET_NODE_GROUP\)"):
        order(cluster, job, _claims(cluster, job, [None, "0"]))
    with pytest.raises(ValueError, match=r"^rank 0 \(node 0\): BALLONET_NODE_GROUP=x: cluster 'mixed' has node groups"):
        order(cluster, job, _claims(cluster, job, ["x", "0"]))
