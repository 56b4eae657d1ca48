"""A call's learned sinks (gpt-oss: one logit per query head joining the softmax's denominator, no value): what
each head's sink takes of the denominator, what it does to the output in the call's dtype, and what a kernel that
drops it would compute instead."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SinkHead:
    """One query head's sink. Shares are of the float64 denominator, exp(sink - m) / (sum_j exp(s_j - m) +
    exp(sink - m)) with m the row's max over keys and sink, over the rows (batch x queries) of the head that see a
    key. Outputs are O = P @ V over the head's rows (the probabilities where the call has no v)."""

    head: int
    sink: float  # the sink logit as the call holds it (in the scores' units: after scale and mask)
    share_max: float
    share_median: float
    changed: int  # elements of the model's output that differ bit for bit when the sink is left out, in the dtype
    err_model: float  # max |O - O_float64| of the model's cell (the sink in its denominator)
    err_nosinks: float  # max |O - O_float64| of the cell without the sink (a kernel that drops it)
    diff_nosinks: float  # max |O_nosinks - O_model|: what dropping the sink changes in the dtype
    rel_model: float  # ||O - O_float64|| / ||O_float64|| (L2 over the head's output)
    rel_nosinks: float
    # rows (batch x queries) that see no key (every score -inf or a mask sentinel: padding): there the sink takes the
    # whole denominator (share 1, output 0) and a cell without it has no softmax; they are left out of the shares and
    # of the nosinks numbers above (the share is NaN where the sink or the scores are)
    masked_rows: int = 0


@dataclass
class SinkFacts:
    """A call's sinks, per query head, in the call's dtype."""

    dtype: str  # 'bf16': the dtype of the model's cell
    # half the dtype's smallest relative spacing, finfo.eps / 4 (bf16: 2^-9): a relative change below it moves no value
    # by half a unit in the last place wherever it lies in its binade
    rounding: float
    elements: int  # output elements per head (batch x queries x head dim)
    heads: list[SinkHead] = field(default_factory=list)
    # the call was not given the sinks its module holds (an SDPA call in gpt-oss's attention): the "model's cell" above
    # is then the eager cell with them, what the module should compute, and the call computed the one without them
    ignored: bool = False
    grads_left_out: bool = False  # the call's gradients were recorded: the backward with sinks is not computed yet
    nosinks: bool = False  # the what-if asked (--what-if nosinks or kernels): the report shows it
