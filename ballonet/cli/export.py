"""`ballonet export`: a training checkpoint as a Hugging Face model folder."""

from __future__ import annotations

import json

from ballonet.cli.common import subparser


def register(sub) -> None:
    p = subparser(sub, "export", cmd_export,
                  help="write a checkpoint as a Hugging Face model folder (config.json, model.safetensors, tokenizer)",
                  description="Export a `ballonet train` checkpoint for `transformers`' from_pretrained: the "
                              "built-in model as a LlamaForCausalLM, a Hugging Face model as itself. Nothing is "
                              "unpickled.")
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a --checkpoint-dir (its latest checkpoint is exported) or one checkpoint's step-N folder")
    p.add_argument("--out", required=True, metavar="HF_DIR",
                   help="the folder to write config.json, model.safetensors, generation_config.json and the "
                        "tokenizer's files to (created if missing; a folder of other files only with --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="write into a folder that no export wrote: its weights files are replaced, its other files "
                        "kept")
    p.add_argument("--tokenizer", metavar="DIR_OR_FILE", default=None,
                   help="the tokenizer to put beside the weights (a folder holding tokenizer.json, or the file); "
                        "default: the one in the corpus folder the run trained on, if any")
    p.add_argument("--json", action="store_true", help="print a JSON summary")


def cmd_export(args) -> int:
    from ballonet.training.checkpoints.export import export

    summary = export(args.checkpoint, args.out, overwrite=args.overwrite, tokenizer=args.tokenizer)
    if args.json:
        print(json.dumps(summary, indent=2, allow_nan=False))
    else:
        what = "LlamaForCausalLM" if summary["kind"] == "ballonet" else "its Hugging Face class"
        print(f"{summary['out']}: step {summary['step']} of {summary['checkpoint']}, "
              f"{summary['num_parameters']:,} parameters, as {what}")
    return 0
