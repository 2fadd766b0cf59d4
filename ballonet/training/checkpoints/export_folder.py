"""The folder `ballonet export --out` writes: whole or not at all, never over what it did
not make.

- `check_out`: `--out` is a new or empty folder, or an earlier export (it holds
  `ballonet-export.json`, the list of the files that export wrote); any other folder only
  with `--overwrite`; never a symlink, nor a file.
- `replace_folder`: every file is written into a temporary folder beside `--out`, which
  then takes its place by rename. Of the folder it replaces, the files an earlier export
  wrote and every weights file (`pytorch_model.bin`, another `*.safetensors`, a shard
  index: `transformers` could load them instead of the new weights) go; the user's other
  files (a README, say) move into the new folder. A full disk or any failure leaves
  `--out` as it was and no temporary folder behind.
- The tokenizer's files (`tokenizer.json`, ...) of `--tokenizer`, or the `tokenizer.json`
  of the prepared corpus the run trained on (its `config.toml` in the checkpoint folder
  says which; a folder that `ballonet prepare` did not write is not read), and a
  `generation_config.json`, so that `AutoTokenizer` and `generate` load the folder. Every
  file is read through `user_files` (regular files, capped, links only inside the folder).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

from ballonet import user_files
from ballonet.errors import InputError
from ballonet.training.checkpoints.safe_dcp import fsync_path
from ballonet.training.config_file import RESOLVED
from ballonet.training.data.corpus import MANIFEST, PREPARED_FORMAT, TOKENIZER_FILE

MARKER = "ballonet-export.json"
GENERATION = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
"""The files of a Hugging Face tokenizer, as `save_pretrained` writes them."""
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".index.json")
EXPORT_FILES = frozenset({"config.json", GENERATION, MARKER, *TOKENIZER_FILES})
"""The names an export writes besides its weights (which go anyway: `_is_weights`)."""


def check_out(out: str, overwrite: bool) -> None:
    """Before any work: InputError unless `out` may be written (see the module's doc)."""
    if os.path.islink(out):
        raise InputError(f"--out {out}: is a symlink; give a folder (nothing is written through a link)")
    if os.path.exists(out) and not os.path.isdir(out):
        raise InputError(f"--out {out}: is a file; give a folder")
    if os.path.isdir(out) and not overwrite:
        names = sorted(os.listdir(out))
        if names and MARKER not in names:
            raise InputError(f"--out {out}: holds files that no export wrote ({names[0]!r}...); give a new or empty "
                             "folder, or --overwrite to replace its weights and keep its other files")
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise InputError(f"--out {out}: {parent} is a file")
    if not os.path.isdir(parent):  # as every other output: a mistyped path makes no tree of folders
        raise InputError(f"--out {out}: folder {parent!r} does not exist")


def _earlier_files(out: str) -> set[str]:
    """The files the export that wrote `out` listed in its marker (none if unreadable),
    of the names an export writes: a marker listing `notes.txt` deletes no notes."""
    try:
        record = user_files.read_json(os.path.join(out, MARKER), "json", out, what="an export's record")
    except InputError:
        return set()
    files = record.get("files") if isinstance(record, dict) else None
    return {n for n in files if isinstance(n, str) and n in EXPORT_FILES} if isinstance(files, list) else set()


def _is_weights(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def replace_folder(out: str, write: Callable[[str], None], info: dict) -> list[str]:
    """`write(folder)` fills a temporary folder beside `out`, which then replaces `out`
    (see the module's doc); returns the names written. InputError naming `out` on a
    failure to write, `out` untouched."""
    out = os.path.abspath(out)
    parent, name = os.path.split(out)
    tmp = os.path.join(parent, f".{name}.export-tmp-{os.getpid()}")
    old = os.path.join(parent, f".{name}.export-old-{os.getpid()}")
    moved: list[str] = []
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        write(tmp)
        files = sorted(os.listdir(tmp))
        write_json(os.path.join(tmp, MARKER), {"files": files, **info})
        if os.path.isdir(out):
            gone = _earlier_files(out) | set(files) | {MARKER}
            for entry in sorted(os.listdir(out)):
                if entry not in gone and not _is_weights(entry):
                    os.rename(os.path.join(out, entry), os.path.join(tmp, entry))
                    moved.append(entry)
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_path(parent)
        return files
    except BaseException as e:
        if os.path.isdir(out):  # the user's files back where they were
            for entry in moved:
                if os.path.lexists(os.path.join(tmp, entry)):
                    os.rename(os.path.join(tmp, entry), os.path.join(out, entry))
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or type(e).__name__ == "SafetensorError":
            reason = getattr(e, "strerror", None) or str(e).splitlines()[0][:200]
            raise InputError(f"--out {out}: cannot write the export ({reason}); nothing was written") from None
        raise


def write_json(path: str, value) -> None:
    """Strict JSON (no NaN or Infinity, which strict parsers refuse), fsynced."""
    try:
        text = json.dumps(value, indent=2, sort_keys=True, allow_nan=False)
    except ValueError as e:
        raise InputError(f"{path}: refusing to write a value JSON cannot hold ({e})") from None
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")
        f.flush()
        os.fsync(f.fileno())


def generation_config(config: dict) -> dict:
    """generation_config.json as transformers derives it from a model's config."""
    from transformers import GenerationConfig, PretrainedConfig

    derived = GenerationConfig.from_model_config(PretrainedConfig(**{
        k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
        if config.get(k) is not None}))
    return derived.to_dict()


def _corpus_folder(step_path: str) -> str | None:
    """The prepared corpus folder the run that wrote checkpoint `step_path` trained on,
    from the `config.toml` beside it (None if it trained on no folder written by `ballonet
    prepare`, or says nothing): a name in a checkpoint's file leads to no other folder."""
    resolved = os.path.join(os.path.dirname(os.path.abspath(step_path)), RESOLVED)
    if not os.path.lexists(resolved):
        return None
    user_files.inside(os.path.dirname(resolved), resolved)
    corpus = user_files.read_toml(resolved, "resolved config").get("corpus")
    if not isinstance(corpus, str) or not os.path.isdir(corpus) or not os.path.lexists(os.path.join(corpus, MANIFEST)):
        return None
    manifest = user_files.read_json(os.path.join(corpus, MANIFEST), "json", corpus, what="a prepared corpus manifest")
    return corpus if isinstance(manifest, dict) and manifest.get("format") == PREPARED_FORMAT else None


def tokenizer_files(tokenizer: str | None, step_path: str) -> list[str]:
    """The tokenizer files to copy: those of `tokenizer` (a folder or a tokenizer.json:
    InputError if it holds none), or of the corpus folder the checkpoint's run trained on
    (none there: none). Regular files only, never through a symlink."""
    if tokenizer is not None:
        if not os.path.isdir(tokenizer):
            user_files.check(tokenizer, "tokenizer", what="a tokenizer")  # a FIFO, a device: one line
            return [tokenizer]
        found = _regular(tokenizer)
        if not found:
            raise InputError(f"--tokenizer {tokenizer}: holds no tokenizer file ({', '.join(TOKENIZER_FILES)})")
        return found
    folder = _corpus_folder(step_path)
    return [p for p in _regular(folder) if os.path.basename(p) == TOKENIZER_FILE] if folder else []


def _regular(folder: str) -> list[str]:
    """The tokenizer files in `folder`, each a regular file within the size cap, a link
    only inside the folder (`user_files`' policy)."""
    paths = [os.path.join(folder, n) for n in TOKENIZER_FILES]
    found = [p for p in paths if os.path.lexists(p)]
    for p in found:
        user_files.check(p, "tokenizer", folder, what="a tokenizer file")
    return found


def copy_tokenizer(sources: list[str], folder: str, config: dict) -> None:
    """Copy the tokenizer files into `folder`; a tokenizer.json alone gets a
    tokenizer_config.json (the fast tokenizer class, the model's context)."""
    for src in sources:
        target = os.path.basename(src) if os.path.basename(src) in TOKENIZER_FILES else "tokenizer.json"
        data = user_files.read_bytes(src, "tokenizer", what="a tokenizer file")
        with open(os.path.join(folder, target), "wb") as f:
            f.write(data)
    names = {os.path.basename(s) for s in sources}
    if sources and "tokenizer_config.json" not in names:
        settings = {"tokenizer_class": "PreTrainedTokenizerFast"}
        if isinstance(config.get("max_position_embeddings"), int):
            settings["model_max_length"] = config["max_position_embeddings"]
        write_json(os.path.join(folder, "tokenizer_config.json"), settings)
