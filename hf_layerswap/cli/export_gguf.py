"""The ``hf-layerswap export-gguf`` verb: a checkpoint folder as one GGUF file through
:func:`~hf_layerswap.export_gguf` (llama.cpp's converter plus the per-layer attention
metadata), refused where llama.cpp cannot express the layout."""

from __future__ import annotations

import sys

from ..utils.extras import require
from ..gguf_export import CONVERTER_ENV, OUTTYPES, GGUFConversionError, GGUFConverterNotFoundError, export_gguf
from .options import HELP_FORMATTER, check_paths

__all__ = ["add_export_gguf_arguments", "add_parser", "run_export_gguf"]


def add_parser(subparsers):
    """Register the ``export-gguf`` verb on ``subparsers`` (``ArgumentParser.add_subparsers()``)."""
    export = subparsers.add_parser("export-gguf", formatter_class=HELP_FORMATTER,
                                   help="convert a checkpoint to GGUF (llama.cpp), layout kept")
    add_export_gguf_arguments(export).set_defaults(func=run_export_gguf)
    return export


def add_export_gguf_arguments(parser):
    """Add the ``export-gguf`` verb's arguments to ``parser`` (an ``add_subparsers`` child)."""
    parser.description = (
        "Convert a checkpoint folder to one GGUF file with llama.cpp's converter, adding the per-layer "
        "attention metadata llama.cpp reads (refused where llama.cpp cannot express the layout)."
    )
    parser.add_argument("checkpoint", help="transformers checkpoint folder (e.g. written by 'hf-layerswap prune')")
    parser.add_argument("output", help="the .gguf file to write")
    parser.add_argument("--outtype", default="f16", choices=list(OUTTYPES), help="tensor type of the 2-D weights")
    parser.add_argument("--converter", default=None,
                        help=f"convert_hf_to_gguf.py or a folder holding it (default: ${CONVERTER_ENV}, then "
                             "<venv>/gguf-converter)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    return parser


def run_export_gguf(args) -> int:
    """The ``export-gguf`` verb."""
    check_paths(inputs=[("CHECKPOINT", args.checkpoint)], outputs=[("OUTPUT", args.output, "file")],
                overwrite=args.overwrite)
    gguf = require("gguf", "export-gguf")
    try:
        path = export_gguf(args.checkpoint, args.output, outtype=args.outtype, converter=args.converter,
                           overwrite=args.overwrite)
    except (GGUFConverterNotFoundError, GGUFConversionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reader = gguf.GGUFReader(path)
    arch = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    blocks = reader.get_field(f"{arch}.block_count").contents()
    pattern = reader.get_field(f"{arch}.attention.sliding_window_pattern")
    extra = f", sliding-window pattern {pattern.contents()}" if pattern is not None else ""
    print(f"wrote {path} ({arch}, {blocks} blocks, {len(reader.tensors)} tensors, {args.outtype}{extra})")
    return 0
