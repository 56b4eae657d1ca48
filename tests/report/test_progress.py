"""report/progress.py: the bar appears after its delay, counts every unit, and hides finished tasks."""

from attncheck.report.progress import Progress


def test_disabled_bar_gives_no_callback():
    with Progress(False) as progress:
        assert progress.track("x", 10) is None


def test_a_finished_task_leaves_the_screen_and_the_next_one_shows():
    with Progress(True, delay=0.0, force_terminal=True) as progress:
        first = progress.track("a.npy", 10)
        first(4)
        first(6)
        second = progress.track("b.npy", 20)
        second(5)
        tasks = {t.description: t for t in progress._progress.tasks}
        assert tasks["a.npy"].completed == 10 and not tasks["a.npy"].visible
        assert tasks["b.npy"].completed == 5 and tasks["b.npy"].visible
        assert [t.description for t in progress._progress.tasks if t.visible] == ["b.npy"]


def test_no_bar_before_the_delay():
    with Progress(True, delay=3600.0, force_terminal=True) as progress:
        tick = progress.track("a.npy", 10)
        tick(3)
        assert progress._progress is None
