"""`ballonet train --config FILE.toml`: the file's values under the flags given, the
resolved config read back as it was written, bad files refused with one line; a model
TOML and --vocab-size, checked against the corpus."""

import dataclasses

import pytest

import ballonet
from ballonet.cli import build_parser
from ballonet.training import config_file
from ballonet.training.config import TrainConfig


def _resolve(*argv):
    from ballonet.training.config import config_from_args

    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('lr = 0.01\nlr_decay = "cosine"\nwarmup-steps = 5\nsteps = 40\nresume = true\n'
                    'checkpoint_dir = "ckpt"\nmax_grad_norm = 1\n')
    config = _resolve("--config", str(path), "--steps", "7", "--seed", "3")
    assert (config.lr, config.lr_decay, config.warmup_steps, config.resume) == (0.01, "cosine", 5, True)  # file
    assert (config.steps, config.seed) == (7, 3)  # flags
    assert config.max_grad_norm == 1.0 and config.global_tokens == TrainConfig().global_tokens  # default
    assert _resolve("--steps", "7") == TrainConfig(steps=7)  # no file: the defaults under the flags


def test_the_resolved_config_reads_back_as_it_was(tmp_path):
    config = TrainConfig(model="tiny", corpus="a \"quoted\" path\\x", lr=2.5e-4, lr_decay="linear", min_lr=1e-5,
                         max_grad_norm=0.5, warmup_steps=3, resume=True, checkpoint_dir=str(tmp_path / "ck"),
                         eval_every=2, keep_checkpoints=5, vocab_size=512)
    path = config_file.write_resolved(config, str(tmp_path / "ck"))
    assert path == str(tmp_path / "ck" / "config.toml")
    assert _resolve("--config", path) == config
    assert TrainConfig(**config_file.read_config_file(path, TrainConfig)) == config
    assert "max_doc_tokens" not in open(path).read()  # unset fields are left out (TOML has no null)


def test_bad_config_files_are_one_line(tmp_path):
    cases = [("lr = 'fast'\n", "lr must be a number"), ("warmup_steps = 1.5\n", "warmup_steps must be an integer"),
             ("resume = 1\n", "resume must be true or false"), ("steps = true\n", "steps must be an integer"),
             ("learning_rate = 1\n", "unknown setting 'learning_rate'"), ("lr = \n", "malformed TOML"),
             ("lr_decay = 'exp'\n", "lr_decay must be one of constant, linear, cosine"),
             ("steps = -3\n", "steps must be positive, got -3")]
    for text, message in cases:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(ballonet.InputError, match=message) as e:
            _resolve("--config", str(path))
        assert "\n" not in str(e.value) and str(e.value).startswith(f"{path}: "), e.value  # named as the file names it
    path.write_text("steps = 3\n")  # a flag's own bad value is the flag's
    with pytest.raises(ballonet.InputError, match="^--steps must be positive"):
        _resolve("--config", str(path), "--steps", "-2")
    with pytest.raises(ballonet.InputError, match="cannot read config file"):
        _resolve("--config", str(tmp_path / "missing.toml"))


def test_schedule_settings_are_checked():
    for kwargs, message in [(dict(min_lr=1e-4), "--min-lr needs --lr-decay"),
                            (dict(lr_decay="cosine", min_lr=1.0), "above --lr"),
                            (dict(max_grad_norm=0.0), "--max-grad-norm must be positive"),
                            (dict(grad_accum=0), "--grad-accum must be positive"),
                            (dict(keep_checkpoints=0), "--keep-checkpoints must be positive"),
                            (dict(warmup_steps=-1), "--warmup-steps must be >= 0"),
                            (dict(eval_corpus="stdlib"), "--eval-corpus needs --eval-every")]:
        with pytest.raises(ballonet.InputError, match=message):
            TrainConfig(**kwargs)


def test_options_that_do_nothing_alone_are_refused_in_one_line(tmp_path):
    """Issue 47.6: each of these was accepted without a word; from the flags and from a
    --config file alike, one line, exit 2."""
    cases = [(["--async-checkpoint"], "--async-checkpoint needs --checkpoint-dir"),
             (["--gpus-per-node", "2"], "--gpus-per-node needs --nproc"),
             (["--max-restarts", "1"], "--max-restarts needs --nproc"),
             (["--warmup-steps", "30", "--steps", "20"], "--warmup-steps 30 is over --steps 20"),
             (["--eval-every", "50", "--steps", "20"], "--eval-every 50 is over --steps 20"),
             (["--checkpoint-every", "50", "--checkpoint-dir", "ck"], "--checkpoint-every 50 is over --steps 20"),
             (["--resume-from", "4"], "needs --checkpoint-dir"),
             (["--keep-checkpoints", "5"], "--keep-checkpoints needs --checkpoint-dir"),
             (["--checkpoint-dir", "ck", "--resume-from", "3", "--no-resume"], "it contradicts --no-resume"),
             (["--profile-steps", "3"], "--profile-steps must be A:B"),
             (["--profile-steps", "5:30"], "1 <= A <= B <= --steps 20"),
             (["--seed", str(2**80)], "--seed must be at most"),
             (["--timeout-minutes", "1e12"], "--timeout-minutes must be positive and at most")]
    for argv, message in cases:
        with pytest.raises(ballonet.InputError, match=message) as e:
            _resolve(*argv)
        assert "\n" not in str(e.value)
    path = tmp_path / "run.toml"
    path.write_text("async_checkpoint = true\n")
    with pytest.raises(ballonet.InputError, match="run.toml: async_checkpoint needs --checkpoint-dir"):
        _resolve("--config", str(path))
    config = _resolve("--checkpoint-dir", str(tmp_path), "--resume-from", "4", "--profile-steps", "2:3")
    assert config.resume and config.profile_range() == (2, 3)
    from ballonet.cli import main

    assert main(["train", "--async-checkpoint"]) == 2


def test_a_model_toml_sets_size_and_vocabulary(tmp_path):
    small = tmp_path / "small.toml"
    small.write_text('base = "tiny"\nnum_layers = 3\nvocab_size = 2000\n')
    spec = ballonet.model(str(small))
    assert (spec.name, spec.num_layers, spec.vocab_size, spec.hidden) == ("small", 3, 2000, 64)
    full = tmp_path / "full.toml"
    full.write_text("num_layers = 2\nhidden = 32\nnum_heads = 4\nnum_kv_heads = 1\nffn_hidden = 64\n"
                    "vocab_size = 300\n")
    assert dataclasses.asdict(ballonet.model(str(full))) == dataclasses.asdict(
        ballonet.ModelSpec(name="full", num_layers=2, hidden=32, num_heads=4, num_kv_heads=1, ffn_hidden=64,
                           vocab_size=300))
    for text, message in [("hidden = 64\n", "field 'num_layers' is missing"), ('base = "gpt"\n', "not a model preset"),
                          ('base = "tiny"\nlayers = 3\n', "unknown field 'layers'"),
                          ('base = "tiny"\nhidden = 66\n', "not a multiple of num_heads")]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ballonet.InputError, match=message):
            ballonet.model(str(bad))


def test_the_vocabulary_is_checked_against_the_corpus_in_one_line(tmp_path):
    from ballonet.training.loop import preflight

    corpus = tmp_path / "ids.jsonl"
    corpus.write_text("".join(f'{{"input_ids": [{i}, 5, 1999, 7]}}\n' for i in range(8)))
    with pytest.raises(ballonet.InputError) as e:
        preflight(TrainConfig(corpus=str(corpus), global_tokens=32), 1)
    message = str(e.value)
    assert "token ids up to 1999" in message and "--vocab-size 2000" in message and "\n" not in message
    _, spec, _ = preflight(TrainConfig(corpus=str(corpus), global_tokens=32, vocab_size=2000), 1)
    assert spec.vocab_size == 2000
    model = tmp_path / "wide.toml"
    model.write_text('base = "tiny"\nvocab_size = 4096\n')
    assert preflight(TrainConfig(corpus=str(corpus), global_tokens=32, model=str(model)), 1)[1].vocab_size == 4096
