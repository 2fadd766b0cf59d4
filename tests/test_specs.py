import pytest

import ballonet
from ballonet.errors import InputError


def test_a800_preset_shares_nics_between_gpu_pairs():
    c = ballonet.cluster("a800-4nic", num_nodes=2)
    assert c.num_ranks == 16 and c.num_nodes == 2 and c.num_nics == 8
    assert [c.nic_of(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [c.nic_of(r) for r in range(8, 16)] == [4, 4, 5, 5, 6, 6, 7, 7]
    assert c.node_of(7) == 0 and c.node_of(8) == 1 and c.local_index(9) == 1
    assert c.groups[0].nic_bw == 200e9 / 8


def test_overrides_and_cpu_preset():
    c = ballonet.cluster("cpu", num_nodes=3, gpus_per_node=4)
    assert c.num_ranks == 12 and c.nodes()[2] == [8, 9, 10, 11]
    with pytest.raises(InputError, match="unknown cluster field 'gpus'"):
        ballonet.cluster("cpu", gpus=3)


def test_unknown_presets_list_valid_names():
    with pytest.raises(InputError, match="a800-4nic"):
        ballonet.cluster("b200-16nic")
    with pytest.raises(InputError, match="llama-7b"):
        ballonet.model("gpt-5")


def test_model_shapes():
    m = ballonet.model("llama-7b")
    assert m.head_dim == 128 and m.kv_dim == 4096
    # LLaMA-7B has 6.74e9 parameters (Touvron et al. 2023, table 2).
    assert abs(m.num_params - 6.74e9) / 6.74e9 < 0.01
    g = ballonet.model("llama3-8b")
    assert g.kv_dim == 1024 and abs(g.num_params - 8.03e9) / 8.03e9 < 0.01
    assert ballonet.model("llama-13b", tp=2).tp == 2
    with pytest.raises(InputError, match="tp=3"):
        ballonet.model("llama-7b", tp=3)


def test_toml_cluster_mixes_groups(tmp_path):
    path = tmp_path / "mix.toml"
    path.write_text(
        'name = "mix"\n'
        '[[node_groups]]\ngpu = "h800"\nnum_nodes = 2\n'
        '[[node_groups]]\ngpu = "l40s"\nnum_nodes = 1\ngpus_per_node = 4\nnics_per_node = 2\nnic_gbps = 100\n'
    )
    c = ballonet.cluster(str(path))
    assert c.name == "mix" and c.num_ranks == 20 and not c.homogeneous
    assert c.gpu_of(19).name == "l40s" and c.node_of(19) == 2
    assert c.nic_of(16) == c.nic_of(17) == 16 and c.nic_of(18) == 17
    assert c.groups[1].gpu_type.intra_link == "pcie"


@pytest.mark.parametrize(
    "text, message",
    [
        ('[[node_groups]]\ngpu = "h800"\nnum_nodes = "two"\n', "node_groups\\[0\\]: .*num_nodes"),
        ('[[node_groups]]\ngpu = "x9"\n', "node_groups\\[0\\]: unknown GPU type 'x9'"),
        ('[[node_groups]]\nnum_nodes = 1\n', "field 'gpu' is missing"),
        ('[[node_groups]]\ngpu = "h800"\nspeed = 3\n', "unknown field 'speed'"),
        ('name = "x"\n', "node_groups"),
        ('[[node_groups]\ngpu = "h800"\n', "malformed TOML"),
    ],
)
def test_malformed_toml_names_the_field(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InputError, match=message):
        ballonet.cluster(str(path))
