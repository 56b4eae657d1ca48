"""``attncheck rope``: the RoPE table of a theta, head dim and dtype over a context, against float64, without a model.

Its own command rather than a ``sweep --preset``: sweep's grid draws q and k and its presets take only --seed and
--device, while RoPE's questions (theta, head dim, the dtype the positions are held in, context length) draw
nothing. Options are text checked by ``RopeConfig.from_text``; torch comes in only once they are good.
"""

from __future__ import annotations

import json
from typing import Optional

import typer

from attncheck.cli.common import EXIT_OK, check_output_path, fail, require_stdout, write_json, write_stdout
from attncheck.cli.options import JsonOpt
from attncheck.config.rope import RopeConfig
from attncheck.errors import AttncheckError
from attncheck.pipelines.rope import run_rope
from attncheck.report.rope import rope_json, rope_text


def rope(
    theta: str = typer.Option(
        "10000", "--theta", metavar="X,...", help="RoPE base theta (rope_theta); comma-separated for several."
    ),
    head_dim: str = typer.Option("128", "--head-dim", metavar="D,...", help="Head dimension d (even)."),
    dtype: str = typer.Option(
        "bf16",
        "--dtype",
        metavar="DTYPE,...",
        help=(
            "The dtype the table is computed in: positions, inverse frequencies, their product, cos and sin "
            "(fp16, bf16, fp32; transformers computes in fp32)."
        ),
    ),
    table: Optional[str] = typer.Option(
        None,
        "--table",
        metavar="DTYPE,...",
        help="The dtype cos and sin are cast to for the attention (transformers: the activations' dtype); "
        "default: --dtype; comma-separated for several.",
    ),
    rotation: Optional[str] = typer.Option(
        None,
        "--rotation",
        metavar="DTYPE,...",
        help="The dtype the rotation of q and k runs in, where narrower than the table; comma-separated for several.",
    ),
    context: str = typer.Option(
        "131072", "--context", metavar="N,...", help="Context length: positions 0 .. N-1 are audited."
    ),
    json_out: JsonOpt = None,
) -> None:
    """Audit a RoPE table against float64: where positions stop being distinct, and the angle error.

    The table is computed as a model computes it (inverse frequencies theta^(-2j/d) in fp32, then positions, product, cos and sin in --dtype, cast to --table) and compared with float64 cos and sin of the exact positions and inverse frequencies: the first position whose row repeats the one before (closed form: 2^bits + 1 of the dtype holding the positions: bf16 257, fp16 2049, fp32 16,777,217), non-finite rows (fp16 positions from 65,520), and the largest angle error in radians.

    Exit codes: 0 ran, 2 usage or input error.
    """  # noqa: E501 - a command's help: typer prints its line breaks as written
    try:
        require_stdout()
        config = RopeConfig.from_text(theta, head_dim, dtype, table, rotation, context)
        check_output_path(json_out, "--json")
        audits = run_rope(config)
        if json_out is not None:
            write_json(json.dumps(rope_json(audits), indent=2, allow_nan=False), json_out)
    except AttncheckError as e:
        raise fail(e) from None
    if json_out != "-":
        write_stdout(rope_text(audits))
    raise typer.Exit(EXIT_OK)
