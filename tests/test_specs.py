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


# ---- hardening (issue 16) --------------------------------------------------------------


@pytest.mark.parametrize("text, message", [
    ('[[node_groups]]\ngpu = 5\n', "node_groups[0]: node group: gpu must be a GPU type name (a string), got 5"),
    ("node_groups = [1, 2]\n", "node_groups[0]: expected a table ([[node_groups]]), got 1"),
    ('[[node_groups]]\ngpu = "h200"\nnic_gbps = "fast"\n', "node_groups[0]: node group 'h200': nic_gbps must be a number"),
    ('[[node_groups]]\ngpu = "h200"\nintra_link_bw = true\n', "intra_link_bw must be a number, got True"),
    ('[[node_groups]]\ngpu = "a100"\nmemory_gb = "40"\n', "memory_gb must be a number, got '40'"),
    ('[[node_groups]]\ngpu = "a100"\nmemory_gb = 0\n', "memory_gb must be positive, got 0"),
    ('name = [1]\n[[node_groups]]\ngpu = "h200"\n', "field 'name' must be a string, got [1]"),
    (b"\x80\x81\xfe" * 50, "not a TOML cluster file (not UTF-8 text)"),
])
def test_toml_of_the_wrong_type_is_one_line_naming_file_and_field(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(InputError) as err:
        ballonet.cluster(str(path))
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_memory_override_sets_the_gpu_memory_and_the_token_caps(tmp_path):
    """memory_gb replaces the GPU type's memory for its group only: on a cluster of A100s
    of 64 and 80 GB the 64 GB ranks hold 16 GB less of activations, and a batch that fits
    80 GB A100s is refused on 64 GB ones."""
    from ballonet import plan_batch
    from ballonet.cost.memory import MEMORY_RESERVE
    from ballonet.errors import InfeasiblePlan
    from ballonet.planning.devices import devices

    path = tmp_path / "c.toml"
    path.write_text('[[node_groups]]\ngpu = "a100"\ngpus_per_node = 2\nmemory_gb = 64\n'
                    '[[node_groups]]\ngpu = "a100"\ngpus_per_node = 2\n')
    mixed = ballonet.cluster(str(path))
    assert [g.gpu_type.memory_bytes for g in mixed.groups] == [64e9, 80e9]
    assert [mixed.gpu_of(r).memory_bytes for r in range(4)] == [64e9, 64e9, 80e9, 80e9]
    assert not mixed.homogeneous
    assert ballonet.specs.ClusterSpec.from_dict(mixed.to_dict()) == mixed
    model = ballonet.model("llama-7b")
    dev = devices(mixed, model)
    fewer = 16e9 * MEMORY_RESERVE / dev.act_bytes_per_token
    assert dev.token_cap[0] == dev.token_cap[1] and dev.token_cap[2] == dev.token_cap[3]
    assert abs((dev.token_cap[2] - dev.token_cap[0]) - fewer) <= 1

    def a100s(**memory):
        return ballonet.cluster("a800-4nic", num_nodes=1, gpus_per_node=2, nics_per_node=1, **memory)
    lengths = [int(0.9 * devices(a100s(), model).token_cap[0])] * 2
    assert plan_batch(lengths, a100s(), model).validate()
    with pytest.raises(InfeasiblePlan):
        plan_batch(lengths, a100s(memory_gb=64), model)


@pytest.mark.parametrize("model, tp", [("llama-7b", 64), ("llama-7b", 3), ("tiny", 4), ("llama3-8b", 16)])
def test_tp_must_divide_heads_and_kv_heads(model, tp):
    spec = ballonet.model(model)
    assert spec.num_heads % tp or spec.num_kv_heads % tp  # the case is one that does not divide
    with pytest.raises(InputError, match=f"tp={tp} must divide"):
        ballonet.model(model, tp=tp)


def test_tp_dividing_both_is_accepted():
    for name in ("llama-7b", "llama3-8b", "tiny"):
        spec = ballonet.model(name)
        for tp in (1, 2, 4, 8):
            if spec.num_heads % tp == 0 and spec.num_kv_heads % tp == 0:
                assert ballonet.model(name, tp=tp).tp == tp


def test_presets_win_over_same_named_local_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "h200-8nic").mkdir()
    (tmp_path / "cpu").write_text("not toml [[")
    assert ballonet.cluster("h200-8nic") == ballonet.specs.CLUSTERS["h200-8nic"]
    assert ballonet.cluster("cpu") == ballonet.specs.CLUSTERS["cpu"]
    with pytest.raises(InputError, match=r"\./h200-8nic: cannot read cluster file"):
        ballonet.cluster("./h200-8nic")  # a separator: the path, as given
    (tmp_path / "mine.toml").write_text('[[node_groups]]\ngpu = "a10"\n')
    assert ballonet.cluster("mine.toml").groups[0].gpu == "a10"
    (tmp_path / "mine").write_text('[[node_groups]]\ngpu = "l20"\n')
    assert ballonet.cluster("mine").groups[0].gpu == "l20"  # no preset of that name: the file
