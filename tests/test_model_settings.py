"""Judging a kernel's settings grid (``model.setting_choices``): the best is the least error among the settings
the kernel takes that break nothing, and a tie goes to the kernel's default."""

from types import SimpleNamespace

from attncheck.model import SETTING_TIE, setting_choices
from attncheck.results import Cell, Finding


def cell(label, out_err, *, default=False, refused=None, nan_rows=0, dtype="e4m3"):
    causes = {"qk_overflow": nan_rows} if nan_rows else {}
    c = Cell("fa4", dtype, 64, nan_rows, causes, 0, 0, 0, {}, 64, out_err / 10, *[None] * 7, 0, path="fa4")
    c.out_rel_l1 = out_err
    t, o = (float(x[1:]) for x in label.split(","))
    c.variant, c.setting = label, {"rescale_threshold": t, "max_offset": o, "default": default, "refused": refused}
    return c


def choose(cells, findings=()):
    (choice,) = setting_choices(SimpleNamespace(cells=cells, findings=list(findings)))
    return choice


def test_the_least_error_wins_and_the_default_is_named_beside_it():
    choice = choose([cell("t0,o4", 0.02), cell("t0,o8", 0.05, default=True), cell("t4,o4", 0.03)])
    assert (choice.best, choice.default, choice.metric) == ("t0,o4", "t0,o8", "out_rel_l1")
    assert choice.point("t0,o8").err == 0.05


def test_a_tie_goes_to_the_default():
    near = 0.05 * (1 - SETTING_TIE / 2)  # within the tie of the default's error
    assert choose([cell("t0,o4", near), cell("t0,o8", 0.05, default=True)]).best == "t0,o8"
    below = 0.05 * (1 - 2 * SETTING_TIE)
    assert choose([cell("t0,o4", below), cell("t0,o8", 0.05, default=True)]).best == "t0,o4"


def test_refused_broken_and_error_finding_settings_are_never_best():
    cells = [
        cell("t4,o8", 0.001, refused="the kernel asserts"),
        cell("t0,o4", 0.002, nan_rows=3),
        cell("t4,o4", 0.003),
        cell("t0,o8", 0.05, default=True),
    ]
    saturated = Finding("p_saturation", "error", "P saturates", "lower the offset", cells=["fa4(t4,o4)/e4m3"], rows=5)
    choice = choose(cells, [saturated])
    assert choice.best == "t0,o8"
    assert choice.point("t4,o4").findings == ["p_saturation"] and choice.point("t4,o4").calls_bad == 1
    assert choice.point("t4,o8").refused == "the kernel asserts"


def test_no_best_where_every_setting_breaks():
    assert choose([cell("t0,o8", 0.05, default=True, nan_rows=1)]).best is None
