"""Watching a training run (attncheck watch): the codes of its alerts and their thresholds. The detectors are
attncheck.watcher.trends (numpy over a log's series; the findings stay free of numpy and torch)."""

from __future__ import annotations

from attncheck.findings.base import Code, Example

# The alerts' defaults (attncheck watch's options; attncheck.watcher.trends.analyse's arguments)
DEFAULTS = {"window": 20, "level": 50.0, "growth": 2.0, "horizon": 1000.0, "collapse": 0.5, "rank_factor": 10.0}
DIVERGENCE_FLOOR = 1.0  # logits below this magnitude are compared as this (a ratio of two tiny logits says nothing)


def _watch_log(logit: str, limit: float = 3.4e38, nonfinite: str = "0") -> str:
    """A watch log of 40 steps whose one head's largest logit is ``logit`` (a Python expression of step)."""
    return f"""\
import json

with open("w.jsonl", "w") as fh:
    for step in range(1, 41):
        call = {{"module": "layers.0.attn", "kind": "sdpa", "dtype": "fp32", "path": "flash", "heads": 1,
                "max_logit": [{logit}], "collapsed": [0.0], "nonfinite_rows": {nonfinite}, "scale": 0.125,
                "limit": {{"logit": {limit!r}, "what": "S = Q@K^T"}}}}
        fh.write(json.dumps({{"schema": "attncheck.watch/1", "step": step, "calls": [call]}}) + "\\n")
"""


CODES: tuple[Code, ...] = (
    Code(
        "logit_growth",
        "warning",
        "watch",
        "a head's largest attention logit grows geometrically past a level",
        "A watch log (attncheck.watch) records every head's largest unmasked logit per step. Its logarithm, "
        "fitted by least squares over the last records, grows fast, and the logit has passed a level healthy "
        "heads stay below: the attention-logit growth that precedes divergence at high learning rates "
        "(Dehghani et al. 2023; Wortsman et al. 2023, whose small-scale proxy examples/logit_growth.py "
        "reproduces).",
        f"The fitted growth over the last --window records ({DEFAULTS['window']}) is at least --growth "
        f"(x{DEFAULTS['growth']:g}) per 100 steps, and the largest logit at least --logit-level "
        f"({DEFAULTS['level']:g}); reported at the first step both hold.",
        "the attention logits grow geometrically, as before divergence at a high learning rate: normalise q and k "
        "(qk-layernorm, Dehghani et al. 2023; Wortsman et al. 2023), lower the learning rate or clip the logits "
        "(QK-clip, soft-capping)",
        Example(_watch_log("2.0 ** (step / 4)"), "attncheck watch w.jsonl --fail-on logit_growth"),
    ),
    Code(
        "headroom_low",
        "warning",
        "watch",
        "at its growth, a head reaches its dtype's first failure soon",
        "The head's largest logit grows and, at the fitted rate, reaches the largest logit the call's dtype "
        "allows (SDPA's kernels: S in fp32; hand-written attention: S = Q@K^T in its dtype, before the scale) "
        "within the horizon. With --what-if DTYPES, the same for hand-written attention in those dtypes, "
        "reported apart.",
        "Steps until the limit, ln(limit / logit) / (fitted growth per step), below --horizon "
        f"({DEFAULTS['horizon']:g}), once the logit has passed --logit-level ({DEFAULTS['level']:g}) or the limit.",
        "at this growth the head's logits reach the first failure of its dtype within the horizon: act on the growth "
        "(qk-layernorm, learning rate, clipping) or hold the scores in a wider dtype",
        Example(
            _watch_log("60 * 1.05 ** step", limit=8190.0),
            "attncheck watch w.jsonl --horizon 200 --fail-on headroom_low",
        ),
    ),
    Code(
        "nonfinite",
        "error",
        "watch",
        "NaN or inf in a call's attention output or its gradients, during training",
        "A watch record counts, per attention call, the rows of its output holding NaN or inf (for eager "
        "softmax: NaN, +inf, or every key -inf in its scores) and the gradients of dq, dk, dv holding them.",
        "Any such row or gradient; reported at the first step it holds, per call, with its rank.",
        "NaN or inf in the attention output or its gradients: capture the step (attncheck capture, or "
        "attncheck.capture around it) to find the call, the head and the cause",
        Example(_watch_log("1.0", nonfinite="3 if step == 5 else 0"), "attncheck watch w.jsonl --fail-on nonfinite"),
    ),
    Code(
        "rank_divergence",
        "warning",
        "watch",
        "the same head's largest logit differs across ranks by a large factor",
        "Under torchrun each rank writes its own watch log. With DistributedDataParallel every rank holds the "
        "same weights, so a head's largest logit differs across ranks only as their batches differ, by far less "
        "than the factor. A head whose logit on one rank is many times another's means the ranks' weights have "
        "diverged (a change made on one rank after the wrap, parameters DDP does not synchronise, a broken "
        "all-reduce). Each rank's own trends are fitted apart: a rank that differs is never taken for growth. "
        "Where ranks hold different heads under one module name (tensor parallelism), the alert is expected: "
        "--ignore rank_divergence.",
        "At one step, max over ranks / min over ranks of the head's largest logit, magnitudes below "
        f"{DIVERGENCE_FLOOR:g} counted as {DIVERGENCE_FLOOR:g}, at least --rank-factor ({DEFAULTS['rank_factor']:g}); "
        "reported at the first such step, on the rank with the larger logit, naming the other.",
        "the ranks' weights differ where DDP keeps them identical: check that nothing changes parameters on one rank "
        "after the wrap, that every parameter is registered before wrapping, and that the ranks start from the same "
        "weights; with tensor parallelism (other heads on each rank) ignore it",
        Example(
            """\
import json

for rank, logit in ((0, 1.4), (1, 1.0e4)):
    with open(f"w.rank{rank}.jsonl", "w") as fh:
        for step in range(1, 11):
            call = {"module": "layers.0.attn", "kind": "sdpa", "dtype": "fp32", "path": "flash", "heads": 1,
                    "max_logit": [logit], "collapsed": [0.0], "scale": 0.125, "limit": {"logit": 3.4e38, "what": "S"}}
            fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "rank": rank, "world": 2, "calls": [call]}) + "\\n")
""",  # noqa: E501 - the example script's line, as the findings page shows it
            "attncheck watch w.rank0.jsonl w.rank1.jsonl --fail-on rank_divergence",
        ),
    ),
    Code(
        "no_attention",
        "error",
        "watch",
        "a watch log holds no attention call: nothing was watched",
        "attncheck.watch records the attention calls of the training forwards of the module it watches. A log "
        "without any call watched nothing: the module the training loop runs is not the one watched (and does "
        "not wrap it), the model ran in eval mode, or its calls were not seen (torch.compile'd code without "
        "compile='eager'). attncheck.watch warns at run time and writes a record with forwards 0 for a step "
        "that ended without a forward of the watched module; a log of such records is never 'no alert'.",
        "A rank's log with no call in any record.",
        "nothing was watched: watch the module the training loop calls, or the model inside a wrapper (DDP, FSDP, "
        "torch.compile and accelerate's wrappers are followed), train it in training mode, and pass compile='eager' "
        "for torch.compile'd code",
        Example(
            """\
import json

with open("w.jsonl", "w") as fh:
    for step in range(1, 4):
        fh.write(json.dumps({"schema": "attncheck.watch/1", "step": step, "forwards": 0, "calls": []}) + "\\n")
""",
            "attncheck watch w.jsonl --fail-on no_attention",
        ),
    ),
)
