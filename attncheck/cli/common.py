"""Pieces every command shares: exit codes, the one-line error (with library parameters
shown as flags), output paths.

Free of torch and numpy so argument checking stays fast.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import sys

import typer
import typer.core
from rich.console import Console
from typer import Abort

from attncheck.errors import AttncheckError
from attncheck.format import visible

try:  # typer >= 0.26 bundles its own click
    from typer._click.exceptions import ClickException, UsageError
except ImportError:  # pragma: no cover - older typer uses the click package
    from click.exceptions import ClickException, UsageError

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def reuse_freed_memory() -> None:
    """Ask glibc to keep freed memory for reuse instead of unmapping it.

    A diagnosis allocates and frees the same tensors of a few MiB chunk after chunk.
    By default glibc's thresholds for mmap and for trimming the heap move with the
    traffic, and some of those buffers come back to the kernel on free, so the next
    chunk pays a page fault for every 4 KiB of them again (it made the tiled method
    3x slower in bf16). Fixed thresholds keep blocks under 32 MiB in the heap, and a
    freed heap is reused rather than trimmed. The peak resident memory is unchanged:
    it is what the largest chunk needs, and --max-memory bounds that. Does nothing
    off Linux/glibc.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from <malloc.h>
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
    mallopt(m_trim_threshold, 1 << 30)


def no_spin_waiting() -> None:
    """Make idle OpenMP threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``),
    unless the user chose a policy.

    torch's CPU ops and numba's parallel kernels (its ``omp`` threading layer) run on
    libgomp, whose idle threads spin for a while after each parallel region by default.
    A diagnosis runs thousands of short regions, so on a busy machine the spinning
    threads take the cores that the working ones need: beside one CPU-bound process on
    a 2-core machine, `sweep` ran 4-6x and `run` 1.2-1.5x slower. libgomp reads the
    variable when it is loaded, so this must run before torch or numba is imported.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


# Library parameters whose flag is not '--' + the name with dashes.
FLAGS = {
    "dtypes": "--dtype",
    "methods": "--method",
    "keys": "--key",
    "reverse": "--order",
    "dks": "--dk",
    "scales": "--scale",
    "seqs": "--seq",
    "stds": "--std",
    "chunk_elements": "--max-memory",
    "kernels": "ATTNCHECK_KERNELS",
    "paths": "--path",
    "p_scale": "--p-scale",
    "fp8_scaling": "--fp8-scaling",
    "incoherent": "--incoherent",
    "fp8_accum": "--fp8-accum",
    "fp8_flush": "--fp8-flush",
    "script": "SCRIPT",
    "forwards": "--forward",
    "modules": "--module",
    "path": "--out",
    "diagnose": "--no-save",
}


def flag(parameter: str) -> str:
    """A library parameter as the command line spells it: 'dtypes' -> '--dtype'."""
    return FLAGS.get(parameter) or ("--" + parameter.replace("_", "-") if parameter.isidentifier() else parameter)


def say(line: str) -> None:
    """One line on stderr, as it is: names it quotes come from files, so a control character or an
    escape sequence in them is shown (``format.visible``), never acted on or split into lines."""
    try:
        typer.echo(visible(line), err=True)
    except (OSError, ValueError):  # stderr closed (2>&-) or full: the exit code still says how the command ended
        pass


def fail(error: AttncheckError | str) -> typer.Exit:
    """Print one line on stderr and return the Exit(2) to raise."""
    message = error.render(flag) if isinstance(error, AttncheckError) else error
    say(f"attncheck: error: {message}")
    return typer.Exit(EXIT_USAGE)


def one_stdout(**targets: str | None) -> None:
    """At most one report can go to standard output ('-')."""
    dashed = [flag(name) for name, target in targets.items() if target == "-"]
    if len(dashed) > 1:
        raise AttncheckError(f"{' and '.join(dashed)} both write to standard output ('-'); send one of them to a file")


def check_output_path(path: str | None, option: str, dash_ok: bool = True) -> None:
    """Fail before any work when an output file cannot be created ('-' is stdout)."""
    if path is None or (dash_ok and path == "-"):
        return
    if not path.strip():
        raise AttncheckError(f"{option} is an empty name; give a file name")
    if path == "-":
        raise AttncheckError(f"{option} needs a file name: it does not write to standard output ('-')")
    if os.path.isdir(path):
        raise AttncheckError(f"cannot write {option} {path}: it is a folder; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise AttncheckError(f"cannot write {option} {path}: folder {folder} does not exist")
    try:
        longest = os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        longest = 255
    if len(os.fsencode(os.path.basename(path))) > longest:
        raise AttncheckError(
            f"cannot write {option} {path[:60]}...: the file name is longer than the {longest} bytes this folder takes"
        )


def out_of_memory(error: BaseException) -> str | None:
    """The one line for an allocation the machine refused (MemoryError, torch's allocators), else None."""
    text = str(error)
    if (
        isinstance(error, MemoryError)
        or "can't allocate memory" in text
        or "out of memory" in text.lower()
        or "not enough memory" in text
    ):
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(error).__name__)
        return (
            f"out of memory: the machine refused an allocation ({first[:160]}); "
            "lower --max-memory, or give inputs that fit"
        )
    return None


# What writing to a full disk or device, or to a closed pipe, raises.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EDQUOT, errno.EFBIG, errno.EIO}


class StdoutError(AttncheckError):
    """Standard output refused a report: a full disk or device, or no standard output at all."""

    def __init__(self, error: BaseException | str) -> None:
        why = error if isinstance(error, str) else (getattr(error, "strerror", None) or error)
        super().__init__(f"cannot write the report to standard output: {why}")
        _drop_stdout()


CLOSED = "it is closed (the shell ran the command with >&-); redirect it to a file or /dev/null"


def require_stdout() -> None:
    """Refuse, before any work, to run a command whose report goes to a closed standard output
    (``>&-``: Python then has no ``sys.stdout`` at all)."""
    if sys.stdout is None:
        raise StdoutError(CLOSED)


def _broken_pipe(error: BaseException) -> bool:
    """The reader of a pipe went away (``| head -1``): not an error of the command. What is left
    of the report goes to /dev/null and the command ends as it would have, quietly, with its own exit code."""
    if isinstance(error, BrokenPipeError) or getattr(error, "errno", None) == errno.EPIPE:
        _drop_stdout()
        return True
    return False


def _drop_stdout() -> None:
    """Send what is left for standard output to /dev/null, so that Python's own flush at exit does
    not fail once more (with a traceback)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (OSError, ValueError, AttributeError):  # not a file (a test's buffer), or no stdout at all
        pass


class GuardedStdout:
    """Standard output for Rich consoles: a write it refuses raises StdoutError (one line, exit 2)
    instead of an OSError traceback, a closed pipe ends the report quietly. Looks up ``sys.stdout``
    on every call (tests swap it)."""

    def write(self, text: str) -> int:
        if sys.stdout is None:
            raise StdoutError(CLOSED)
        try:
            return sys.stdout.write(text)
        except (OSError, ValueError) as e:
            if _broken_pipe(e):
                return len(text)
            raise StdoutError(e) from None

    def flush(self) -> None:
        if sys.stdout is None:
            raise StdoutError(CLOSED)
        try:
            sys.stdout.flush()
        except (OSError, ValueError) as e:
            if not _broken_pipe(e):
                raise StdoutError(e) from None

    def isatty(self) -> bool:
        return sys.stdout is not None and sys.stdout.isatty()

    def fileno(self) -> int:
        if sys.stdout is None:
            raise StdoutError(CLOSED)
        return sys.stdout.fileno()

    @property
    def encoding(self) -> str:
        return getattr(sys.stdout, "encoding", None) or "utf-8"


def report_console():
    """The console reports are printed on: standard output, no markup read (names are Text), a
    refused write one line."""
    require_stdout()
    return Console(file=GuardedStdout(), markup=False)


def write_stdout(text: str) -> None:
    require_stdout()
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError) as e:
        if not _broken_pipe(e):
            raise StdoutError(e) from None


def open_output(path: str, mode: str = "w"):
    """A report file opened for writing (``mode`` 'a': appending). A FIFO (``mkfifo``; ``--json >(jq .)`` is one too) is
    opened without waiting: one that no process reads would block the command for ever, so it is an error."""
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except (OSError, ValueError):
        fifo = False  # not there yet (or not reachable): open() says why
    if not fifo:
        return open(path, mode, encoding="utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            why = "it is a FIFO that no process reads; start its reader first, or give a file"
            raise OSError(errno.ENXIO, why) from None
        raise
    os.set_blocking(fd, True)  # a reader is there: write as to any pipe
    return os.fdopen(fd, "w", encoding="utf-8")


def write_text(text: str, path: str, option: str) -> None:
    """Write a report file, or standard output for '-'; an unwritable path is an input error."""
    if path == "-":
        write_stdout(text)
        return
    try:
        with open_output(path) as fh:
            fh.write(text)
    except OSError as e:
        raise AttncheckError(f"cannot write {option} {path}: {e.strerror or e}") from None


def write_json(text: str, target: str) -> None:
    """Write JSON text to a file, or to stdout for '-'; unwritable paths are input errors."""
    if target == "-":
        write_stdout(text + "\n")
        return
    try:
        with open_output(target) as fh:
            fh.write(text + "\n")
    except OSError as e:
        raise AttncheckError(f"cannot write {target}: {e.strerror or e}") from None


class PlainFlags:
    """Help that shows a flag as just its name, and an argument by its metavar: typer writes
    a type for every parameter, and ``<bool>`` beside --brief or --help, or ``<list[str]>``
    beside PATH, tells a reader nothing. Choices (``<forward|reverse>``) stay."""

    def get_params(self, ctx):
        params = super().get_params(ctx)  # type: ignore[misc]
        for p in params:
            if getattr(p, "is_flag", False) or isinstance(p, typer.core.TyperArgument):
                p.display_type_rich = lambda ctx: None  # this instance only
        return params


class Command(PlainFlags, typer.core.TyperCommand):
    """Every attncheck command."""


class OneLineErrorsGroup(PlainFlags, typer.core.TyperGroup):
    """Typer group whose usage errors are one line on stderr (exit 2), like attncheck's own.

    Typer would print a multi-line panel; scripts and CI logs read one line better.
    """

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args=args, prog_name=prog_name, complete_var=complete_var, standalone_mode=False, **extra)
        except UsageError as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()
                code = e.exit_code
            else:
                hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
                typer.echo(f"attncheck: error: {e.format_message()}{hint}", err=True)
                code = EXIT_USAGE
        except ClickException as e:
            typer.echo(f"attncheck: error: {e.format_message()}", err=True)
            code = e.exit_code
        except Abort:
            typer.echo("attncheck: aborted", err=True)
            code = EXIT_FAILED
        except AttncheckError as e:  # standard output refused a report (StdoutError), where no command catches it
            fail(e)
            code = EXIT_USAGE
        except (MemoryError, RuntimeError) as e:
            why = out_of_memory(e)
            if why is None:  # a bug, with its traceback
                raise
            fail(why)
            code = EXIT_USAGE
        except OSError as e:
            if e.errno not in _OUTPUT_ERRNOS:  # not what a refused write to standard output (--help, --version) raises
                raise
            if _broken_pipe(e):
                code = EXIT_OK
            else:
                fail(StdoutError(e))
                code = EXIT_USAGE
        else:
            code = rv if isinstance(rv, int) else EXIT_OK
        try:
            if sys.stdout is not None:
                sys.stdout.flush()  # a report small enough to sit in the buffer meets a full disk only now
        except (OSError, ValueError) as e:
            if not _broken_pipe(e):
                fail(StdoutError(e))
                code = EXIT_USAGE
        if not standalone_mode:
            return code
        sys.exit(code)
